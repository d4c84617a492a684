"""Which slice of each weight a tensor-parallel rank holds (plain arithmetic, no torch).

Megatron-LM's split (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", sec. 3): attention is split by
heads, the MLP by its intermediate features, the embedding and the LM head by
vocabulary rows. What this module adds is the rule for head counts that do not
divide by the number of ranks:

- **KV heads split, query heads follow their KV head.** With grouped-query
  attention a query head reads exactly one KV head, so the unit of the split is a
  KV head with its group of query heads: rank ``r`` holds a contiguous run of KV
  heads (the first ``Hkv % W`` ranks one more than the rest) and every query head
  of their groups. SmolLM2-135M (9 query / 3 KV heads) on 2 ranks: rank 0 holds KV
  heads 0-1 with query heads 0-5, rank 1 KV head 2 with query heads 6-8.
- **Fewer KV heads than ranks: KV heads replicated** (as vLLM does): each KV head
  is held by ``W / Hkv`` ranks, which split its query heads evenly; this needs
  ``W % Hkv == 0`` and ``Hq % W == 0``.

The intermediate features split as evenly as the heads (first ranks one more); the
vocabulary is padded to ``W * ceil(V / W)`` rows so that every rank's shard has the
same height (a gather needs equal shapes), the padding at the end of the last
ranks' shards.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``n`` items: ``(start, size)``; the first
    ``n % world_size`` ranks get one more than the others."""
    base, extra = divmod(n, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def split_in_units(n: int, units: tuple[int, ...], world_size: int, rank: int
                   ) -> tuple[int, int]:
    """:func:`split_evenly` of ``n`` features in whole units (a quantized layer's
    groups or blocks): the first of ``units`` that divides ``n`` into at least
    ``world_size`` units.

    Raises:
        ValueError: no such unit (the message names ``tensor_parallel_size``).
    """
    for unit in units:
        if n % unit == 0 and n // unit >= world_size:
            start, size = split_evenly(n // unit, world_size, rank)
            return start * unit, size * unit
    raise ValueError(f"tensor_parallel_size: {n} features cannot be split over {world_size} "
                     f"ranks in whole units of {' or '.join(map(str, units))}")


@dataclass(frozen=True)
class HeadPartition:
    """One rank's attention heads: query heads ``[q_start, q_start + num_heads)``
    and KV heads ``[kv_start, kv_start + num_kv_heads)`` of the model's."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_partition(num_heads: int, num_kv_heads: int, world_size: int, rank: int
                   ) -> HeadPartition:
    """The attention heads rank ``rank`` of ``world_size`` holds (module docstring).

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, or fewer KV
            heads than ranks where ``world_size`` is not a multiple of
            ``num_kv_heads`` or ``num_heads`` not a multiple of ``world_size``
            (the message names ``tensor_parallel_size``).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start, kv = split_evenly(num_kv_heads, world_size, rank)
        return HeadPartition(kv_start * group, kv * group, kv_start, kv)
    if world_size % num_kv_heads or num_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size: {world_size} ranks cannot share {num_kv_heads} KV heads "
            f"and {num_heads} query heads (with fewer KV heads than ranks, the ranks must "
            "be a multiple of the KV heads and divide the query heads)")
    per_rank = num_heads // world_size
    return HeadPartition(rank * per_rank, per_rank, rank // (world_size // num_kv_heads), 1)


def max_local_kv_heads(num_heads: int, num_kv_heads: int, world_size: int) -> int:
    """The most KV heads any rank holds (rank 0's): what sizes every rank's KV cache
    blocks, since all ranks keep the same number of blocks."""
    return head_partition(num_heads, num_kv_heads, world_size, 0).num_kv_heads


@dataclass(frozen=True)
class VocabPartition:
    """One rank's vocabulary rows: ``[start, start + size)`` of the model's
    ``vocab_size``, stored in ``padded_size`` rows (the rest zero)."""

    start: int
    size: int
    padded_size: int


def vocab_partition(vocab_size: int, world_size: int, rank: int) -> VocabPartition:
    """Rank ``rank``'s vocabulary shard: ``ceil(V / W)`` rows from ``rank * ceil(V / W)``
    (the last shards padded), so that the ranks' logits, concatenated in rank
    order, hold the ``V`` real ones first."""
    padded = -(-vocab_size // world_size)
    start = rank * padded
    return VocabPartition(start, max(0, min(padded, vocab_size - start)), padded)
