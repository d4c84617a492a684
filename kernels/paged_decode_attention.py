"""Paged decode attention: one query token per sequence over its paged KV cache.

Algorithm: online softmax (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; FlashAttention, Dao et al. 2022, Alg. 1) over tiles of
``BLOCK_N`` context tokens, read through the sequence's block table. One program
handles *all* query heads of one KV head (GQA group of ``G = Hq / Hkv`` heads),
so each K/V tile is loaded once per group and the score tile is a
``[G, BLOCK_N]`` ``tl.dot`` (G padded to 16, the smallest dot extent).

Split-K (Flash-Decoding, Dao, Haziza, Massa & Sizov 2023, "Flash-Decoding for
long-context inference"): with few sequences and long contexts the grid
``B x Hkv`` cannot fill the GPU, so the context is cut into ``num_splits``
contiguous ranges, each program writes an unnormalised partial result
``(m, l, acc)`` (running max in log2 units, softmax denominator, weighted sum of
V), and a second kernel merges them::

    M = max_s m_s,   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s

Tensors (one layer):
    query        [B, Hq, D]            float32 / float16 / bfloat16
    key_cache    [NB, BS, Hkv, D]      same dtype as query, or float8_e4m3fn
    value_cache  [NB, BS, Hkv, D]      key_cache's dtype
    k_scale      [Hkv]                 float32, with an fp8 cache only
    v_scale      [Hkv]
    block_tables [B, max_blocks]       int32, rows padded past a sequence's blocks
    seq_lens     [B]                   int32, >= 1, includes the query token
    out          [B, Hq, D]            query's dtype

Limits: ``D <= 256`` (any value; padded to a power of two >= 16 and masked);
any block size ``BS`` (a compile-time constant of the kernel; powers of two
make the token -> block split a shift); any GQA ratio with ``Hq % Hkv == 0``;
at most ``_MAX_SPLITS`` context splits. Every token's K/V, the query token's
included, must already be in the cache (see :mod:`.reshape_and_cache`).

Int4 KV cache (KIVI): each K/V tile is decoded in registers from the packed rows
(:mod:`tandem.kernels.int4_kv_tiles`: per-channel K in full blocks, per-token
elsewhere, a sequence's open last block's K from the open-block store), rounded to
the query's dtype as :func:`tandem.kernels.int4_kv.dequantize_int4_blocks` does.

FP8 KV cache: each K/V tile is dequantized in registers as it is loaded,
``scale[h] * stored`` in float32 then rounded to the query's dtype (exact: the
scales are powers of two and e4m3 keeps 4 significant bits), which is what
:func:`tandem.kernels.reference.dequantize_fp8_e4m3_ref` computes; the cache is
read at one byte per element and never expanded in memory.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_paged_kv, check_shape,
                                    dot_options, next_pow2)
from tandem.kernels.int4_kv_tiles import load_int4_key_tile, load_int4_value_tile
from tandem.kernels.reference import paged_decode_attention_ref

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "choose_num_splits"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
# Below this many tokens per split the merge costs more than the parallelism gains.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_HEAD_DIM = 256
_WHOLE_CONTEXT = 1 << 30


@triton.jit
def _paged_decode_kernel(
    out_ptr, m_ptr, l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale, tokens_per_split,
    q_stride_b, q_stride_h,
    k_stride_b, k_stride_t, k_stride_h,
    v_stride_b, v_stride_t, v_stride_h,
    bt_stride_b,
    o_stride_b, o_stride_h, o_stride_s,
    ml_stride_b, ml_stride_h,
    s_stride_e, s_stride_t, s_stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, INT4: tl.constexpr, INT4_GROUP: tl.constexpr,
):
    # INT4: k_scale_ptr is the open-block K store [S, BS, Hkv, D] (strides s_stride_*),
    # v_scale_ptr the sequences' store entries [B] int64 (-1: none).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # tokens_per_split is a multiple of BLOCK_N, so tiles never straddle two splits.
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if FP8:
        k_descale = tl.load(k_scale_ptr + kv_head)
        v_descale = tl.load(v_scale_ptr + kv_head)
    if INT4:
        entry = tl.load(v_scale_ptr + seq)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq64 * bt_stride_b
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # int64: block_id * k_stride_b overflows int32 for caches above 2**31 elements.
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask_t = mask_n[None, :] & mask_d[:, None]
        # K tile loaded transposed, [BLOCK_D, BLOCK_N], ready for q @ k.
        if INT4:
            # Decoded in registers, rounded to the model dtype as the reference does.
            k = load_int4_key_tile(
                k_cache_ptr, block_ids, in_block, offs_n, offs_d, mask_n, mask_d, kv_head,
                seq_len, k_stride_b, k_stride_t, k_stride_h, k_scale_ptr, entry,
                s_stride_e, s_stride_t, s_stride_h, HEAD_DIM, BLOCK_SIZE, INT4_GROUP,
            )
            if not UPCAST:      # (UPCAST: bfloat16 under the interpreter, whose rounding
                k = k.to(q_ptr.dtype.element_ty)    # to bfloat16 is wrong; kept float32)
        else:
            k = tl.load(k_cache_ptr + block_ids[None, :] * k_stride_b
                        + in_block[None, :] * k_stride_t + kv_head * k_stride_h
                        + offs_d[:, None], mask=kv_mask_t, other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_descale).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid token, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT4:
            v = load_int4_value_tile(
                v_cache_ptr, block_ids, in_block, mask_n, offs_d, mask_d, kv_head,
                v_stride_b, v_stride_t, v_stride_h, HEAD_DIM, INT4_GROUP,
            )
            if not UPCAST:
                v = v.to(q_ptr.dtype.element_ty)
        else:
            v = tl.load(v_cache_ptr + block_ids[:, None] * v_stride_b
                        + in_block[:, None] * v_stride_t + kv_head * v_stride_h
                        + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if FP8:
            v = (v.to(tl.float32) * v_descale).to(q.dtype)
        elif UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # Unnormalised partials; an empty split leaves (m, l, acc) = (-inf, 0, 0),
        # which the merge weighs by 2^(-inf) = 0.
        o = out_ptr + seq64 * o_stride_b + heads[:, None] * o_stride_h + split * o_stride_s
        tl.store(o + offs_d[None, :], acc, mask=out_mask)
        ml = seq64 * ml_stride_b + heads * ml_stride_h + split
        tl.store(m_ptr + ml, m_i, mask=mask_g)
        tl.store(l_ptr + ml, l_i, mask=mask_g)
    else:
        acc = acc / l_i[:, None]
        o = out_ptr + seq64 * o_stride_b + heads[:, None] * o_stride_h + offs_d[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_ptr, m_ptr, l_ptr, num_splits,
    out_stride_b, out_stride_h,
    part_stride_b, part_stride_h, part_stride_s,
    ml_stride_b, ml_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    ml = seq * ml_stride_b + head * ml_stride_h + offs_s
    m = tl.load(m_ptr + ml, mask=mask_s, other=float("-inf"))
    l = tl.load(l_ptr + ml, mask=mask_s, other=0.0)
    part = tl.load(part_ptr + seq * part_stride_b + head * part_stride_h
                   + offs_s[:, None] * part_stride_s + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    # Split 0 always holds token 0, so the global max is finite for seq_len >= 1.
    w = tl.exp2(m - tl.max(m, 0))
    acc = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + offs_d,
             acc.to(out_ptr.dtype.element_ty), mask=mask_d)


def _tile_config(block_d: int, elem_size: int, device: torch.device) -> dict[str, int]:
    """Context tokens per tile and launch options.

    A K plus a V tile of ``BLOCK_N x BLOCK_D`` per pipeline stage; 32 KiB per
    stage (64 tokens of 128 half-precision dims) leaves room for three stages in
    shared memory, wider rows get shorter tiles, float32 one stage less.
    """
    if device.type != "cuda":
        return dict(block_n=64, num_warps=4, num_stages=1)
    block_n = 64 if block_d * elem_size <= 256 else 32
    return dict(block_n=block_n, num_warps=4, num_stages=3 if elem_size < 4 else 2)


def _target_programs(device: torch.device) -> int:
    """Programs needed to keep the device busy: two waves of one program per SM."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 128


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """How many context splits decode attention should use (1 = no split-K).

    Splits only when ``num_seqs * num_kv_heads`` programs leave the device
    underused, and never below ``_MIN_TOKENS_PER_SPLIT`` tokens per split.
    """
    programs = num_seqs * num_kv_heads
    target = _target_programs(device)
    if programs >= target:
        return 1
    by_occupancy = math.ceil(target / programs)
    by_length = max_seq_len // _MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, *,
                           num_splits: int | None = None, block_n: int | None = None,
                           out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache (Triton).

    Same contract as :func:`tandem.kernels.reference.paged_decode_attention_ref`.

    Args:
        query: ``[B, Hq, D]``; any outer strides, innermost stride 1.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, query's dtype or
            ``torch.float8_e4m3fn``; or int4 rows ``uint8 [NB, BS, Hkv, R]``
            (:mod:`tandem.kernels.int4_kv`).
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32 context lengths (tokens, each >= 1).
        scale: softmax scale.
        max_seq_len: an upper bound of ``seq_lens`` (tokens); read from the device
            (a sync) if None. Sizes the splits: a value below the true maximum
            would drop the tail of the context under split-K.
        num_splits: context splits (1 = single pass); None lets
            :func:`choose_num_splits` pick from the batch shape.
        block_n: context tokens per tile (power of two >= 16); None picks from
            the head dim and dtype.
        out: optional ``[B, Hq, D]`` output (may be a view of a larger tensor).
        k_scale, v_scale: ``[Hkv]`` float32 scales of an fp8 cache; for an int4
            cache the open-block K store ``[S, BS, Hkv, D]`` and the sequences'
            entries ``[B]`` int64 (-1: the last block is full), or None (no store);
            None otherwise.

    Returns:
        ``[B, Hq, D]`` in the query's dtype, accumulated in float32.

    Raises:
        ValueError: bad shapes, dtypes, devices, strides or options; an fp8 cache
            without scales, or scales for a cache in the model dtype; an int4
            cache with rows of the wrong width or a store of the wrong shape.
    """
    b, hq, d = query.shape
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected [NB, BS, Hkv, D], got {tuple(key_cache.shape)}")
    _, bs, hkv, _ = key_cache.shape
    check_device(query, key_cache, value_cache, block_tables, seq_lens)
    check_dtype("query", query, FLOAT_DTYPES)
    kv = check_paged_kv(key_cache, value_cache, query, b, k_scale, v_scale)
    check_last_dim_contiguous("query", query)
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_shape("seq_lens", seq_lens, (b,))
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected [{b}, max_blocks] with unit column stride, "
                         f"got shape {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} not in [1, {_MAX_HEAD_DIM}]")
    block_d = max(16, next_pow2(d))
    cfg = _tile_config(block_d, query.element_size(), query.device)
    block_n = cfg["block_n"] if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty((b, hq, d), dtype=query.dtype, device=query.device)
    else:
        check_shape("out", out, (b, hq, d))
        check_dtype("out", out, (query.dtype,))
        check_last_dim_contiguous("out", out)
    if b == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, max_seq_len, query.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")

    group = hq // hkv
    context = max(max_seq_len, 1)
    tokens_per_split = triton.cdiv(triton.cdiv(context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(context, tokens_per_split)
    precision, upcast = dot_options(query.dtype, query.device)
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_G=max(16, next_pow2(group)),
                  BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=precision, UPCAST=upcast,
                  FP8=kv.fp8, INT4=kv.int4, INT4_GROUP=kv.int4_group,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    k_strides = key_cache.stride()[:3]
    v_strides = value_cache.stride()[:3]
    grid = (b, hkv, num_splits)
    if num_splits == 1:
        _paged_decode_kernel[grid](
            out, out, out, query, key_cache, value_cache, block_tables, seq_lens, *kv.scales,
            # One range covering any seq_len, so an understated max_seq_len loses nothing.
            scale * _LOG2E, _WHOLE_CONTEXT,
            query.stride(0), query.stride(1), *k_strides, *v_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0, *kv.store_strides,
            SPLIT=False, **common)
        return out

    part = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=query.device)
    m = torch.empty((b, hq, num_splits), dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    _paged_decode_kernel[grid](
        part, m, l, query, key_cache, value_cache, block_tables, seq_lens, *kv.scales,
        scale * _LOG2E, tokens_per_split,
        query.stride(0), query.stride(1), *k_strides, *v_strides, block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1), *kv.store_strides,
        SPLIT=True, **common)
    _merge_splits_kernel[(b, hq)](
        out, part, m, l, num_splits,
        out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        m.stride(0), m.stride(1),
        HEAD_DIM=d, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(d))
    return out
