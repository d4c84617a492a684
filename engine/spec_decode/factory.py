"""Building the configured proposer (imports every proposer module, so all are registered)."""

from __future__ import annotations

from tandem.engine.config import SpeculativeConfig
from tandem.engine.spec_decode import draft_model, ngram  # noqa: F401  (they register)
from tandem.engine.spec_decode.proposer import PROPOSERS, Proposer


def get_proposer(config: SpeculativeConfig, engine) -> Proposer:
    """The proposer ``config.method`` names, for ``engine`` (an
    :class:`~tandem.engine.runtime.llm_engine.LLMEngine`).

    Raises:
        ValueError: no proposer of that name; the proposer's own errors (e.g. a
            draft model with another vocabulary).
    """
    try:
        factory = PROPOSERS[config.method]
    except KeyError:
        raise ValueError(f"method: unknown speculative method {config.method!r}, "
                         f"expected one of {', '.join(sorted(PROPOSERS))}") from None
    return factory(config, engine)
