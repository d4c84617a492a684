"""Rotary position embedding, in place on q and k, half-split (NeoX) layout.

Algorithm: RoPE (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding", eq. 34), in the half-split layout of GPT-NeoX and Hugging
Face Llama: dimension ``i < D/2`` is paired with ``i + D/2`` and the pair is
rotated by ``position * base^(-2i/D)``::

    x1' = x1 cos - x2 sin,    x2' = x2 cos + x1 sin

computed in float32. One program rotates every head of q and k of one token,
so the token's cos/sin row is read once.

Tensors:
    positions      [T]              int64 or int32, 0 <= position < max_position
    query          [T, Hq, D]       float32 / float16 / bfloat16, rotated in place
    key            [T, Hkv, D]      query's dtype, rotated in place
    cos_sin_cache  [max_position, D] float (cos of the D/2 frequencies, then sin),
                                    from :func:`tandem.kernels.reference.rope_cos_sin_cache`

Limits: even ``D <= 512``; ``Hq * D / 2`` at most 65536 elements (one tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_shape, next_pow2)
from tandem.kernels.reference import rotary_embedding_ref

__all__ = ["rotary_embedding", "rotary_embedding_ref"]

_MAX_HEAD_DIM = 512


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin, offs_i,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_i[None, :] < HALF)
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_sin_stride,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < HALF
    row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(row + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * q_stride_t, q_stride_h, cos, sin, offs_i,
                  NUM_Q_HEADS, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + tok * k_stride_t, k_stride_h, cos, sin, offs_i,
                  NUM_K_HEADS, HALF, BLOCK_HK)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` in place (Triton).

    Same contract as :func:`tandem.kernels.reference.rotary_embedding_ref`.

    Args:
        positions: ``[T]`` int64/int32 token positions.
        query: ``[T, Hq, D]``; key: ``[T, Hkv, D]``; any outer strides (views of a
            fused QKV projection), innermost stride 1; written.
        cos_sin_cache: ``[max_position, D]``, innermost stride 1.

    Returns:
        ``(query, key)``, the same tensors, rotated.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"expected query [T, Hq, D] and key [T, Hkv, D], got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    t, hq, d = query.shape
    hkv = key.shape[1]
    check_device(positions, query, key, cos_sin_cache)
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("key", key, (query.dtype,))
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    check_dtype("positions", positions, (torch.int64, torch.int32))
    check_shape("positions", positions, (t,))
    check_shape("key", key, (t, hkv, d))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache: expected [max_position, {d}], "
                         f"got {tuple(cos_sin_cache.shape)}")
    if d % 2 or not 2 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} must be even and in [2, {_MAX_HEAD_DIM}]")
    for name, x in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, x)
    if t:
        half = d // 2
        _rotary_kernel[(t,)](
            positions, query, key, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=hq, NUM_K_HEADS=hkv, HALF=half,
            BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hkv), BLOCK_HALF=next_pow2(half))
    return query, key
