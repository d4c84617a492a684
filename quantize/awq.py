"""AWQ: activation-aware int4 weight quantization (Lin et al. 2023, "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration", Section 3).

A small fraction of input channels carries large activations, and the error of a
rounded weight is multiplied by its input. AWQ therefore scales each input channel
``j`` of a linear layer up by ``s_j`` before rounding and its input down by the same
factor, ``y = (x diag(s)^-1) Q(W diag(s))^T``, which protects the salient channels
(Section 3.2). The inverse scale is folded into the operation that produces ``x``,
so serving costs nothing extra. The scales come from a search (Section 3.3): with
``s_x`` the mean input magnitude per channel, ``s = s_x ** alpha`` for ``alpha`` on
a grid in ``[0, 1)``, keeping the ``alpha`` whose quantized block output is closest
(mean squared error) to the float one on calibration data. ``alpha = 0`` is plain
round-to-nearest (RTN), so the search is never worse than RTN on that data. A
second search clips each weight group's range (``max |w|`` shrunk by a ratio, the
ratio minimizing the group's output error), as AutoAWQ's ``auto_clip`` does.

The model is read and run by :mod:`tandem.quantize.dense` (its loader, float32
decoder layer and checkpoint writer). Per decoder layer, the groups of linears
that share an input, and where the inverse scale goes:

========================  ====================  =====================================
scaled linears            their input           ``1 / s`` folded into
========================  ====================  =====================================
q, k, v                   input_layernorm(h)    ``input_layernorm.weight``
o                         attention output      rows of ``v_proj`` (only without GQA)
gate, up                  post_attention norm   ``post_attention_layernorm.weight``
down                      silu(gate) * up       rows of ``up_proj``
========================  ====================  =====================================

``o_proj``'s input channels are the ``num_heads * head_dim`` attention outputs, and
``v_proj`` produces ``num_kv_heads * head_dim`` channels, each read by
``num_heads / num_kv_heads`` query heads: one scale per ``o_proj`` input channel
cannot be folded into ``v_proj`` unless the two are the same channels, i.e.
``num_heads == num_kv_heads``. Under GQA (the default model: 9 query, 3 KV heads)
that pair is skipped and ``o_proj`` is quantized without scales, as AutoAWQ does.

**Inputs of each layer.** Every layer is calibrated on the *float* model's
activations: layer ``i + 1`` sees the float output of layer ``i`` (before its
scales, clipping and rounding), as AutoAWQ does and as the paper's activation
statistics are defined. The searches then optimise each block for the
activations it will mostly see at serving time, rather than for a calibration
stream bent by the rounding of the layers before it, and the layers' searches are
independent of one another (a layer's scaled-but-unrounded output equals its float
output, so folding alone never moves the next layer's inputs).

Quantization: ``bits``-bit asymmetric round-to-nearest per group of ``group_size``
consecutive input channels of each output row: ``step = (max - min) / (2^bits - 1)``
rounded to float16 (the checkpoint's dtype, so the search sees exactly what is
served), ``zero = round(-min / step)``, ``q = clamp(round(w / step) + zero, 0,
2^bits - 1)``, ``w' = (q - zero) * step``.

**Mixture of experts** (Mixtral, Qwen2-MoE, Qwen3-MoE; AutoAWQ's Mixtral recipe): the
MoE block's input gets one scale, searched over every expert's gate and up (and a
shared expert's) against the block's output with the tokens routed as the float
router routes them, its ``1 / s`` folded into ``post_attention_layernorm`` and its
``s`` into the router's and ``shared_expert_gate``'s columns too, which stay float:
the routing is exactly unchanged. Each expert reached by a calibration token gets
its own ``down`` scale from its tokens' ``silu(gate) * up``, folded into its ``up``
rows; clipping runs per expert on its own inputs. Attention is searched as above,
with Qwen2-MoE's q/k/v biases and Qwen3's Q/K norms in the block.

The result is written in AutoAWQ's "gemm" checkpoint layout
(:mod:`tandem.engine.quantization.awq_linear`), which ``LLM(model=dir,
quantization="awq")`` serves.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.quantization.awq_linear import PACK_FACTOR, pack_int4
from tandem.kernels.reference import rope_cos_sin_cache
from tandem.quantize.dense import (LayerActivations, attention_block, check_output,
                                   decoder_layer, layer_weights, load_dense, mlp_block,
                                   moe_block, quantized_state, write_checkpoint)

logger = logging.getLogger(__name__)

# Linears whose range is clipped; AutoAWQ leaves q and k alone (their error passes
# through the softmax, which the per-group output error below does not model).
CLIPPED = ("v", "o", "gate", "up", "down")


# -- quantization --------------------------------------------------------------------------
def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` -> ``[N, K / g, g]``; raises ValueError when ``g`` does not divide ``K``."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the input width {k}")
    return w.reshape(n, k // group_size, group_size)


def _round_groups(wg: torch.Tensor, bits: int, wmin: torch.Tensor | None = None,
                  wmax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wg`` ``[N, G, g]`` float32 -> float32 ``(codes [N, G, g], zeros [N, G, 1],
    steps [N, G, 1])`` (the quantizer of :func:`quantize_groups`); ``wmin``/``wmax``
    ``[N, G, 1]``, the groups' extremes, when the caller knows them."""
    qmax = 2 ** bits - 1
    if wmin is None or wmax is None:
        wmin, wmax = torch.aminmax(wg, dim=-1, keepdim=True)
    steps = ((wmax - wmin).clamp_(min=1e-5) / qmax).half().float()
    zeros = torch.round(-wmin / steps).clamp_(0, qmax)
    codes = (wg / steps).round_().add_(zeros).clamp_(0, qmax)
    return codes, zeros, steps


def quantize_groups(w: torch.Tensor, bits: int, group_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of each group of ``group_size`` input channels.

    Args:
        w: float weight ``[N, K]`` (``nn.Linear`` orientation).
        bits: code width (codes ``0 .. 2^bits - 1``).
        group_size: ``g``, which must divide ``K``.

    Returns:
        ``(codes, zeros, steps)``: int32 ``[N, K]``, int32 ``[N, K / g]`` and
        float32 ``[N, K / g]`` holding float16-representable steps, with
        ``w ~ (codes - zeros) * steps`` per group.

    Raises:
        ValueError: ``group_size`` does not divide ``K``.
    """
    codes, zeros, steps = _round_groups(_groups(w.float(), group_size), bits)
    return (codes.reshape(w.shape).to(torch.int32), zeros[..., 0].to(torch.int32),
            steps[..., 0])


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``w`` ``[N, K]`` rounded as :func:`quantize_groups` rounds it, back in float32:
    ``(codes - zeros) * steps``, the weight the checkpoint serves."""
    codes, zeros, steps = _round_groups(_groups(w.float(), group_size), bits)
    return codes.sub_(zeros).mul_(steps).reshape(w.shape)


def pack_awq_weight(w: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """One linear's weight ``[N, K]`` as AWQ gemm-layout tensors.

    Returns:
        ``{"qweight": int32 [K, N / 8], "qzeros": int32 [K / g, N / 8],
        "scales": float16 [K / g, N]}``, which
        :func:`~tandem.engine.quantization.awq_linear.dequantize_awq` turns back into
        exactly :func:`fake_quantize` of ``w``.

    Raises:
        ValueError: ``bits != 4``, ``N`` not a multiple of 8, ``g`` not dividing ``K``.
    """
    if bits != 4:
        raise ValueError(f"bits: the AWQ gemm layout packs 4-bit codes, got {bits}")
    codes, zeros, steps = quantize_groups(w, bits, group_size)
    return {"qweight": pack_int4(codes.t().contiguous()),
            "qzeros": pack_int4(zeros.t().contiguous()),
            "scales": steps.t().contiguous().half()}


# -- the searches --------------------------------------------------------------------------
@dataclass
class ScaleSearch:
    """Outcome of one group's scale search (Section 3.3).

    Attributes:
        alpha: the chosen exponent (0: the RTN scales, all ones).
        mse_rtn: block output MSE with plain RTN weights (``alpha = 0``).
        mse_awq: block output MSE with the chosen scales (``<= mse_rtn``).
        scales: ``[K]`` float32 per-input-channel scales ``s`` (weights multiplied,
            the input divided).
    """

    alpha: float
    mse_rtn: float
    mse_awq: float
    scales: torch.Tensor


def search_scales(x: torch.Tensor, weights: list[torch.Tensor],
                  block: Callable[[list[torch.Tensor]], torch.Tensor], target: torch.Tensor,
                  bits: int, group_size: int, grid: int) -> ScaleSearch:
    """Grid search of ``s = s_x ** alpha`` for linears sharing the input ``x``.

    ``s_x`` is the mean ``|x|`` per input channel; ``s`` is normalised by
    ``sqrt(max(s) min(s))`` (AutoAWQ's normalisation; it keeps scales around 1
    and changes nothing else: rounding is invariant to a global scale up to the
    float16 steps). For each ``alpha`` in ``0, 1/grid, ..., (grid-1)/grid`` the
    linears' weights become ``Q(W diag(s)) diag(s)^-1`` (what the scaled, folded
    and quantized model computes on the unscaled input) and ``block`` is run.

    Args:
        x: the linears' common input ``[..., K]``.
        weights: their weights ``[N_i, K]`` (float32).
        block: ``block(weights) -> output``, the float computation from ``x`` to the
            output whose error is measured, with the given weights in place of
            ``weights``.
        target: ``block(weights)`` with the float weights.
        bits, group_size: the quantizer.
        grid: number of ``alpha`` values (1: RTN only).

    Returns:
        the :class:`ScaleSearch` of the best ``alpha`` (the first one on ties).
    """
    s_x = x.reshape(-1, x.shape[-1]).abs().mean(dim=0)
    trials = []                                          # (mse, alpha, scales)
    for i in range(grid):
        alpha = i / grid
        if i == 0:
            s = torch.ones_like(s_x)                     # RTN
        else:
            s = s_x.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
        quantized = [fake_quantize(w * s, bits, group_size) / s for w in weights]
        trials.append((float((block(quantized) - target).pow(2).mean()), alpha, s))
    mse, alpha, s = min(trials, key=lambda t: t[0])      # the first of equal ones
    return ScaleSearch(alpha, trials[0][0], mse, s)


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """Per weight group, the clipping range that best preserves the group's output.

    For each output row ``n`` and input group ``j``, the partial product
    ``y[t, n, j] = sum_{k in j} x[t, k] w[n, k]`` is compared with the same sum
    over ``Q(clamp(w, -r m, r m))``, ``m = max |w|`` of the group, for shrink ratios
    ``r = 1 - i / grid``, ``i = 0 .. max_shrink * grid - 1`` (AutoAWQ's ``auto_clip``:
    20 and 0.5, ratios 1 down to 0.55); the ratio with the smallest mean squared
    error over the tokens wins (``r = 1``, no clipping, is always a candidate, so
    no group's error grows). The error of a weight change ``d`` is computed through
    the group's Gram matrix, ``mean_t (x_tj . d)^2 = d^T (X_j^T X_j / T) d``: exact,
    over every token, at a cost that does not grow with the token count.

    Args:
        w: the (scaled) weight ``[N, K]`` float32.
        x: its (scaled) input ``[..., K]``.
        bits, group_size: the quantizer.
        grid, max_shrink: the ratios tried.

    Returns:
        ``[N, K / g]`` float32: the clipping bound ``r m`` of each group.
    """
    x = x.reshape(-1, x.shape[-1]).float()
    n, k = w.shape
    ng = k // group_size
    xg = x.reshape(-1, ng, group_size).transpose(0, 1)                   # [ng, T, g]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]                # [ng, g, g]
    wg = _groups(w.float(), group_size)                                  # [N, ng, g]
    wmin, wmax = torch.aminmax(wg, dim=-1, keepdim=True)
    m = torch.maximum(wmax, -wmin)                                       # [N, ng, 1]
    best_err = torch.full((n, ng), math.inf)
    best_bound = m[..., 0].clone()
    for i in range(max(1, int(max_shrink * grid))):
        b = m * (1 - i / grid)
        # Clamping moves the extremes to exactly these (no second pass for them).
        codes, zeros, steps = _round_groups(torch.clamp(wg, -b, b), bits,
                                            torch.maximum(wmin, -b), torch.minimum(wmax, b))
        dt = codes.sub_(zeros).mul_(steps).sub_(wg).transpose(0, 1)      # [ng, N, g]
        err = (torch.bmm(dt, gram) * dt).sum(dim=-1).t()                 # [N, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_bound = torch.where(better, b[..., 0], best_bound)
    return best_bound


def apply_clip(w: torch.Tensor, bound: torch.Tensor, group_size: int) -> None:
    """Clamp each group of ``w`` ``[N, K]`` to ``[-bound, bound]`` (``[N, K / g]``), in place."""
    b = bound[..., None]
    w.copy_(torch.clamp(_groups(w, group_size), -b, b).reshape(w.shape))


def fold_layer_scales(lw: dict[str, torch.Tensor], scales: dict[str, torch.Tensor | None]
                      ) -> None:
    """Fold a layer's AWQ scales into its float weights, in place (function unchanged).

    Args:
        lw: :func:`~tandem.quantize.dense.layer_weights` of the layer (float32, modified in place).
        scales: ``{"qkv", "o", "gate_up", "down"}`` -> ``[K]`` scales of that group's
            input channels, or None (not scaled). The scaled linears' columns are
            multiplied by ``s``; ``1 / s`` goes into ``input_layernorm.weight``
            (qkv), the rows of ``v_proj`` (o), ``post_attention_layernorm.weight``
            (gate_up) or the rows of ``up_proj`` (down). In a mixture-of-experts
            layer (``router`` in ``lw``) ``gate_up`` scales every expert's gate and
            up, and the router's and ``shared_expert_gate``'s columns (float, so
            the routing is unchanged), and ``experts_down`` maps each expert
            (``experts.{e}``, ``shared_expert``) to its ``down`` scales or None.

    Raises:
        ValueError: an ``o`` scale whose size is not ``v_proj``'s output width
            (GQA: the pair cannot be folded).
    """
    s = scales.get("qkv")
    if s is not None:
        lw["ln1"].div_(s)
        for name in ("q", "k", "v"):
            lw[name].mul_(s)
    s = scales.get("o")
    if s is not None:
        if lw["v"].shape[0] != s.numel():
            raise ValueError(f"o_proj scales ({s.numel()}) cannot fold into v_proj "
                             f"({lw['v'].shape[0]} outputs)")
        lw["v"].div_(s[:, None])
        lw["o"].mul_(s)
    s = scales.get("gate_up")
    if s is not None:
        lw["ln2"].div_(s)
        if "router" in lw:
            for k, w in lw.items():
                if k in ("router", "shared_expert_gate") or (
                        k.startswith(("experts.", "shared_expert.")) and k.endswith((".gate", ".up"))):
                    w.mul_(s)
        else:
            lw["gate"].mul_(s)
            lw["up"].mul_(s)
    for e, s_e in (scales.get("experts_down") or {}).items():
        if s_e is not None:
            lw[f"{e}.up"].div_(s_e[:, None])
            lw[f"{e}.down"].mul_(s_e)
    s = scales.get("down")
    if s is not None:
        lw["up"].div_(s[:, None])
        lw["down"].mul_(s)


def layer_scales(found: dict) -> dict:
    """The scales of one :func:`awq_layer` result, as :func:`fold_layer_scales` takes them."""
    out = {g: (None if found.get(g) is None else found[g].scales)
           for g in ("qkv", "o", "gate_up", "down")}
    if "experts_down" in found:
        out["experts_down"] = {e: None if r is None else r.scales
                               for e, r in found["experts_down"].items()}
    return out


def fold_scales(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                scales: list[dict[str, torch.Tensor | None]]) -> None:
    """:func:`fold_layer_scales` for every layer (``scales[i]`` of layer ``i``), in place."""
    for i in range(cfg.num_layers):
        fold_layer_scales(layer_weights(weights, i, cfg), scales[i])


def awq_layer(cfg: ModelConfig, lw: dict[str, torch.Tensor], acts: LayerActivations,
              cos_sin: torch.Tensor, bits: int, group_size: int, grid: int,
              clip: bool, clip_grid: int = 20) -> dict:
    """Search, fold and clip one layer's weights in place (they stay float32).

    Args:
        lw: :func:`~tandem.quantize.dense.layer_weights` of the layer, float32, modified in place.
        acts: the float layer's :class:`~tandem.quantize.dense.LayerActivations` on the
            calibration batch.

    Returns:
        ``{"qkv" | "o" | "gate_up" | "down": ScaleSearch or None (o under GQA),
        "clip": {linear: mean shrink ratio}}``.
    """
    fq, fk, fv, fo = lw["q"].clone(), lw["k"].clone(), lw["v"].clone(), lw["o"].clone()
    found: dict = {}
    found["qkv"] = search_scales(
        acts.attn_in, [fq, fk, fv],
        lambda w: attention_block(cfg, acts.attn_in, w[0], w[1], w[2], fo, cos_sin, lw)[1],
        acts.attn_out, bits, group_size, grid)
    found["o"] = None
    if fv.shape[0] == fo.shape[1]:          # num_heads == num_kv_heads
        found["o"] = search_scales(acts.o_in, [fo], lambda w: acts.o_in @ w[0].t(),
                                   acts.attn_out, bits, group_size, grid)
    if "router" in lw:
        return _awq_moe(cfg, lw, acts, found, bits, group_size, grid, clip, clip_grid)
    fg, fu, fd = lw["gate"].clone(), lw["up"].clone(), lw["down"].clone()
    found["gate_up"] = search_scales(
        acts.mlp_in, [fg, fu], lambda w: mlp_block(acts.mlp_in, w[0], w[1], fd)[1],
        acts.mlp_out, bits, group_size, grid)
    found["down"] = search_scales(acts.down_in, [fd], lambda w: acts.down_in @ w[0].t(),
                                  acts.mlp_out, bits, group_size, grid)
    fold_layer_scales(lw, {k: (v.scales if v is not None else None) for k, v in found.items()})
    ratios = {}
    if clip:
        def scaled(x: torch.Tensor, key: str) -> torch.Tensor:
            return x if found[key] is None else x / found[key].scales
        inputs = {"v": scaled(acts.attn_in, "qkv"), "o": scaled(acts.o_in, "o"),
                  "gate": scaled(acts.mlp_in, "gate_up"), "up": scaled(acts.mlp_in, "gate_up"),
                  "down": scaled(acts.down_in, "down")}
        for name in CLIPPED:
            bound = search_clip(lw[name], inputs[name], bits, group_size, clip_grid)
            m = _groups(lw[name], group_size).abs().amax(dim=-1)
            ratios[name] = float((bound / m.clamp(min=1e-12)).mean())
            apply_clip(lw[name], bound, group_size)
    found["clip"] = ratios
    return found


def _awq_moe(cfg: ModelConfig, lw: dict[str, torch.Tensor], acts: LayerActivations,
             found: dict, bits: int, group_size: int, grid: int, clip: bool,
             clip_grid: int) -> dict:
    """:func:`awq_layer` for a mixture-of-experts layer, after its attention searches
    (``found``: ``qkv``, ``o``), following AutoAWQ's Mixtral recipe:

    - ``gate_up``: one scale for the MoE block's input, searched over every expert's
      gate and up (and a shared expert's) together against the block's output (the
      tokens routed as the float router routes them); ``1 / s`` folds into
      ``post_attention_layernorm``, and ``s`` into the router's and the shared
      expert gate's columns too (they read the same input and stay float), so the
      routing is unchanged.
    - ``experts_down``: per expert (and shared expert), a scale for ``down`` from the
      ``silu(gate) * up`` of the tokens routed to it, folded into the rows of its
      ``up``; None for an expert no calibration token reached.
    - clipping of ``v``, ``o`` and each reached expert's gate, up and down on its own
      (scaled) inputs.

    Returns:
        ``{"qkv", "o", "gate_up": ScaleSearch, "down": None, "experts_down": {expert:
        ScaleSearch or None}, "clip": {linear: mean shrink ratio}}``.
    """
    experts = [f"experts.{e}" for e in range(cfg.moe.num_experts)]
    if "shared_expert.gate" in lw:
        experts.append("shared_expert")
    inputs: dict[str, torch.Tensor] = {}
    moe_block(cfg, lw, acts.mlp_in, lambda name, x: inputs.__setitem__(name, x))
    gate_up = [f"{e}.{p}" for e in experts for p in ("gate", "up")]
    floats = [lw[k].clone() for k in gate_up]

    def block(ws: list[torch.Tensor]) -> torch.Tensor:
        return moe_block(cfg, {**lw, **dict(zip(gate_up, ws))}, acts.mlp_in)

    found["gate_up"] = search_scales(acts.mlp_in, floats, block, acts.mlp_out, bits,
                                     group_size, grid)
    found["down"] = None
    found["experts_down"] = {}
    for e in experts:
        x = inputs[f"{e}.down"]
        if x.shape[0] == 0:
            found["experts_down"][e] = None
            continue
        fd = lw[f"{e}.down"].clone()
        found["experts_down"][e] = search_scales(x, [fd], lambda w, x=x: x @ w[0].t(),
                                                 x @ fd.t(), bits, group_size, grid)
    fold_layer_scales(lw, layer_scales(found))
    ratios = {}
    if clip:
        def scaled(x: torch.Tensor, r: ScaleSearch | None) -> torch.Tensor:
            return x if r is None else x / r.scales
        todo = {"v": scaled(acts.attn_in, found["qkv"]), "o": scaled(acts.o_in, found["o"])}
        for e in experts:
            if inputs[f"{e}.gate_up"].shape[0] == 0:
                continue
            x = scaled(inputs[f"{e}.gate_up"], found["gate_up"])
            todo |= {f"{e}.gate": x, f"{e}.up": x,
                     f"{e}.down": scaled(inputs[f"{e}.down"], found["experts_down"][e])}
        for name, x in todo.items():
            bound = search_clip(lw[name], x, bits, group_size, clip_grid)
            m = _groups(lw[name], group_size).abs().amax(dim=-1)
            ratios[name] = float((bound / m.clamp(min=1e-12)).mean())
            apply_clip(lw[name], bound, group_size)
    found["clip"] = ratios
    return found


def awq_transform(cfg: ModelConfig, weights: dict[str, torch.Tensor], input_ids: torch.Tensor,
                  *, bits: int = 4, group_size: int = 128, grid: int = 20, clip: bool = True,
                  clip_grid: int = 20, progress: Callable[[int, dict], None] | None = None
                  ) -> list[dict]:
    """Scale (and clip) every decoder layer's float weights in place, ready to round.

    Each layer is calibrated on the float model's activations (see the module
    docstring): the calibration batch is run through the original layer first, its
    output feeds the next layer, then the layer's weights are searched and changed.

    Args:
        cfg: the model.
        weights: Hugging Face names -> float32 tensors; the decoder layers' linear
            weights and norms are modified in place.
        input_ids: calibration tokens ``[B, S]`` int64.
        bits, group_size, grid, clip, clip_grid: see :func:`awq_quantize`.
        progress: called as ``progress(layer, result)`` after each layer.

    Returns:
        one :func:`awq_layer` result per layer.
    """
    if grid < 1:
        raise ValueError(f"grid: must be >= 1, got {grid}")
    cos_sin = rope_cos_sin_cache(cfg.head_dim, input_ids.shape[1], cfg.rope_theta)
    with torch.no_grad():
        h = weights["model.embed_tokens.weight"][input_ids].float()
        results = []
        for i in range(cfg.num_layers):
            lw = layer_weights(weights, i, cfg)
            acts = decoder_layer(cfg, lw, h, cos_sin)
            h = acts.out
            results.append(awq_layer(cfg, lw, acts, cos_sin, bits, group_size, grid, clip,
                                     clip_grid))
            if progress is not None:
                progress(i, results[-1])
    return results


# -- the whole model -------------------------------------------------------------------------
def _search_stats(r: ScaleSearch | None) -> dict | None:
    return None if r is None else {"alpha": r.alpha, "mse_rtn": r.mse_rtn, "mse_awq": r.mse_awq}


def calibration_ids(tokenizer, text: str, num_tokens: int, seq_len: int = 512) -> torch.Tensor:
    """The calibration batch: ``text``'s tokens cut into sequences.

    Args:
        tokenizer: a :class:`~tandem.engine.text.tokenizer.Tokenizer`.
        text: calibration text.
        num_tokens: tokens to use at most.
        seq_len: tokens per sequence.

    Returns:
        int64 ``[B, S]``: ``B = min(num_tokens, len) // seq_len`` sequences of
        ``S = seq_len`` tokens, or one sequence of every token when there are fewer
        than ``seq_len``.

    Raises:
        ValueError: fewer than 2 tokens, or a non-positive count.
    """
    if num_tokens < 2 or seq_len < 2:
        raise ValueError("num_calibration_tokens and calibration_seq_len: must be >= 2")
    ids = tokenizer.encode(text)[:num_tokens]
    if len(ids) < 2:
        raise ValueError(f"calibration_text: {len(ids)} tokens, need at least 2")
    if len(ids) < seq_len:
        return torch.tensor([ids], dtype=torch.int64)
    b = len(ids) // seq_len
    return torch.tensor(ids[: b * seq_len], dtype=torch.int64).view(b, seq_len)


def awq_quantize(model_path: str | None, output_dir: str, calibration_text: str, *,
                 bits: int = 4, group_size: int = 128, num_calibration_tokens: int = 4096,
                 calibration_seq_len: int = 512, grid: int = 20, clip: bool = True,
                 clip_grid: int = 20, tokenizer=None) -> dict:
    """Quantize a Llama-layout model (dense, or Mixtral / Qwen2-MoE / Qwen3-MoE with
    every expert) with AWQ and write an AutoAWQ "gemm" checkpoint.

    Args:
        model_path: None (the default model's GGUF file), a .gguf file, or a dense
            Hugging Face checkpoint directory.
        output_dir: the checkpoint directory to write (absent or empty; written
            atomically by :func:`~tandem.quantize.dense.write_checkpoint`).
        calibration_text: text whose tokens calibrate the scales (not a path).
        bits: code width; the gemm layout is 4-bit only.
        group_size: input channels per scale/zero point; must divide every linear's
            input width (576 and 1536 for the default model: 64 does, 128 does not).
        num_calibration_tokens: at most this many tokens of the text are used, cut
            into sequences of ``calibration_seq_len`` tokens.
        grid: ``alpha`` values searched, ``0, 1/grid, ..., (grid-1)/grid``; 1 is
            plain RTN scales.
        clip: run the clipping search (Section 3 / AutoAWQ ``auto_clip``) on v, o,
            gate, up and down; off with ``grid=1`` gives plain RTN.
        clip_grid: the clipping search tries shrink ratios ``1 - i / clip_grid`` for
            ``i < clip_grid / 2`` (AutoAWQ: 20, ratios 1 .. 0.55).
        tokenizer: the source's :class:`~tandem.engine.text.tokenizer.Tokenizer`, if
            the caller has one (saves loading it again); None loads it.

    Returns:
        stats: ``bits``, ``group_size``, ``calibration_tokens``,
        ``calibration_sequences``, ``grid``, ``clip``, ``seconds``, ``skipped``
        (pairs not scaled, with the reason), and ``layers``: per layer
        ``{"qkv" | "o" | "gate_up" | "down": {"alpha", "mse_rtn", "mse_awq"} or None,
        "clip": {linear: mean shrink ratio}}``, and ``scales``: per layer the ``[K]``
        float32 scales of each group (None where not scaled).

    Raises:
        ValueError: ``bits != 4``, a ``group_size`` that does not divide an input width,
            too little calibration text, a non-empty ``output_dir``, an already
            quantized source.
        FileNotFoundError, UnsupportedModelError, WeightLoadError: see
            :func:`~tandem.quantize.dense.load_dense`.
    """
    from tandem.engine.text.tokenizer import Tokenizer

    start = time.perf_counter()
    if bits != 4:
        raise ValueError(f"bits: the AWQ gemm layout packs 4-bit codes, got {bits}")
    check_output(output_dir, "output_dir")
    dense = load_dense(model_path, who="tandem quantize --method awq", moe=True)
    cfg, weights = dense.cfg, dense.weights
    ffn = {cfg.intermediate_size} if cfg.moe is None else {
        w for w in (cfg.intermediate_size, cfg.moe.moe_intermediate_size,
                    cfg.moe.shared_expert_intermediate_size) if w}
    widths = {cfg.hidden_size, cfg.num_heads * cfg.head_dim, *ffn}
    bad = sorted(k for k in widths if k % group_size)
    if group_size < 1 or bad:
        raise ValueError(f"group_size: {group_size} does not divide the input width(s) "
                         f"{bad} of this model's linears")
    outs = {cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size,
            *ffn}
    if any(n % PACK_FACTOR for n in outs):
        raise ValueError(f"model: output widths {sorted(outs)} must be multiples of 8")
    tokenizer = tokenizer or Tokenizer(dense.files)
    ids = calibration_ids(tokenizer, calibration_text, num_calibration_tokens,
                          calibration_seq_len)

    def progress(i: int, r: dict) -> None:
        logger.info("awq layer %d: %s", i, ", ".join(
            f"{k} alpha={v.alpha:.2f} mse {v.mse_rtn:.3g}->{v.mse_awq:.3g}"
            for k, v in r.items() if isinstance(v, ScaleSearch)))

    results = awq_transform(cfg, weights, ids, bits=bits, group_size=group_size, grid=grid,
                            clip=clip, clip_grid=clip_grid, progress=progress)
    state = quantized_state(weights, lambda module, w: pack_awq_weight(w, bits, group_size))
    write_checkpoint(output_dir, dense, state, {"quant_method": "awq", "bits": bits,
                                                "group_size": group_size, "zero_point": True,
                                                "version": "gemm"}, tokenizer)
    skipped = [] if cfg.num_heads == cfg.num_kv_heads else [
        f"v_proj -> o_proj: num_heads {cfg.num_heads} != num_kv_heads {cfg.num_kv_heads} (GQA)"]
    groups = ("qkv", "o", "gate_up", "down")
    return {
        "bits": bits, "group_size": group_size, "grid": grid, "clip": clip,
        "clip_grid": clip_grid,
        "calibration_tokens": ids.numel(), "calibration_sequences": ids.shape[0],
        "skipped": skipped, "output_dir": output_dir,
        "layers": [{**{g: _search_stats(r[g]) for g in groups}, "clip": r["clip"],
                    **({"experts_down": {e: _search_stats(x) for e, x in r["experts_down"].items()}}
                       if "experts_down" in r else {})} for r in results],
        "scales": [layer_scales(r) for r in results],
        "seconds": time.perf_counter() - start,
    }
