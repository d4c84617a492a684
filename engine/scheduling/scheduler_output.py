"""What one scheduler step hands to the model runner: requests, token counts, block operations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.scheduling.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on.

    With speculative tokens the last ``len(spec_token_ids)`` of the new tokens are
    draft tokens that follow the request's last known token::

        | computed | last known token | d0 d1 ... dk-1 |
                   ^ num_computed_tokens                ^ num_computed + num_new_tokens

    The step's logits at all ``k + 1`` positions verify them.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    spec_token_ids: tuple[int, ...] = ()
    spec_draft_probs: Any = None
    """``[len(spec_token_ids), V]`` float32 tensor: the proposer's distributions
    the drafts were drawn from; None for deterministic drafts (see
    :class:`~tandem.engine.spec_decode.proposer.Proposal`)."""

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token: its logits give the next token."""
        return (self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    """What one step runs.

    The model runner executes the block operations in this order before the
    forward pass: ``blocks_to_swap_out``, ``blocks_to_swap_in``, ``block_copies``
    (see :mod:`tandem.engine.kv.kv_cache_manager` for why that order is safe).

    Attributes:
        scheduled: requests and their token counts for this step.
        block_copies: ``(src_block_id, dst_block_id)`` copy-on-write copies.
        blocks_to_swap_out: ``(device_block_id, host_block_id)`` copies of
            requests swapped out in this step.
        blocks_to_swap_in: ``(host_block_id, device_block_id)`` copies of
            requests swapped in in this step.
        preempted: requests preempted (swap or recompute) while scheduling this step.
        kv_loads_to_start: remote-prefill requests whose blocks were reserved in this
            step; the engine starts their KV loads (consumer side of a KV connector).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads_to_start: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no tokens and no block operations."""
        return not (self.scheduled or self.block_copies or self.blocks_to_swap_out
                    or self.blocks_to_swap_in or self.kv_loads_to_start)
