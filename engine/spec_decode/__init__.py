"""Speculative decoding: proposers draft tokens, the target verifies them.

A :class:`~tandem.engine.spec_decode.proposer.Proposer` drafts up to ``k`` tokens
for each running request after every engine step; the scheduler verifies them in
the request's next decode step (``k + 1`` query positions in one forward pass),
and :meth:`~tandem.engine.sampling.sampler.Sampler.verify` accepts or rejects
them with exact rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al.
2023), so the output distribution is the target's own. Rejected drafts' KV is
overwritten by later steps and never enters the prefix cache.

Proposers are registered by name in :data:`PROPOSERS` (``--speculative-method``);
:func:`tandem.engine.spec_decode.factory.get_proposer` builds the configured one.
This package's own import stays free of torch: the scheduler reads its counters.
"""

from tandem.engine.spec_decode.proposer import PROPOSERS, Proposal, Proposer, register_proposer
from tandem.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["PROPOSERS", "Proposal", "Proposer", "SpecDecodeStats", "register_proposer"]
