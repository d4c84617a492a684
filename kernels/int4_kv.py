"""Int4 KV cache (``kv_cache_dtype int4``) on paged blocks, after KIVI (Liu et al.
2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", sec. 3):
K quantized per channel over groups of tokens (its outliers sit in fixed
channels), V per token; torch reference of the codec, the cache write and the
read.

Layout: each layer's K and V caches are ``uint8 [NB, BS, Hkv, R]``, one row of
``R =`` :func:`int4_kv_row_bytes` ``(D, BS)`` bytes per (token, KV head): ``D / 2``
bytes of 4-bit codes (element ``2i`` in the low nibble of byte ``i``), then a
parameter area of ``P = max(4 D / G, 4 D / BS)`` bytes, ``G = gcd(D, 32)``
(``R = 48`` for ``D = 64``, ``BS = 16``). A row holds one of two formats:

* **per token** (every V row, and the K rows of a block that is not full yet):
  the row's ``D / G`` groups of ``G`` channels each have an fp16 ``(step, lo)``
  pair, stored in the first ``4 D / G`` bytes of the parameter area; element
  ``= q * step + lo``.
* **per channel** (the K rows of a full block, KIVI's K): the block's ``BS``
  tokens share one fp16 ``(step, lo)`` pair per channel; the block's ``D`` pairs
  (``4 D`` bytes) are spread over its rows, row ``j`` holding those of channels
  ``[j D / BS, (j + 1) D / BS)`` in the first ``4 D / BS`` bytes of its area.

Both use ``lo = fp16(min)``, ``step = fp16((max - lo) / 15)``,
``q = clamp(round((x - lo) / step), 0, 15)`` (round half to even; ``q = 0`` where
``step`` is 0) over their group. A block is full once its last slot is written;
for a sequence of ``n`` tokens block ``i`` is full iff ``(i + 1) * BS <= n``, so a
reader knows each block's K format from the sequence length alone.

A block's per-channel K is quantized from the exact K of all its tokens: while a
block is open, its tokens' K are also kept in the model dtype in an *open-block
K store* beside the cache (:class:`tandem.engine.runtime.model_runner.KVCache`),
KIVI's full-precision residual, one entry per open block; the step that writes
its last slot quantizes it from there (or straight from the step's K when the
step wrote the whole block) and frees the entry. A block whose entry is gone
(it arrived by KV transfer while open) is refilled from its per-token rows.
Attention reads a sequence's open last block's K from the store, exactly (the
residual of KIVI sec. 3.3, here the tokens since the last full block), and
every other K from the cache; V always from the cache.

Reading functions take, for an int4 cache, ``k_scale`` = the layer's store
``[S, BS, Hkv, D]`` and ``v_scale`` = ``[B]`` int64, each sequence's store entry
(-1: its last block is full): see :func:`overlay_open_keys`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT4_KV_MAX_GROUP = 32
"""Largest group of channels sharing one per-token step and minimum (KIVI's G)."""


def int4_kv_group_size(head_dim: int) -> int:
    """Channels per per-token group: ``gcd(head_dim, 32)``.

    Raises:
        ValueError: ``head_dim`` not a positive multiple of 8.
    """
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"head_dim: an int4 KV cache needs a multiple of 8, got {head_dim}")
    return math.gcd(head_dim, INT4_KV_MAX_GROUP)


def int4_kv_row_bytes(head_dim: int, block_size: int) -> int:
    """Bytes of one int4 KV row: ``D / 2 + max(4 D / G, 4 D / BS)`` (48 for ``D = 64``,
    ``BS = 16``; see the module docstring).

    Raises:
        ValueError: ``head_dim`` not a multiple of 8, or ``4 * head_dim`` not a
            multiple of ``block_size`` (the per-channel pairs must split evenly
            over a block's rows).
    """
    g = int4_kv_group_size(head_dim)
    if block_size <= 0 or (4 * head_dim) % block_size:
        raise ValueError(f"block_size: an int4 KV cache needs 4 * head_dim ({4 * head_dim}) "
                         f"to be a multiple of it, got {block_size}")
    return head_dim // 2 + max(4 * head_dim // g, 4 * head_dim // block_size)


def _quantize(y: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``y`` -> (codes uint8, step fp16, lo fp16) over ``dim`` (kept, size 1)."""
    lo = y.amin(dim=dim, keepdim=True).to(torch.float16)
    step = ((y.amax(dim=dim, keepdim=True) - lo.float()) / 15).to(torch.float16)
    step_f = step.float()
    inv = torch.where(step_f > 0, 1.0 / step_f, torch.zeros_like(step_f))
    q = torch.round((y - lo.float()) * inv).clamp_(0, 15).to(torch.uint8)
    return q, step, lo


def _pack(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()


def check_token_rows(row_bytes: int, head_dim: int) -> None:
    """Raises ValueError if rows of ``row_bytes`` cannot hold ``head_dim`` channels in
    the per-token format (the smallest row of any block size)."""
    need = head_dim // 2 + 4 * head_dim // int4_kv_group_size(head_dim)
    if row_bytes < need:
        raise ValueError(f"int4 rows of {row_bytes} bytes cannot hold {head_dim} channels "
                         f"(at least {need})")


def quantize_int4_tokens(x: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Per-token format: ``x`` ``[..., Hkv, D]`` (any float dtype) -> ``uint8 [..., Hkv, R]``.

    Raises:
        ValueError: ``D`` not a multiple of 8, or rows too small.
    """
    d = x.shape[-1]
    g = int4_kv_group_size(d)
    check_token_rows(row_bytes, d)
    q, step, lo = _quantize(x.float().unflatten(-1, (d // g, g)), -1)
    out = torch.zeros(*x.shape[:-1], row_bytes, dtype=torch.uint8, device=x.device)
    out[..., :d // 2] = _pack(q.flatten(-2))
    params = torch.cat([step, lo], dim=-1).flatten(-2)              # [..., Hkv, 2 D/G] fp16
    out[..., d // 2:d // 2 + 4 * (d // g)] = params.view(torch.uint8)
    return out


def dequantize_int4_tokens(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-token rows ``uint8 [..., Hkv, R]`` -> ``[..., Hkv, D]`` in ``dtype`` (float32 math)."""
    d = head_dim
    g = int4_kv_group_size(d)
    check_token_rows(rows.shape[-1], d)
    q = _unpack(rows[..., :d // 2]).unflatten(-1, (d // g, g))
    params = rows[..., d // 2:d // 2 + 4 * (d // g)].contiguous().view(torch.float16).float()
    params = params.unflatten(-1, (d // g, 2))
    return (q * params[..., :1] + params[..., 1:]).flatten(-2).to(dtype)


def quantize_int4_key_blocks(x: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Per-channel format: full blocks of K ``[n, BS, Hkv, D]`` -> ``uint8 [n, BS, Hkv, R]``.

    Raises:
        ValueError: ``4 D`` not a multiple of ``BS``, or rows too small.
    """
    n, bs, hkv, d = x.shape
    per_row = 4 * d // bs
    if row_bytes < int4_kv_row_bytes(d, bs):        # (which checks d and bs)
        raise ValueError(f"int4 K blocks of {bs} tokens x {d} channels do not fit rows of "
                         f"{row_bytes} bytes")
    q, step, lo = _quantize(x.float(), 1)                            # step, lo [n, 1, Hkv, D]
    out = torch.zeros(n, bs, hkv, row_bytes, dtype=torch.uint8, device=x.device)
    out[..., :d // 2] = _pack(q)
    pairs = torch.stack([step[:, 0], lo[:, 0]], dim=-1)              # [n, Hkv, D, 2] fp16
    spread = pairs.reshape(n, hkv, 2 * d).view(torch.uint8).view(n, hkv, bs, per_row)
    out[..., d // 2:d // 2 + per_row] = spread.transpose(1, 2)
    return out


def dequantize_int4_key_blocks(rows: torch.Tensor, head_dim: int,
                               dtype: torch.dtype) -> torch.Tensor:
    """Per-channel K blocks ``uint8 [n, BS, Hkv, R]`` -> ``[n, BS, Hkv, D]`` in ``dtype``."""
    n, bs, hkv, _ = rows.shape
    d = head_dim
    per_row = 4 * d // bs
    spread = rows[..., d // 2:d // 2 + per_row].transpose(1, 2).contiguous()   # [n, Hkv, BS, pr]
    pairs = spread.view(n, hkv, 4 * d).view(torch.float16).float().view(n, 1, hkv, d, 2)
    return (_unpack(rows[..., :d // 2]) * pairs[..., 0] + pairs[..., 1]).to(dtype)


def dequantize_int4_blocks(blocks: torch.Tensor, head_dim: int, full: torch.Tensor,
                           is_key: bool, dtype: torch.dtype) -> torch.Tensor:
    """Gathered blocks ``uint8 [..., BS, Hkv, R]`` -> ``[..., BS, Hkv, D]`` in ``dtype``.

    Args:
        full: bool, ``blocks.shape[:-3]``: which blocks are full (their K rows are
            in the per-channel format); ignored for V.
        is_key: K (per-channel rows in full blocks) or V (per-token rows only).
    """
    lead = blocks.shape[:-3]
    flat = blocks.reshape(-1, *blocks.shape[-3:])
    out = dequantize_int4_tokens(flat, head_dim, dtype)
    if is_key:
        mask = full.reshape(-1).to(blocks.device)
        if bool(mask.any()):
            out[mask] = dequantize_int4_key_blocks(flat[mask], head_dim, dtype)
    return out.view(*lead, *out.shape[1:])


def overlay_open_keys(k: torch.Tensor, seq_lens: torch.Tensor, store: torch.Tensor | None,
                      entries: torch.Tensor | None) -> torch.Tensor:
    """Put each sequence's exact open-block K from the store over its dequantized
    last block, in place.

    Args:
        k: ``[B, nblk, BS, Hkv, D]`` dequantized K of ``B`` sequences.
        seq_lens: ``[B]`` context lengths.
        store: ``[S, BS, Hkv, D]`` the layer's open-block K store (None: no-op).
        entries: ``[B]`` int64 store entries, -1 where the last block is full.

    Returns:
        ``k``.
    """
    if store is None or entries is None:
        return k
    entries = entries.to(k.device)
    rows = (entries >= 0).nonzero().flatten()
    if rows.numel():
        last = (seq_lens.to(k.device).long()[rows] - 1) // k.shape[2]
        k[rows, last] = store.index_select(0, entries[rows]).to(k.dtype)
    return k


def full_blocks(seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[B, num_blocks]`` bool: block ``i`` of sequence ``b`` is full
    (``(i + 1) * BS <= seq_lens[b]``)."""
    ends = (torch.arange(num_blocks, device=seq_lens.device) + 1) * block_size
    return ends[None, :] <= seq_lens.long()[:, None]


@dataclass(frozen=True)
class Int4WritePlan:
    """What one step's cache write does beside the per-token rows, the same for every
    layer (built by ``KVCache.plan_int4_write`` from the step's slot mapping).

    Attributes:
        store_tokens: ``[Ts]`` int64, the step's tokens (indices into its packed
            batch) that land in an open block: their exact K goes to the store.
        store_slots: ``[Ts]`` int64, their places in the store (``entry * BS + offset``).
        fill_blocks: ``[F]`` int64, cache blocks this step fills whose earlier
            tokens are in the store; quantized per channel from ``fill_entries``.
        fill_entries: ``[F]`` int64, their store entries.
        whole_blocks: ``[W]`` int64, cache blocks the step writes from offset 0
            to the end; quantized per channel straight from the step's K.
        whole_starts: ``[W]`` int64, index of each one's first token in the batch.
        seq_open_entries: ``[B]`` int64, per sequence of the batch (packed order)
            the store entry of its open last block, -1 if its last block is full.
    """

    store_tokens: torch.Tensor
    store_slots: torch.Tensor
    fill_blocks: torch.Tensor
    fill_entries: torch.Tensor
    whole_blocks: torch.Tensor
    whole_starts: torch.Tensor
    seq_open_entries: torch.Tensor


def reshape_and_cache_int4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           open_keys: torch.Tensor, plan: Int4WritePlan,
                           write_token_rows=None) -> None:
    """Write one layer's new K/V ``[T, Hkv, D]`` into an int4 cache ``uint8 [NB, BS, Hkv, R]``.

    Every token's K and V row is written in the per-token format at its slot; the
    K of tokens in open blocks is copied into ``open_keys`` (this layer's store,
    ``[S, BS, Hkv, D]`` in the model dtype); then each block the step filled is
    rewritten in the per-channel format, from the store or from the step's K.

    Args:
        write_token_rows: ``(key, value, key_cache, value_cache, slot_mapping)``
            writing the per-token rows with the bytes of :func:`quantize_int4_tokens`
            (e.g. the compiled :func:`tandem.kernels.cpu.ops.reshape_and_cache_int4_rows`);
            None: the torch code here.
    """
    nb, bs, hkv, row = key_cache.shape
    d = key.shape[-1]
    if write_token_rows is not None:
        write_token_rows(key, value, key_cache, value_cache, slot_mapping)
    else:
        key_cache.view(nb * bs, hkv, row).index_copy_(0, slot_mapping,
                                                      quantize_int4_tokens(key, row))
        value_cache.view(nb * bs, hkv, row).index_copy_(0, slot_mapping,
                                                        quantize_int4_tokens(value, row))
    if plan.store_tokens.numel():
        open_keys.view(-1, hkv, d).index_copy_(0, plan.store_slots,
                                               key.index_select(0, plan.store_tokens)
                                               .to(open_keys.dtype))
    if plan.fill_blocks.numel():
        key_cache[plan.fill_blocks] = quantize_int4_key_blocks(
            open_keys.index_select(0, plan.fill_entries), row)
    if plan.whole_blocks.numel():
        idx = plan.whole_starts[:, None] + torch.arange(bs, device=key.device)[None, :]
        key_cache[plan.whole_blocks] = quantize_int4_key_blocks(key[idx].to(open_keys.dtype),
                                                                row)
