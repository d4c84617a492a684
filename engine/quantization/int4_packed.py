"""int4 weights with group scales and zero points (GPTQ, AWQ) kept packed on the CPU.

A GPTQ or AWQ checkpoint stores ``W[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n]``
with 4-bit codes ``q``, 4-bit zero points ``z`` and float16 scales ``s`` per group
``g(k)`` of input columns (``g_idx``; groups of consecutive columns, or any
assignment under GPTQ's act-order). At load, :func:`pack_int4_zp` rewrites a
layer into rows of :data:`~tandem.kernels.reference.INT4_ZP` blocks, which the GGUF
kernels read (on the CPU the compiled ``kernels/cpu/csrc/gguf_linear.cpp``, on CUDA
the Triton ``kernels/gguf_linear.py``): per output row
``n``, each 32 input columns are one block of 19 bytes,

    fp16 s, uint8 z, 16 bytes of codes (columns 0..15 in the low nibbles,
    16..31 in the high ones)

4.75 bits per weight, against 32 for the dense float32 weight the layer would
otherwise hold. Under act-order the columns are first sorted by group
(``perm``), so that each block lies in one group, and the activations are gathered
in the same order at run time (``x[:, perm]``, as vLLM's GPTQ kernels do): the
product is the same sum over ``k``.

Each block's weights ``(q - z) * s`` are exact in float32 (a 5-bit integer times an
fp16), so the kernels multiply exactly the dense dequantization's weights; only the
order of the float32 sums differs from ``F.linear`` on that dense weight.
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu.gguf_linear import gguf_dequantize, gguf_kernels_available, gguf_linear
from tandem.kernels.reference import INT4_ZP, dequantize_gguf_reference

BLOCK = 32          # weights per INT4_ZP block
BLOCK_BYTES = 19

__all__ = ["INT4_ZP", "pack_int4_zp", "dequantize_int4_zp", "int4_zp_linear",
           "packed_int4_supported"]


def packed_int4_supported(device: torch.device, in_features: int,
                          batch_invariant: bool = False) -> bool:
    """Whether a layer of ``in_features`` inputs on ``device`` can be served packed:
    whole 32-column blocks, and the CPU with the compiled kernels, or CUDA (the
    Triton kernel; not batch-invariant, so not with ``batch_invariant``)."""
    if in_features % BLOCK:
        return False
    if device.type == "cuda":
        return not batch_invariant
    return device.type == "cpu" and gguf_kernels_available()


def pack_int4_zp(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's codes, zero points and scales as rows of INT4_ZP blocks.

    Args:
        codes: integer ``[N, K]`` in ``0..15`` (output rows, input columns).
        zeros: integer ``[G, N]`` in ``0..15``.
        scales: float ``[G, N]`` whose values float16 holds exactly.
        g_idx: integer ``[K]``, the group of each input column, in ``0..G-1``.

    Returns:
        ``(blocks, perm)``: uint8 ``[N, K / 32 * 19]``, and int64 ``[K]``, the input
        column of each packed position (None when the columns are already in group
        order, the usual case without act-order).

    Raises:
        ValueError: ``K`` not a multiple of 32; a block of 32 sorted columns that
            spans two groups (a group whose size is not a multiple of 32); codes or
            zeros outside ``0..15``; a scale that is not a float16 value; shapes that
            do not fit.
    """
    n, k = codes.shape
    groups = scales.shape[0]
    if k % BLOCK:
        raise ValueError(f"codes: {k} input columns are not whole {BLOCK}-column blocks")
    if tuple(zeros.shape) != (groups, n) or tuple(scales.shape) != (groups, n) \
            or tuple(g_idx.shape) != (k,):
        raise ValueError(f"codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)}, scales "
                         f"{tuple(scales.shape)} and g_idx {tuple(g_idx.shape)} do not fit")
    for name, t in (("codes", codes), ("zeros", zeros)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise ValueError(f"{name}: values must lie in 0..15")
    half = scales.to(torch.float16)
    if not torch.equal(half.to(scales.dtype), scales):
        raise ValueError("scales: not all float16 values")
    g = g_idx.to(torch.int64)
    perm = torch.argsort(g, stable=True)
    if torch.equal(perm, torch.arange(k)):
        perm = None
    g_sorted = g if perm is None else g[perm]
    per_block = g_sorted.view(k // BLOCK, BLOCK)
    if not torch.equal(per_block, per_block[:, :1].expand_as(per_block)):
        raise ValueError("g_idx: a block of 32 columns (sorted by group) spans two groups; "
                         "each group's size must be a multiple of 32")
    block_group = per_block[:, 0]                                        # [C]
    c = (codes if perm is None else codes[:, perm]).to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    qs = c[..., :16] | (c[..., 16:] << 4)                                 # [N, C, 16]
    # [N, C]; a fresh copy, since contiguous() keeps a transposed [N, 1]'s stride N,
    # which the byte view below refuses (one block per row: K = 32)
    s = half.index_select(0, block_group).t().clone(memory_format=torch.contiguous_format)
    z = zeros.to(torch.uint8).index_select(0, block_group).t()
    blocks = torch.cat([s.view(torch.uint8).reshape(n, k // BLOCK, 2), z[..., None], qs], dim=-1)
    return blocks.reshape(n, k // BLOCK * BLOCK_BYTES).contiguous(), perm


def dequantize_int4_zp(blocks: torch.Tensor, perm: torch.Tensor | None,
                       in_features: int) -> torch.Tensor:
    """The dense float32 weight ``[N, in_features]`` of packed rows, columns back in
    the checkpoint's order (the inverse of :func:`pack_int4_zp`, exactly)."""
    if blocks.device.type == "cpu":
        w = gguf_dequantize(blocks, INT4_ZP, in_features)
    else:
        w = dequantize_gguf_reference(blocks, INT4_ZP, in_features)
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def int4_zp_linear(x: torch.Tensor, blocks: torch.Tensor, perm: torch.Tensor | None,
                   in_features: int, batch_invariant: bool = False,
                   int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` for packed rows ``blocks`` (``[M, K]`` -> ``[M, N]``, x's dtype).

    Args:
        x: ``[..., K]`` on blocks' device (CPU: float32 and bfloat16 run as they are,
            other dtypes through float32; CUDA: the Triton kernel, float32 / float16 /
            bfloat16).
        batch_invariant: always the in-register kernel, whose row ``m`` does not
            depend on the other rows.
        int8_activations: CPU: int8 activation blocks for decode-sized products
            (``activations="int8"`` of :func:`~tandem.kernels.cpu.gguf_linear.gguf_linear`).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    if x2.device.type == "cuda":
        from tandem.kernels.gguf_linear import gguf_linear as triton_gguf_linear

        return triton_gguf_linear(x2.contiguous(), blocks, INT4_ZP,
                                  in_features).reshape(*lead, blocks.shape[0])
    activations = "int8" if int8_activations else "float"
    if x2.dtype not in (torch.float32, torch.bfloat16):
        y = gguf_linear(x2.float(), blocks, INT4_ZP, in_features, fused_only=batch_invariant,
                        activations=activations).to(x.dtype)
    else:
        y = gguf_linear(x2, blocks, INT4_ZP, in_features, fused_only=batch_invariant,
                        activations=activations)
    return y.reshape(*lead, blocks.shape[0])
