"""Causal prefill attention of packed variable-length query chunks over paged KV.

Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", Alg. 1 and Sec. 3.2): each program
owns one tile of query rows, streams K/V tiles through on-chip memory with an
online softmax, and rescales the output once at the end. As in the paper's
causal variant, key tiles entirely below the diagonal run without masks and
only the tiles that cross it are masked; tiles above it are skipped.

Sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]``
(``q_len`` tokens). They are the *last* ``q_len`` of its ``seq_lens[i]`` context
tokens; the first ``prefix = seq_len - q_len`` are already in the cache (prefix
caching, earlier chunks of a chunked prefill). Query token ``j`` sits at
position ``prefix + j`` and sees keys ``0 .. prefix + j``::

    keys  0 .......... prefix ........ seq_len-1
    q 0   x x x x x x x x
    q 1   x x x x x x x x x
    q 2   x x x x x x x x x x

GQA: a tile packs ``BLOCK_Q`` query tokens times the ``G = Hq / Hkv`` query
heads of one KV head into its ``BLOCK_M = BLOCK_Q * G`` rows (row ``r`` is token
``r // G``, head ``r % G``), so every K/V tile is read once per group.

Tensors (one layer):
    query           [T, Hq, D]         float32 / float16 / bfloat16
    key_cache       [NB, BS, Hkv, D]   same dtype or float8_e4m3fn; holds every
    value_cache     [NB, BS, Hkv, D]   token's K/V, this chunk's included
    k_scale         [Hkv]              float32, with an fp8 cache only
    v_scale         [Hkv]
    block_tables    [B, max_blocks]    int32
    query_start_loc [B + 1]            int32, cumulative query lengths (tokens)
    seq_lens        [B]                int32, context length after this step
    out             [T, Hq, D]         query's dtype

Limits: ``D <= 256`` (padded to a power of two >= 16 and masked); any cache
block size (compile-time constant); ``G <= 128``; ``q_len <= seq_len`` for
every sequence.

Int4 KV cache (KIVI): K/V tiles are decoded in registers from the packed rows
(:mod:`tandem.kernels.int4_kv_tiles`; a sequence's open last block's K from the
open-block store), rounded to the query's dtype as
:func:`tandem.kernels.int4_kv.dequantize_int4_blocks` does; the chunk's own tokens
are read back like the prefix.

FP8 KV cache: K/V tiles are dequantized in registers as they are loaded
(``scale[h] * stored`` in float32, rounded to the query's dtype, as
:func:`tandem.kernels.reference.dequantize_fp8_e4m3_ref`); the chunk's own
tokens are read back from the cache like the prefix, so they too are seen
quantized, as in the reference and in decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_paged_kv, check_shape,
                                    dot_options, next_pow2)
from tandem.kernels.int4_kv_tiles import load_int4_key_tile, load_int4_value_tile
from tandem.kernels.reference import paged_prefill_attention_ref

__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_MAX_GROUP = 128


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, seq_len, table, kv_head,
                 k_cache_ptr, v_cache_ptr,
                 k_stride_b, k_stride_t, k_stride_h,
                 v_stride_b, v_stride_t, v_stride_h,
                 qk_scale, offs_d, mask_d, k_descale, v_descale,
                 q_ptr, store_ptr, entry, s_stride_e, s_stride_t, s_stride_h,
                 HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
                 INT4: tl.constexpr, INT4_GROUP: tl.constexpr):
    # One online-softmax step of the [BLOCK_M] query rows over keys
    # start_n .. start_n + BLOCK_N. Unmasked tiles lie wholly inside the context
    # and wholly at or below the diagonal of every row.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < seq_len
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_ptrs = (k_cache_ptr + block_ids[None, :] * k_stride_b + in_block[None, :] * k_stride_t
              + kv_head * k_stride_h + offs_d[:, None])
    v_ptrs = (v_cache_ptr + block_ids[:, None] * v_stride_b + in_block[:, None] * v_stride_t
              + kv_head * v_stride_h + offs_d[None, :])
    if INT4:
        # Decoded in registers (see int4_kv_tiles), rounded to the model dtype.
        in_seq = offs_n < seq_len
        k = load_int4_key_tile(
            k_cache_ptr, block_ids, in_block, offs_n, offs_d, in_seq, mask_d, kv_head,
            seq_len, k_stride_b, k_stride_t, k_stride_h, store_ptr, entry,
            s_stride_e, s_stride_t, s_stride_h, HEAD_DIM, BLOCK_SIZE, INT4_GROUP,
        )
        if not UPCAST:      # (UPCAST: bfloat16 under the interpreter, whose rounding
            k = k.to(q_ptr.dtype.element_ty)    # to bfloat16 is wrong; kept float32)
    elif MASKED:
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_descale).to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
    # A row can see no key of a masked tile; m_i starts finite (-1e30), so such a
    # row gets p = 2^(-inf) = 0 here instead of NaN from (-inf) - (-inf).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if INT4:
        v = load_int4_value_tile(
            v_cache_ptr, block_ids, in_block, in_seq, offs_d, mask_d, kv_head,
            v_stride_b, v_stride_t, v_stride_h, HEAD_DIM, INT4_GROUP,
        )
        if not UPCAST:
            v = v.to(q_ptr.dtype.element_ty)
    elif MASKED:
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    if FP8:
        v = (v.to(tl.float32) * v_descale).to(q.dtype)
    elif UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, k_scale_ptr, v_scale_ptr, qk_scale,
    q_stride_t, q_stride_h,
    k_stride_b, k_stride_t, k_stride_h,
    v_stride_b, v_stride_t, v_stride_h,
    bt_stride_b,
    o_stride_t, o_stride_h,
    s_stride_e, s_stride_t, s_stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, INT4: tl.constexpr, INT4_GROUP: tl.constexpr,
):
    # INT4: k_scale_ptr is the open-block K store [S, BS, Hkv, D] (strides s_stride_*),
    # v_scale_ptr the sequences' store entries [B] int64 (-1: none).
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = q_block * BLOCK_Q
    # The grid is sized for the longest chunk; shorter chunks have nothing here.
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tok = first_tok + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok
    if FP8:
        k_descale = tl.load(k_scale_ptr + kv_head)
        v_descale = tl.load(v_scale_ptr + kv_head)
    else:
        k_descale = 1.0
        v_descale = 1.0
    if INT4:
        entry = tl.load(v_scale_ptr + seq)
    else:
        entry = -1

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride_b

    # Keys below prefix + first_tok are visible to every row of this tile.
    full_end = ((prefix + first_tok) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, start_n, seq_len, table, kv_head,
            k_cache_ptr, v_cache_ptr, k_stride_b, k_stride_t, k_stride_h,
            v_stride_b, v_stride_t, v_stride_h, qk_scale, offs_d, mask_d, k_descale, v_descale,
            q_ptr, k_scale_ptr, entry, s_stride_e, s_stride_t, s_stride_h, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, UPCAST, FP8, INT4, INT4_GROUP)
    # Diagonal tiles, up to the last row's position (clipped at seq_len by the mask).
    causal_end = tl.minimum(seq_len, prefix + first_tok + BLOCK_Q)
    for start_n in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, start_n, seq_len, table, kv_head,
            k_cache_ptr, v_cache_ptr, k_stride_b, k_stride_t, k_stride_h,
            v_stride_b, v_stride_t, v_stride_h, qk_scale, offs_d, mask_d, k_descale, v_descale,
            q_ptr, k_scale_ptr, entry, s_stride_e, s_stride_t, s_stride_h, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, UPCAST, FP8, INT4, INT4_GROUP)

    acc = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * o_stride_t + heads[:, None] * o_stride_h + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _tile_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Tile sizes and launch options: ``BLOCK_M`` rows (query tokens x group heads).

    Sized so that Q plus ``num_stages`` K/V tiles stay within ~160 KiB of shared
    memory (Hopper allows 227 KiB per block): float32 and ``D > 128`` tiles are
    smaller and less deeply pipelined.
    """
    if device.type != "cuda":
        # Interpreter: bigger tiles mean fewer Python-level steps; stages/warps are ignored.
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(block_m=64 if head_dim <= 128 else 32, block_n=32, num_warps=4,
                    num_stages=2)
    if head_dim <= 128:
        return dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, *,
                            block_m: int | None = None, block_n: int | None = None,
                            out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed query chunks over a paged KV cache (Triton).

    Same contract as :func:`tandem.kernels.reference.paged_prefill_attention_ref`,
    with the per-sequence lengths on the device.

    Args:
        query: ``[T, Hq, D]``; any outer strides, innermost stride 1.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, query's dtype or
            ``torch.float8_e4m3fn``; or int4 rows ``uint8 [NB, BS, Hkv, R]``
            (:mod:`tandem.kernels.int4_kv`).
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths (tokens),
            ``query_start_loc[B] == T``.
        seq_lens: ``[B]`` int32 context lengths (tokens), each ``>= q_len``.
        max_query_len: ``max(q_len)`` (tokens); sizes the grid, so it must not be
            below the true maximum.
        scale: softmax scale.
        block_m: query rows per tile (query tokens x GQA group), a power of two
            >= 16; block_n: keys per tile, a power of two >= 16. None picks
            per device.
        out: optional ``[T, Hq, D]`` output (may be a view of a larger tensor).
        k_scale, v_scale: ``[Hkv]`` float32 scales of an fp8 cache; for an int4
            cache the open-block K store ``[S, BS, Hkv, D]`` and the sequences'
            entries ``[B]`` int64 (-1: none), or None; None otherwise.

    Returns:
        ``[T, Hq, D]`` in the query's dtype, accumulated in float32.

    Raises:
        ValueError: bad shapes, dtypes, devices, strides or options; an fp8 cache
            without scales, or scales for a cache in the model dtype; an int4
            cache with rows of the wrong width or a store of the wrong shape.
    """
    t, hq, d = query.shape
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected [NB, BS, Hkv, D], got {tuple(key_cache.shape)}")
    _, bs, hkv, _ = key_cache.shape
    b = seq_lens.shape[0]
    check_device(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    check_dtype("query", query, FLOAT_DTYPES)
    check_last_dim_contiguous("query", query)
    kv = check_paged_kv(key_cache, value_cache, query, b, k_scale, v_scale)
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_shape("query_start_loc", query_start_loc, (b + 1,))
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected [{b}, max_blocks] with unit column stride, "
                         f"got shape {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    group = hq // hkv
    if group > _MAX_GROUP:
        raise ValueError(f"GQA group {group} above {_MAX_GROUP}")
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} not in [1, {_MAX_HEAD_DIM}]")
    cfg = _tile_config(d, query.dtype, query.device)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if out is None:
        out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    else:
        check_shape("out", out, (t, hq, d))
        check_dtype("out", out, (query.dtype,))
        check_last_dim_contiguous("out", out)
    if b == 0 or t == 0 or max_query_len <= 0:
        return out

    block_m = max(block_m, next_pow2(group))
    block_q = block_m // group
    precision, upcast = dot_options(query.dtype, query.device)
    grid = (triton.cdiv(max_query_len, block_q), b, hkv)
    _paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        *kv.scales, scale * _LOG2E,
        query.stride(0), query.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), *kv.store_strides,
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_D=max(16, next_pow2(d)), BLOCK_N=block_n, DOT_PRECISION=precision,
        UPCAST=upcast, FP8=kv.fp8, INT4=kv.int4, INT4_GROUP=kv.int4_group,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
