"""RMSNorm with an optional fused residual add.

Algorithm: RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4): ``y = x / sqrt(mean(x^2) + eps) * weight``, computed in
float32. With a residual, ``x + residual`` is rounded to x's dtype first (the
value the next layer's residual stream holds), normalised, and returned too, so
the add costs no extra pass over memory (the fused add of vLLM's
``fused_add_rms_norm``). One program normalises one row.

Tensors:
    x, residual  [T, H]   float32 / float16 / bfloat16 (same dtype)
    weight       [H]      any float dtype (read as float32)
    y            [T, H]   x's dtype

Limits: ``H <= 65536`` (one row is one tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_shape, next_pow2)
from tandem.kernels.reference import rms_norm_ref

__all__ = ["rms_norm", "rms_norm_ref"]

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    y_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    y_stride, residual_out_stride, x_stride, residual_stride,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * residual_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row, optionally of ``x + residual`` (Triton).

    Same contract as :func:`tandem.kernels.reference.rms_norm_ref`; the inputs
    are not modified.

    Args:
        x: ``[T, H]``, innermost stride 1; weight: ``[H]``; eps: added to the
            mean square.
        residual: ``[T, H]`` of x's dtype, or None.

    Returns:
        ``y`` ``[T, H]``, or ``(y, x + residual)``, both in x's dtype.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, H], got {tuple(x.shape)}")
    t, h = x.shape
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("weight", weight, (h,))
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if not 1 <= h <= _MAX_HIDDEN:
        raise ValueError(f"hidden size {h} not in [1, {_MAX_HIDDEN}]")
    y = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if residual is None:
        check_device(x, weight)
        residual_out = residual_in = y
    else:
        check_device(x, weight, residual)
        check_shape("residual", residual, (t, h))
        check_dtype("residual", residual, (x.dtype,))
        check_last_dim_contiguous("residual", residual)
        residual_in = residual
        residual_out = torch.empty_like(y)
    if t:
        _rms_norm_kernel[(t,)](
            y, residual_out, x, residual_in, weight, eps,
            y.stride(0), residual_out.stride(0), x.stride(0), residual_in.stride(0),
            HIDDEN=h, BLOCK_H=next_pow2(h), HAS_RESIDUAL=residual is not None,
            # As Triton's layer-norm tutorial: ~256 elements per warp keeps registers in bounds.
            num_warps=min(max(next_pow2(h) // 256, 1), 8))
    return y if residual is None else (y, residual_out)
