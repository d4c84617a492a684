"""Launcher helpers shared by the Triton kernels of this package.

Every launcher validates its arguments here before it builds a grid, so a wrong
shape, dtype or device fails with a ``ValueError`` that names the argument
instead of a Triton compile error or a silent out-of-bounds read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Dtypes the kernels load and store; accumulation is always float32.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (``tl.arange`` extents must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only under the Triton interpreter.

    Raises:
        ValueError: mixed devices, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {device} and {t.device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("Triton kernels on CPU tensors need TRITON_INTERPRET=1, set before "
                         "triton is first imported; use the torch reference backend otherwise")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raises ValueError unless ``t.dtype`` is one of ``dtypes``."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported, expected one of {dtypes}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Raises ValueError unless the innermost dimension has stride 1.

    The kernels accept any outer strides (views of a fused QKV tensor, slices of
    a batch) but vectorise loads along the head dimension.
    """
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: innermost dimension must have stride 1, strides {t.stride()}")


def check_kv_cache_scales(key_cache: torch.Tensor, value_cache: torch.Tensor,
                          model_dtype: torch.dtype, k_scale: torch.Tensor | None,
                          v_scale: torch.Tensor | None) -> bool:
    """Whether the caches are fp8 (``torch.float8_e4m3fn``, read and written with the
    per-head scales ``k_scale``/``v_scale`` ``[Hkv]`` float32) rather than in
    ``model_dtype``, after checking that the pair is consistent.

    Raises:
        ValueError: caches of another dtype (int4 rows among them) or of two
            dtypes; an fp8 cache without scales or with scales of the wrong
            shape, dtype or device; scales for a cache in the model dtype.
    """
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    check_dtype("key_cache", key_cache, (torch.float8_e4m3fn,) if fp8 else (model_dtype,))
    check_dtype("value_cache", value_cache, (key_cache.dtype,))
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale: only for a float8_e4m3fn KV cache, "
                             f"not {key_cache.dtype}")
        return False
    hkv = key_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name}: required with a float8_e4m3fn KV cache")
        check_shape(name, s, (hkv,))
        check_dtype(name, s, (torch.float32,))
        check_last_dim_contiguous(name, s)
        if s.device != key_cache.device:
            raise ValueError(f"{name}: on {s.device}, the cache on {key_cache.device}")
    return True


def dot_options(dtype: torch.dtype, device: torch.device) -> tuple[str | None, bool]:
    """``(input_precision, upcast)`` for the ``tl.dot`` calls of the attention kernels.

    float32 inputs use IEEE products: the default TF32 on GPU keeps 10 mantissa
    bits and would miss the float32 tolerance; half types keep the backend's
    default (None), which only concerns float32 operands. The interpreter computes
    ``tl.dot`` on bfloat16 operands wrongly (triton 3.8/3.9), so on CPU bf16
    tiles are upcast to float32 first, which is exact.
    """
    precision = "ieee" if dtype == torch.float32 else None
    upcast = dtype == torch.bfloat16 and device.type == "cpu"
    return precision, upcast


@triton.jit
def fp16_from_bytes(lo, hi):
    """float32 of the little-endian fp16 whose low and high bytes are ``lo``, ``hi``
    (uint8 tensors)."""
    return (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_fp16(ptr, mask):
    """float32 value of the little-endian fp16 at byte pointers ``ptr`` (two uint8 loads)."""
    return fp16_from_bytes(tl.load(ptr, mask=mask, other=0), tl.load(ptr + 1, mask=mask, other=0))


@dataclass(frozen=True)
class PagedKV:
    """What the attention kernels need to know of a checked paged KV cache.

    Attributes:
        fp8: a ``float8_e4m3fn`` cache (``scales`` are its ``k_scale``, ``v_scale``).
        int4: packed int4 rows (``scales`` are the open-block K store and the
            sequences' entries, ``store_strides`` the store's first three strides,
            ``int4_group`` the per-token group size).
        scales: the two tensors passed for the kernels' scale pointers (the query
            itself, never read, for a cache in the model dtype).
    """

    fp8: bool
    int4: bool
    scales: tuple[torch.Tensor, torch.Tensor]
    store_strides: tuple[int, int, int] = (0, 0, 0)
    int4_group: int = 1


def check_paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor,
                   num_seqs: int, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> PagedKV:
    """Check the caches an attention kernel reads for ``num_seqs`` sequences of
    ``query`` (``[..., Hq, D]``): ``[NB, BS, Hkv, D]`` in the query's dtype or fp8
    (with :func:`check_kv_cache_scales`), or int4 rows (with :func:`check_int4_kv`).

    Raises:
        ValueError: see :func:`check_kv_cache_scales` and :func:`check_int4_kv`.
    """
    d = query.shape[-1]
    if key_cache.dtype == torch.uint8:
        store, entries, group = check_int4_kv(key_cache, value_cache, d, num_seqs, k_scale,
                                              v_scale)
        return PagedKV(False, True, (store, entries), tuple(store.stride()[:3]), group)
    nb, bs, hkv, _ = key_cache.shape
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_shape(name, t, (nb, bs, hkv, d))
        check_last_dim_contiguous(name, t)
    fp8 = check_kv_cache_scales(key_cache, value_cache, query.dtype, k_scale, v_scale)
    return PagedKV(fp8, False, (k_scale, v_scale) if fp8 else (query, query))


def check_int4_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int,
                  num_seqs: int, store: torch.Tensor | None,
                  entries: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check an int4 KV cache (``uint8 [NB, BS, Hkv, R]`` rows of
    :mod:`tandem.kernels.int4_kv`) and its open-block K store; return ``(store,
    entries, group)``: the store (a one-entry placeholder when None), the sequences'
    entries ``[B]`` int64 (all -1 when None) and the per-token group size ``G``.

    Raises:
        ValueError: rows of the wrong width, caches of two shapes, a store of the
            wrong shape or strides, entries of the wrong shape, dtype or device, or
            only one of the two given.
    """
    from tandem.kernels.int4_kv import int4_kv_group_size, int4_kv_row_bytes

    nb, bs, hkv, row = key_cache.shape
    check_shape("value_cache", value_cache, (nb, bs, hkv, row))
    check_dtype("value_cache", value_cache, (torch.uint8,))
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    try:
        want = int4_kv_row_bytes(head_dim, bs)
    except ValueError as exc:
        raise ValueError(f"key_cache: {exc}") from exc
    if row != want:
        raise ValueError(f"key_cache: int4 rows of {head_dim} channels in blocks of {bs} "
                         f"tokens are {want} bytes, got {row}")
    if (store is None) != (entries is None):
        raise ValueError("k_scale/v_scale: an int4 cache takes both the open-block K store "
                         "and the sequences' entries, or neither")
    device = key_cache.device
    if store is None:
        store = torch.zeros(1, bs, hkv, head_dim, device=device)
        entries = torch.full((num_seqs,), -1, dtype=torch.int64, device=device)
    if store.dim() != 4 or tuple(store.shape[1:]) != (bs, hkv, head_dim):
        raise ValueError(f"k_scale: the open-block K store must be [S, {bs}, {hkv}, "
                         f"{head_dim}], got {tuple(store.shape)}")
    check_last_dim_contiguous("k_scale", store)
    check_shape("v_scale", entries, (num_seqs,))
    check_dtype("v_scale", entries, (torch.int64,))
    for name, t in (("k_scale", store), ("v_scale", entries)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, the cache on {device}")
    return store, entries, int4_kv_group_size(head_dim)
