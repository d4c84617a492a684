"""Triton tile loads of an int4 KV cache (``kv_cache_dtype int4``), for the paged
attention kernels: a K tile ``[BLOCK_D, BLOCK_N]`` (transposed) or a V tile
``[BLOCK_N, BLOCK_D]`` of float32 values decoded in registers from the cache's
packed rows, the layout of :mod:`tandem.kernels.int4_kv` (KIVI, Liu et al. 2024,
sec. 3):

- row ``(block, slot, head)``: ``D / 2`` bytes of codes (channel ``2i`` in the low
  nibble of byte ``i``), then fp16 ``(step, lo)`` pairs; value ``= q * step + lo``;
- V rows, and the K rows of a block that is not full, are per token: channel ``c``
  uses the row's pair ``c // G`` (bytes ``D / 2 + 4 (c // G)``);
- the K rows of a full block (``(i + 1) * BS <= seq_len``) are per channel: channel
  ``c``'s pair is bytes ``4c .. 4c + 3`` of the block's ``4 D`` parameter bytes,
  which are spread over its rows, ``PR = 4 D / BS`` per row (byte ``p`` in row
  ``p // PR`` at ``D / 2 + p % PR``);
- the K of a sequence's open last block is read from the open-block store
  (``[S, BS, Hkv, D]``, the model dtype) at the sequence's entry, when it has one
  (KIVI's full-precision residual).

The values are float32 ``q * step + lo`` of the fp16 pair, which
:func:`tandem.kernels.int4_kv.dequantize_int4_blocks` computes (up to the
contraction of the multiply-add into one FMA by the GPU compiler).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.kernels._common import fp16_from_bytes, load_fp16


@triton.jit
def _spread_byte(block_base, p, k_stride_t, mask, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """Byte ``p`` of a block's per-channel parameter bytes (``PR = 4 D / BS`` per row)."""
    PR: tl.constexpr = 4 * HEAD_DIM // BLOCK_SIZE
    return tl.load(block_base + (p // PR) * k_stride_t + HEAD_DIM // 2 + p % PR, mask=mask,
                   other=0)


@triton.jit
def _spread_fp16(block_base, p, k_stride_t, mask, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """float32 of the fp16 at bytes ``p, p + 1`` of the spread parameters (the two may
    lie in different rows when ``PR < 2``)."""
    return fp16_from_bytes(_spread_byte(block_base, p, k_stride_t, mask, HEAD_DIM, BLOCK_SIZE),
                           _spread_byte(block_base, p + 1, k_stride_t, mask, HEAD_DIM,
                                        BLOCK_SIZE))


@triton.jit
def _codes(row_ptrs, offs_d, mask):
    """4-bit codes of channels ``offs_d`` at rows ``row_ptrs`` (broadcast), as float32."""
    byte = tl.load(row_ptrs + offs_d // 2, mask=mask, other=0)
    return ((byte >> ((offs_d % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)


@triton.jit
def load_int4_key_tile(k_cache_ptr, block_ids, in_block, offs_n, offs_d, mask_n, mask_d,
                       kv_head, seq_len, k_stride_b, k_stride_t, k_stride_h,
                       store_ptr, entry, s_stride_e, s_stride_t, s_stride_h,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       GROUP_SIZE: tl.constexpr):
    """K of context tokens ``offs_n`` ``[BLOCK_N]`` (their cache blocks ``block_ids``,
    slots ``in_block``), channels ``offs_d``: float32 ``[BLOCK_D, BLOCK_N]``, 0 where
    masked. ``entry``: the sequence's open-block store entry (-1: none)."""
    mask = mask_d[:, None] & mask_n[None, :]
    head = kv_head * k_stride_h
    block_base = k_cache_ptr + block_ids[None, :] * k_stride_b + head
    rows = block_base + in_block[None, :] * k_stride_t
    q = _codes(rows, offs_d[:, None], mask)
    ends = (offs_n // BLOCK_SIZE + 1) * BLOCK_SIZE
    full = (ends <= seq_len)[None, :]
    # Per token: pair c // G of the token's own row.
    tok_params = rows + HEAD_DIM // 2 + 4 * (offs_d[:, None] // GROUP_SIZE)
    tok_mask = mask & (ends > seq_len)[None, :]
    step_t = load_fp16(tok_params, tok_mask)
    lo_t = load_fp16(tok_params + 2, tok_mask)
    # Per channel: bytes 4c .. 4c + 3 of the block's parameter bytes.
    p = 4 * offs_d[:, None]
    ch_mask = mask & full
    step_c = _spread_fp16(block_base, p, k_stride_t, ch_mask, HEAD_DIM, BLOCK_SIZE)
    lo_c = _spread_fp16(block_base, p + 2, k_stride_t, ch_mask, HEAD_DIM, BLOCK_SIZE)
    k = tl.where(full, q * step_c + lo_c, q * step_t + lo_t)
    # The open last block: its exact K from the store.
    last = (seq_len - 1) // BLOCK_SIZE
    is_open = (offs_n // BLOCK_SIZE == last) & ((offs_n * 0 + entry) >= 0)
    open_mask = mask & is_open[None, :]
    exact = tl.load(store_ptr + entry * s_stride_e + in_block[None, :] * s_stride_t
                    + kv_head * s_stride_h + offs_d[:, None], mask=open_mask, other=0.0)
    k = tl.where(is_open[None, :], exact.to(tl.float32), k)
    return tl.where(mask, k, 0.0)


@triton.jit
def load_int4_value_tile(v_cache_ptr, block_ids, in_block, mask_n, offs_d, mask_d, kv_head,
                         v_stride_b, v_stride_t, v_stride_h,
                         HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """V (per-token rows) of the tile's tokens: float32 ``[BLOCK_N, BLOCK_D]``, 0 where
    masked."""
    mask = mask_n[:, None] & mask_d[None, :]
    rows = (v_cache_ptr + block_ids[:, None] * v_stride_b + in_block[:, None] * v_stride_t
            + kv_head * v_stride_h)
    q = _codes(rows, offs_d[None, :], mask)
    params = rows + HEAD_DIM // 2 + 4 * (offs_d[None, :] // GROUP_SIZE)
    v = q * load_fp16(params, mask) + load_fp16(params + 2, mask)
    return tl.where(mask, v, 0.0)
