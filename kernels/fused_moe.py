"""Fused mixture-of-experts: the routed experts' GEMMs over tokens grouped by expert.

Design after vLLM's ``fused_moe`` (its Triton kernel and ``moe_align_block_size``):
the ``T k`` (token, expert) pairs are sorted by expert and each expert's group is
padded to a multiple of ``BLOCK_M`` (:func:`moe_align_block_size`), so that every
``BLOCK_M`` rows of the sorted list belong to one expert. One kernel then computes,
for a program's ``(BLOCK_M pairs, BLOCK_N outputs)`` tile, ``A[rows] @ W[e]^T`` with
``e`` that block's expert: the gate/up GEMM reads the pairs' token rows of ``x``
(``pair // k``), the down GEMM the pairs' rows of the intermediate, and multiplies by
the routing weight. Padding slots carry the sentinel ``T k`` and are neither read nor
written. The SiLU-and-mul between the GEMMs is :func:`tandem.kernels.activation.silu_and_mul`,
and the ``k`` weighted outputs of a token are summed in torch (``[T, k, H].sum(1)``).

Accumulation is float32 (``tl.dot``); the reference is
:func:`tandem.engine.model.moe.fused_experts` with plain matmuls (its rows summed in
another order, so float32 agrees to rounding, not bit for bit).

Tensors:
    x              [T, H]        float32 / float16 / bfloat16
    w13            [E, 2I, H]    x's dtype (gate rows, then up rows)
    w2             [E, H, I]     x's dtype
    topk_weights   [T, k]        float32 (or x's dtype)
    topk_ids       [T, k]        int64 in 0..E-1
    out            [T, H]        x's dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import FLOAT_DTYPES, check_device, check_dtype, check_shape

__all__ = ["fused_moe", "moe_align_block_size"]


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's group padded to a multiple of ``block_m``.

    Args:
        topk_ids: ``[T, k]`` int64 expert ids.

    Returns:
        ``(sorted_pair_ids [P] int64, block_expert_ids [P / block_m] int64)``: pair
        ``t * k + j`` of token ``t``'s ``j``-th expert, the sentinel ``T k`` in
        padding slots; the expert of each block of ``block_m`` slots.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m                  # [E]
    starts = torch.cumsum(padded, 0) - padded                             # [E]
    total = int(padded.sum())
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int64, device=flat.device)
    # rank of each sorted pair within its expert's group
    group_start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - group_start[sorted_experts]
    sorted_ids[starts[sorted_experts] + rank] = order
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_ids, block_experts


@triton.jit
def _fused_moe_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr,
                      num_pairs, N, K, a_stride, w_stride_e, w_stride_n, c_stride,
                      A_ROW_DIV: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))   # [BM]
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)   # [BM, BK]
        w = tl.load(w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n
                    + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)  # [BK, BN]
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    if MUL_WEIGHTS:
        rw = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a, w, out, weights, sorted_ids, block_experts, num_pairs, a_row_div,
                  mul_weights, block_m, block_n=32, block_k=32):
    n, k = w.shape[1], w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](a, w, out, weights, sorted_ids, block_experts, num_pairs, n, k,
                            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                            A_ROW_DIV=a_row_div, MUL_WEIGHTS=mul_weights, BLOCK_M=block_m,
                            BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              block_m: int = 16) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs of ``x``, summed with the routing weights
    (Triton; see the module docstring for shapes).

    Returns:
        ``[T, H]`` in ``x``'s dtype: ``sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t))``
        with ``e = topk_ids[t, j]``, float32 accumulation.

    Raises:
        ValueError: mismatched shapes, dtypes or devices, an id outside
            ``0..E-1``, or tensors whose innermost stride is not 1.
    """
    from tandem.kernels.activation import silu_and_mul

    check_device(x, w13, w2, topk_weights, topk_ids)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_ids", topk_ids, (torch.int64, torch.int32))
    t, h = x.shape
    e, two_i, _ = w13.shape
    check_shape("w13", w13, (e, two_i, h))
    check_shape("w2", w2, (e, h, two_i // 2))
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    check_shape("topk_ids", topk_ids, (t, k))
    check_shape("topk_weights", topk_weights, (t, k))
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}: innermost dimension must have stride 1, "
                             f"strides {tensor.stride()}")
    if t == 0:
        return torch.zeros_like(x)
    if int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e:
        raise ValueError(f"topk_ids: expert ids must be in 0..{e - 1}")
    sorted_ids, block_experts = moe_align_block_size(topk_ids.long(), e, block_m)
    num_pairs = t * k
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_ids, block_experts, num_pairs, k,
                  False, block_m)
    act = silu_and_mul(gate_up)                                           # [T k, I]
    down = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, weights, sorted_ids, block_experts, num_pairs, 1,
                  True, block_m)
    return down.view(t, k, h).sum(dim=1)
