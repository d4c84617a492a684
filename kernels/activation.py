"""SiLU-and-mul, the gate of a SwiGLU feed-forward block.

Algorithm: SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
the up/gate projection is fused into one matmul whose output ``x = [gate | up]``
this kernel turns into ``silu(gate) * up``, computed in float32, where
``silu(g) = g * sigmoid(g)`` (Elfwing et al. 2018). Programs tile
``(row, BLOCK_F columns)``.

Tensors:
    x    [..., 2F]   float32 / float16 / bfloat16, innermost stride 1
    out  [..., F]    x's dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import FLOAT_DTYPES, check_device, check_dtype, next_pow2
from tandem.kernels.reference import silu_and_mul_ref

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_MAX_BLOCK_F = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, x_stride, out_stride,
                         F: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < F
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + F + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` (Triton).

    Same contract as :func:`tandem.kernels.reference.silu_and_mul_ref`.

    Args:
        x: ``[..., 2F]``, innermost stride 1, leading dims flattenable to rows.

    Returns:
        ``[..., F]`` in x's dtype.

    Raises:
        ValueError: odd last dimension, bad dtype or strides.
    """
    check_device(x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: last dimension must be even, got shape {tuple(x.shape)}")
    if x.shape[-1] and x.stride(-1) != 1:
        raise ValueError(f"x: innermost dimension must have stride 1, strides {x.stride()}")
    f = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * f)
    out = torch.empty((rows.shape[0], f), dtype=x.dtype, device=x.device)
    if rows.shape[0] and f:
        block_f = min(next_pow2(f), _MAX_BLOCK_F)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(f, block_f))](
            out, rows, rows.stride(0), out.stride(0), F=f, BLOCK_F=block_f)
    return out.view(*x.shape[:-1], f)
