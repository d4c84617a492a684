"""Preemption policies: how a request preempted for lack of KV blocks gives them up.

Kwon et al. 2023 ("Efficient Memory Management for Large Language Model Serving
with PagedAttention", section 4.5) name two ways:

* **swap**: copy the request's blocks to a host-memory pool and free the device
  blocks; on resume copy them back. Costs bytes over the device-host link, twice.
* **recompute**: free the blocks; on resume prefill prompt and generated tokens
  again in one pass. Costs prefill compute for every token whose KV is lost.

Which is cheaper depends on the hardware and the request (their figure 19:
swapping small blocks is slow, recompute cost does not depend on block size),
so ``auto`` decides per request with a cost model. Both keep the output
unchanged: a swapped request resumes with bit-identical KV; a recomputed one
rebuilds its KV from the same tokens.

The scheduler picks *which* request to preempt (the least important, latest
arrived); a policy picks only *how*. Policies are registered by the
``SchedulerConfig.preemption_mode`` string.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Callable

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.scheduling.request import Request


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


class PreemptionPolicy(ABC):
    """Chooses the preemption mode of one request. Reads state, mutates nothing."""

    name: str = ""

    @abstractmethod
    def choose(self, request: Request, kv: KVCacheManager) -> PreemptionMode:
        """The mode to preempt the device-resident ``request`` with, now.

        Returns :attr:`PreemptionMode.SWAP` only when ``kv.can_swap_out`` holds
        for it, so a full host pool always falls back to recompute.
        """


class RecomputePolicy(PreemptionPolicy):
    """Always recompute (no host memory used)."""

    name = "recompute"

    def choose(self, request: Request, kv: KVCacheManager) -> PreemptionMode:
        return PreemptionMode.RECOMPUTE


class SwapPolicy(PreemptionPolicy):
    """Swap whenever the host pool has room for the request's blocks."""

    name = "swap"

    def choose(self, request: Request, kv: KVCacheManager) -> PreemptionMode:
        if kv.can_swap_out(request.request_id):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


class CostModelPolicy(PreemptionPolicy):
    """Swap when the host pool has room and moving the bytes is estimated faster
    than recomputing the tokens.

    For a request with ``B`` blocks, ``C`` computed tokens, of which the first
    ``S`` blocks are cached and shared with another request (they stay on the
    device whatever happens to this one):

    * recompute: ``(C - S * block_size) / recompute_tokens_per_s`` seconds; the
      shared blocks are prefix-cache hits when it is prefilled again;
    * swap: ``(B + B - S) * bytes_per_block / swap_bytes_per_s`` seconds; all
      ``B`` blocks go out, the shared ones are found by hash on the way back in.

    Ties go to recompute (it holds no host memory).

    Args:
        bytes_per_block: one block's K and V across all layers (bytes).
        recompute_tokens_per_s: prefill speed (tokens/s, > 0).
        swap_bytes_per_s: device<->host copy speed (bytes/s, > 0).

    Raises:
        ValueError: a speed <= 0 or ``bytes_per_block`` < 0.
    """

    name = "auto"

    def __init__(self, bytes_per_block: int, recompute_tokens_per_s: float,
                 swap_bytes_per_s: float):
        if bytes_per_block < 0 or not recompute_tokens_per_s > 0 or not swap_bytes_per_s > 0:
            raise ValueError("bytes_per_block must be >= 0 and both speeds > 0")
        self.bytes_per_block = bytes_per_block
        self.recompute_tokens_per_s = recompute_tokens_per_s
        self.swap_bytes_per_s = swap_bytes_per_s

    def recompute_cost_s(self, request: Request, kv: KVCacheManager) -> float:
        """Estimated seconds to prefill again what a recompute loses."""
        shared = kv.num_shared_cached_prefix_blocks(request.request_id)
        tokens = max(0, request.num_computed_tokens - shared * kv.block_size)
        return tokens / self.recompute_tokens_per_s

    def swap_cost_s(self, request: Request, kv: KVCacheManager) -> float:
        """Estimated seconds to copy the request's blocks out and back in."""
        num_blocks = kv.num_held_blocks(request.request_id)   # null slots do not move
        shared = kv.num_shared_cached_prefix_blocks(request.request_id)
        return (2 * num_blocks - shared) * self.bytes_per_block / self.swap_bytes_per_s

    def choose(self, request: Request, kv: KVCacheManager) -> PreemptionMode:
        if (kv.can_swap_out(request.request_id)
                and self.swap_cost_s(request, kv) < self.recompute_cost_s(request, kv)):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


PREEMPTION_POLICIES: dict[str, Callable[[SchedulerConfig, int], PreemptionPolicy]] = {
    "recompute": lambda config, bytes_per_block: RecomputePolicy(),
    "swap": lambda config, bytes_per_block: SwapPolicy(),
    "auto": lambda config, bytes_per_block: CostModelPolicy(
        bytes_per_block, config.recompute_tokens_per_s, config.swap_bytes_per_s),
}


def get_preemption_policy(config: SchedulerConfig, bytes_per_block: int) -> PreemptionPolicy:
    """The policy named by ``config.preemption_mode``.

    Args:
        config: scheduler configuration.
        bytes_per_block: one KV block's size across all layers (bytes), for the cost model.

    Raises:
        ValueError: unknown mode.
    """
    try:
        factory = PREEMPTION_POLICIES[config.preemption_mode]
    except KeyError:
        raise ValueError(f"preemption_mode: unknown {config.preemption_mode!r}, "
                         f"expected one of {', '.join(PREEMPTION_POLICIES)}") from None
    return factory(config, bytes_per_block)
