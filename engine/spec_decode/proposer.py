"""The proposer interface and its registry."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from tandem.engine.scheduling.request import Request


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request.

    Attributes:
        token_ids: the drafts, in order (at most ``num_speculative_tokens``).
        probs: ``[len(token_ids), V]`` float32, the processed distribution each
            draft was drawn from (a draft model's sampled drafts), or None when
            the drafts are deterministic (n-gram lookup, greedy drafting): the
            verifier then treats each as a point mass.
    """

    token_ids: tuple[int, ...]
    probs: "torch.Tensor | None" = None


class Proposer(abc.ABC):
    """Drafts tokens for running requests, once per engine step.

    The engine calls :meth:`propose` after every step with the running requests
    whose next step is a decode, and :meth:`free` when a request finishes, is
    aborted or preempted (its drafting state, e.g. a draft model's KV, goes).
    """

    @abc.abstractmethod
    def propose(self, requests: list["Request"], max_tokens: dict[str, int]
                ) -> dict[str, Proposal]:
        """Drafts for some of ``requests``.

        Args:
            requests: running requests whose next step decodes their last token.
            max_tokens: request id -> the most drafts it may take (>= 1; bounded
                by ``num_speculative_tokens``, ``max_tokens`` and the context length).

        Returns:
            request id -> its :class:`Proposal`; requests without one verify nothing.
        """

    def free(self, request_id: str) -> None:
        """Forget a request's drafting state (default: there is none)."""

    def check_invariants(self) -> None:
        """Raise AssertionError if the proposer's own accounting is inconsistent."""


PROPOSERS: dict[str, Callable[..., Proposer]] = {}
"""Method name -> factory ``(config, engine) -> Proposer``; filled by
:func:`register_proposer` as the proposer modules are imported (all of them by
:func:`tandem.engine.spec_decode.factory.get_proposer`)."""


def register_proposer(name: str):
    """Class decorator: make a :class:`Proposer` available as ``--speculative-method name``."""
    def deco(cls):
        PROPOSERS[name] = cls
        return cls
    return deco
