"""Write this step's new K/V rows into the paged KV cache by slot mapping.

Algorithm: a scatter, one program per token, as vLLM's ``reshape_and_cache``
(Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", Sec. 4): token ``t`` goes to block
``slot_mapping[t] // BS`` at offset ``slot_mapping[t] % BS``.

Tensors:
    key, value               [T, Hkv, D]      float32 / float16 / bfloat16
    key_cache, value_cache   [NB, BS, Hkv, D] same dtype as key/value
    slot_mapping             [T]              int64 (or int32), 0 <= slot < NB * BS

Limits: ``Hkv * D`` up to 65536 elements per token (one tile); slots must be
valid (there is no "skip" value) and distinct within a call, as the scatter
order between programs is unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_shape, next_pow2)
from tandem.kernels.reference import reshape_and_cache_ref

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    k_stride_b, k_stride_t, k_stride_h, v_stride_b, v_stride_t, v_stride_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    hd = offs_h[:, None]
    k = tl.load(key_ptr + tok * key_stride_t + hd * key_stride_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * value_stride_t + hd * value_stride_h + offs_d[None, :],
                mask=mask)
    tl.store(k_cache_ptr + block_id * k_stride_b + in_block * k_stride_t + hd * k_stride_h
             + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + block_id * v_stride_b + in_block * v_stride_t + hd * v_stride_h
             + offs_d[None, :], v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` into the caches in place (Triton).

    Same contract as :func:`tandem.kernels.reference.reshape_and_cache_ref`.

    Args:
        key, value: ``[T, Hkv, D]``; any outer strides (views of a fused QKV
            projection), innermost stride 1.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, key's dtype; written.
        slot_mapping: ``[T]`` int64 or int32 cache slots (``block_id * BS + offset``).

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    if key.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"expected key [T, Hkv, D] and key_cache [NB, BS, Hkv, D], got "
                         f"{tuple(key.shape)} and {tuple(key_cache.shape)}")
    t, hkv, d = key.shape
    nb, bs = key_cache.shape[:2]
    check_device(key, value, key_cache, value_cache, slot_mapping)
    check_dtype("key", key, FLOAT_DTYPES)
    check_shape("value", value, (t, hkv, d))
    check_shape("key_cache", key_cache, (nb, bs, hkv, d))
    check_shape("value_cache", value_cache, (nb, bs, hkv, d))
    check_shape("slot_mapping", slot_mapping, (t,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    for name, x in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_dtype(name, x, (key.dtype,))
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        check_last_dim_contiguous(name, x)
    if t == 0:
        return
    _reshape_and_cache_kernel[(t,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d))
