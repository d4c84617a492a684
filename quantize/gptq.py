"""GPTQ: one-shot weight quantization with second-order error feedback.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (ICLR 2023, arXiv:2210.17323). For one linear
layer with weight ``W`` ``[N, K]`` and calibration inputs ``X`` ``[K, T]`` it
minimises ``||W X - Q X||^2`` column by column (Sec. 3, Optimal Brain Quantization):
each column is rounded (:mod:`~tandem.quantize.rtn`'s quantizer) and its
rounding error, weighted by the inverse Hessian ``H^-1`` of ``H = 2 X X^T``, is
pushed onto the columns not yet quantized. As in Algorithm 1 (Sec. 4):

- **arbitrary order** (Step 1): the columns are visited in one fixed order for all
  rows; with ``desc_act`` ("act-order", the reference code's option) by decreasing
  ``diag(H)``, the inputs with the largest activations first;
- **lazy batch updates** (Step 2): errors are applied inside blocks of
  ``block_size`` (128) columns, and to the remaining columns once per block;
- **Cholesky reformulation** (Step 3): the rows of ``H^-1`` the algorithm needs are
  those of the upper Cholesky factor of ``H^-1``, after dampening ``H`` by
  ``percdamp * mean(diag(H))`` on its diagonal.

Dead inputs (``diag(H) = 0``: never active in the calibration data) get
``H[i, i] = 1`` and a zero weight column, as in the reference implementation.
With groups (``group_size`` > 0, Sec. 4 "Additional details"), each group's scale
and zero are computed from the current, error-updated weights of its columns when
its first column comes up; groups follow the visiting order, so with act-order a
group holds the ``group_size`` columns visited together and ``g_idx`` records
each original column's group.
"""

from __future__ import annotations

import logging

import torch

from tandem.engine.quantization.packing import QuantizedWeight, num_groups
from tandem.quantize.rtn import check_group_size, find_params

logger = logging.getLogger(__name__)


class HessianAccumulator:
    """``H = 2 / sum(c) * sum_t c_t x_t x_t^T`` over the calibration tokens of one
    layer input (``c_t = 1``: the paper's ``2 X X^T``, normalised by the token count).

    Args:
        in_features: ``K``.

    Attributes:
        hessian: float32 ``[K, K]`` (the running weighted sum until :meth:`result`).
        total_weight: ``sum(c)`` so far (the token count when unweighted).
    """

    def __init__(self, in_features: int):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.total_weight = 0.0

    def add(self, x: torch.Tensor, token_weights: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` ``[T, K]`` (any float dtype; accumulated in float32),
        each token counted ``token_weights`` ``[T]`` times (None: once)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        if token_weights is None:
            self.hessian.addmm_(x.t(), x)
            self.total_weight += x.shape[0]
        else:
            c = token_weights.to(torch.float32).reshape(-1)
            self.hessian.addmm_((x * c[:, None]).t(), x)
            self.total_weight += float(c.sum())

    def result(self) -> torch.Tensor:
        """``H`` float32 ``[K, K]``.

        Raises:
            ValueError: no tokens were added.
        """
        if self.total_weight <= 0:
            raise ValueError("GPTQ needs calibration tokens: no inputs were recorded")
        return self.hessian * (2.0 / self.total_weight)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4,
                  group_size: int = 128, percdamp: float = 0.01, desc_act: bool = False,
                  block_size: int = 128) -> tuple[QuantizedWeight, torch.Tensor]:
    """Quantize one linear layer's weight with GPTQ (Algorithm 1).

    Args:
        weight: ``[N, K]`` (out_features, in_features), any float dtype (computed in float32).
        hessian: float32 ``[K, K]``, ``2 X X^T`` of the layer's inputs
            (:class:`HessianAccumulator`); not modified.
        bits: 2, 4 or 8.
        group_size: input columns per group; -1 for one scale/zero per row
            computed from the whole row before the first column.
        percdamp: dampening, as a fraction of the mean of ``diag(H)``; raised
            tenfold (up to three times) if the dampened ``H`` is still not positive
            definite.
        desc_act: visit the columns by decreasing ``diag(H)`` (act-order).
        block_size: columns per lazy batch. Group parameters come from exactly
            updated weights when groups and blocks align (one width divides the
            other), as with the defaults.

    Returns:
        ``(quantized, losses)``: the :class:`QuantizedWeight` (codes and ``g_idx`` in
        the original column order) and GPTQ's objective estimate per row, float32
        ``[N]``: ``sum_q (w_q - quant(w_q))^2 / (2 [H_F^-1]_qq)`` (Sec. 3, eq. 2;
        ``H_F^-1`` the inverse Hessian of the columns not yet quantized, ``U[q, q]**2``).

    Rows are quantized independently under the shared ``H``, so the rows of
    several layers with the same input (q/k/v) can be quantized in one call,
    stacked, with the same result as one call each.

    Raises:
        ValueError: shapes of ``weight`` and ``hessian`` disagree; bad ``bits`` or
            ``group_size``; ``H`` not positive definite even after dampening.
    """
    w = weight.detach().to(torch.float32).clone()
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian: expected [{k}, {k}] for a weight [{n}, {k}], "
                         f"got {list(hessian.shape)}")
    g = check_group_size(group_size, k, bits)
    h = hessian.to(torch.float32).clone()

    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if desc_act else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    hinv = _upper_cholesky_of_inverse(h, percdamp)

    groups = num_groups(k, group_size)
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    codes = torch.empty(n, k, dtype=torch.float32)      # integers, in float for speed
    maxq = float((1 << bits) - 1)
    if group_size == -1:
        scale, zero = find_params(w, bits)
        scales[0], zeros[0] = scale, zero
        s, z = scale.float(), zero.float()
    losses = torch.zeros(n, dtype=torch.float32)

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_size != -1 and col % g == 0:
                # The group's current weights: this block's updated copy, then the
                # (lazily updated) columns after it.
                end = min(col + g, k)
                cur = w1[:, i:end - i1] if end <= i2 else torch.cat([w1[:, i:], w[:, i2:end]], 1)
                scale, zero = find_params(cur, bits)
                scales[col // g], zeros[col // g] = scale, zero
                s, z = scale.float(), zero.float()
            wc = w1[:, i]
            # rtn.quantize_columns, inlined: the same float32 arithmetic (the
            # integer differences are exact in float32).
            c = torch.clamp(torch.round(wc / s) + z, 0.0, maxq)
            q = (c - z) * s
            codes[:, col] = c
            d = hinv1[i, i]
            e = (wc - q) / d
            losses.add_(e * e, alpha=0.5)
            w1[:, i:].addr_(e, hinv1[i, i:], alpha=-1.0)
            err1[:, i] = e
        w[:, i2:].addmm_(err1, hinv[i1:i2, i2:], alpha=-1.0)

    visit_group = (torch.arange(k) // g).to(torch.int32)
    if perm is None:
        g_idx = visit_group
    else:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = visit_group
    quantized = QuantizedWeight(codes.to(torch.uint8), zeros.to(torch.uint8), scales, g_idx,
                                bits, group_size, desc_act)
    return quantized, losses


def _upper_cholesky_of_inverse(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """``U`` with ``U^T U = (H + damp I)^-1``, ``damp = percdamp * mean(diag(H))``."""
    if not percdamp >= 0:
        raise ValueError(f"damp: must be >= 0, got {percdamp!r}")
    mean_diag = float(torch.mean(torch.diag(h)))
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for attempt in range(4):
        damp = percdamp * (10 ** attempt) * mean_diag
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                if attempt:
                    logger.warning("GPTQ: Hessian needed damp %.3g (asked %.3g)",
                                   percdamp * 10 ** attempt, percdamp)
                return upper
    raise ValueError(f"damp: the Hessian is not positive definite even with damp "
                     f"{percdamp * 1000:g}; calibrate on more tokens")
