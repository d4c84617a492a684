"""Write this step's new K/V rows into the paged KV cache by slot mapping.

Algorithm: a scatter, one program per token, as vLLM's ``reshape_and_cache``
(Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", Sec. 4): token ``t`` goes to block
``slot_mapping[t] // BS`` at offset ``slot_mapping[t] % BS``.

Tensors:
    key, value               [T, Hkv, D]      float32 / float16 / bfloat16
    key_cache, value_cache   [NB, BS, Hkv, D] same dtype as key/value, or float8_e4m3fn
    slot_mapping             [T]              int64 (or int32), 0 <= slot < NB * BS
    k_scale, v_scale         [Hkv]            float32, > 0; with an fp8 cache only

FP8 KV cache (``kv_cache_dtype fp8_e4m3``): each element is stored as
``e4m3(clamp(x / scale[h], -448, 448))``, rounded to nearest even, which is
:func:`tandem.kernels.reference.quantize_fp8_e4m3_ref` bit for bit. The kernel
rounds in float32 arithmetic (:func:`round_to_e4m3`) and then converts a value
that e4m3 holds exactly, so the result does not depend on how a backend rounds
its float32 -> e4m3 conversion (the Triton interpreter rounds values just below
a power of two the wrong way: 31.8 becomes 16 instead of 32).

Limits: ``Hkv * D`` up to 65536 elements per token (one tile); slots must be
valid (there is no "skip" value) and distinct within a call, as the scatter
order between programs is unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_kv_cache_scales, check_last_dim_contiguous,
                                    check_shape, next_pow2)
from tandem.kernels.reference import reshape_and_cache_ref

__all__ = ["reshape_and_cache", "reshape_and_cache_ref", "round_to_e4m3"]

_FP8_MAX = tl.constexpr(448.0)
# 1.5 * 2**23: adding then subtracting 1.5 * 2**23 * step rounds a float32 |y| < 2**22 * step
# to a multiple of step, ties to even (the sum lands in a binade whose ulp is step).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_to_e4m3(y):
    """float32 ``y`` with ``|y| <= 448`` -> the nearest float8_e4m3fn value (ties to
    even), still as float32. e4m3 keeps 3 mantissa bits, so the grid step in the
    binade ``[2^e, 2^(e+1))`` is ``2^(e-3)``; below ``2^-6`` (the subnormals) it stays
    ``2^-9``. The exponent comes from the bits, not from ``log2``, to be exact; the
    magnitude is rounded and the sign put back, so negative values that round to 0
    give -0 as torch's cast does."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * _ROUND_MAGIC
    r = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -r, r)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    k_stride_b, k_stride_t, k_stride_h, v_stride_b, v_stride_t, v_stride_h,
    k_scale_ptr, v_scale_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
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
    if FP8:
        mask_h = offs_h < NUM_HEADS
        ks = tl.load(k_scale_ptr + offs_h, mask=mask_h, other=1.0)
        vs = tl.load(v_scale_ptr + offs_h, mask=mask_h, other=1.0)
        # IEEE division, as the reference (a plain '/' may be approximate on GPU).
        k = tl.math.div_rn(k.to(tl.float32), ks[:, None])
        v = tl.math.div_rn(v.to(tl.float32), vs[:, None])
        k = round_to_e4m3(tl.minimum(tl.maximum(k, -_FP8_MAX), _FP8_MAX))
        v = round_to_e4m3(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX))
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + block_id * k_stride_b + in_block * k_stride_t + hd * k_stride_h
             + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + block_id * v_stride_b + in_block * v_stride_t + hd * v_stride_h
             + offs_d[None, :], v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Scatter ``key``/``value`` into the caches in place (Triton).

    Same contract as :func:`tandem.kernels.reference.reshape_and_cache_ref`.

    Args:
        key, value: ``[T, Hkv, D]``; any outer strides (views of a fused QKV
            projection), innermost stride 1.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, key's dtype or
            ``torch.float8_e4m3fn``; written.
        slot_mapping: ``[T]`` int64 or int32 cache slots (``block_id * BS + offset``).
        k_scale, v_scale: ``[Hkv]`` float32 scales of an fp8 cache; None otherwise.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides; an fp8 cache without
            scales, or scales for a cache in the model dtype.
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
    check_dtype("value", value, (key.dtype,))
    fp8 = check_kv_cache_scales(key_cache, value_cache, key.dtype, k_scale, v_scale)
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        check_last_dim_contiguous(name, x)
    if t == 0:
        return
    _reshape_and_cache_kernel[(t,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        k_scale if fp8 else key, v_scale if fp8 else key,
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), FP8=fp8)
