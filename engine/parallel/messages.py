"""What rank 0 of a tensor-parallel engine broadcasts to the other ranks.

Rank 0 runs the scheduler, the model runner and the sampler; the other ranks only
follow the model's collectives (:mod:`tandem.engine.parallel.worker`). Each message
below is one :meth:`~tandem.engine.parallel.communicator.Communicator.broadcast_object`,
in the order rank 0 sends them; a worker answers none of them (its replies are its
part of the next collective). Once, before :class:`WorkerSetup`, with an fp8 KV
cache: :class:`CalibrateKVScales`. Per step::

    [BlockOps]        only in a step that swaps or copies blocks (or, int4 KV cache,
                      after blocks changed owner)
    StepInput         the forward pass's input (every step that runs the model)
    LogitsRequest*    one per compute_logits call (sampling rows, prompt logprobs slices)

A decode step of ``B`` sequences sends a ``StepInput`` of a few hundred bytes plus
``B`` block-table rows, and one ``LogitsRequest`` of ``B x H`` activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.attention_backend import AttentionMetadata


@dataclass(frozen=True)
class WorkerSetup:
    """Once, after every rank loaded its shard: the paged KV cache every rank
    allocates (the same block ids on every rank, so one block table serves all).

    Attributes:
        num_blocks: device blocks of the cache.
        num_host_blocks: host blocks for swapped-out requests.
    """

    num_blocks: int
    num_host_blocks: int


@dataclass(frozen=True)
class CalibrateKVScales:
    """fp8 KV cache: every rank runs the calibration prompt ``token_ids`` through its
    shard (the forward's all-reduces are collectives) and takes the scales of its own
    KV heads (:func:`~tandem.engine.runtime.kv_scales.calibrate_kv_scales`, scratch
    cache of ``block_size``-token blocks)."""

    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockOps:
    """A step's block operations, applied to each rank's cache in this order (as
    :meth:`~tandem.engine.runtime.model_runner.ModelRunner.execute` does): first
    ``block_events``, then swap-out ``(device, host)`` pairs, swap-in ``(host,
    device)`` pairs, copy-on-write ``(src, dst)`` pairs.

    ``block_events`` (int4 KV cache only, else empty): the block pool's
    ``("allocated" | "released", block ids)`` calls on rank 0's cache since the last
    step, in order (:attr:`~tandem.engine.runtime.model_runner.KVCache.block_events`).
    Replayed on each rank's cache, they keep its open-block K store's entries the
    same as rank 0's, so that the step's write plan (which rank 0 computes and every
    rank recomputes) names the same entries everywhere."""

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    block_events: list[tuple[str, list[int]]] = ()


@dataclass(frozen=True)
class StepInput:
    """One forward pass: ``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 and the
    step's :class:`AttentionMetadata` (slot mapping, block tables, sequence lengths).

    ``kv_saves`` (a prefill worker's step that completes prompts bound for decode
    workers): ``(request id, peer id, ticket dict, source block ids)`` per request;
    each rank sends its own KV heads of them from inside this forward pass, then
    reports its failures to rank 0 (:mod:`tandem.kvtransfer.sharded`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    kv_saves: tuple = ()


@dataclass(frozen=True)
class LogitsRequest:
    """Rank 0 computes logits of ``hidden`` ``[N, H]`` (rows of the last forward's final
    hidden states, which every rank holds): the LM head's shards run on every rank
    and rank 0 gathers them."""

    hidden: torch.Tensor


@dataclass(frozen=True)
class Shutdown:
    """The engine is closing: workers leave their loop and exit."""
