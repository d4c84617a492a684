"""``tandem quantize``: a model's linear layers to int GPTQ or RTN, written as a
Hugging Face checkpoint directory in the AutoGPTQ layout.

**Calibration pass (GPTQ).** The model runs layer by layer over the calibration
tokens, in float32, through the dense forward of :mod:`tandem.quantize.dense`
(:func:`~tandem.quantize.dense.run_layer`, whose hook quantizes). Each decoder layer's linears are
quantized in the order the layer uses them ("true sequential", as the GPTQ
reference code does for Llama): q/k/v (one Hessian of their shared input), then
o_proj on the attention output computed with the quantized q/k/v, then gate/up
(shared input), then down_proj; and layer ``i + 1`` sees the output of the
quantized layers ``0..i`` (Frantar et al. 2022, Sec. 4, "the inputs of each
block are produced by the already quantized blocks before it").

**Hessian token weights (a deviation from the paper).** By default the q/k/v
Hessian counts each segment's first token (the attention sink) ``sink_weight``
times, and the down_proj Hessian weights each token by the inverse mean square of
the residual stream it writes into; ``uniform_hessian=True`` restores the paper's
``2 X X^T``. Why, and what it does to perplexity: :func:`hessian_token_weights`.

**Output.** ``model.safetensors`` holds, for every q/k/v/o/gate/up/down
projection, ``qweight``, ``qzeros``, ``scales`` and ``g_idx``
(:mod:`~tandem.engine.quantization.packing`), and every other tensor (embeddings,
norms, an untied ``lm_head``) dense in float16; ``config.json`` carries
``quantization_config`` (``quant_method: gptq``), ``quantize_config.json`` the same
for AutoGPTQ; the tokenizer comes along
(:func:`~tandem.quantize.dense.write_checkpoint`). RTN writes the same layout: it is
GPTQ's format without the error feedback.

**Mixture of experts.** RTN needs no forward, so it quantizes Mixtral, Qwen2-MoE
and Qwen3-MoE checkpoints: every expert's gate/up/down projection
(``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``, ``mlp.experts.{e}.gate_proj``
/ ``up_proj`` / ``down_proj``, and Qwen2-MoE's ``mlp.shared_expert.*_proj``) gets its
own ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, as the engine's GPTQ experts
load them; the routers (and Qwen2-MoE's ``shared_expert_gate``) stay float16. GPTQ
quantizes the experts of all three the same way, each from the Hessian of the
calibration tokens routed to it (the forward's MoE block routes as the engine does,
the router dense; true sequential per expert: gate/up, then down on the quantized
gate/up's output; every routed token counts once), and Qwen2-MoE's shared expert
from every token's (its attention biases are in the forward, and stay float). An
expert no calibration token reached has no Hessian: it is rounded to nearest, and
:attr:`QuantizeResult.rtn_experts` lists it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from tandem.engine.config import ModelConfig
from tandem.engine.quantization.packing import QuantizedWeight, pack_factor
from tandem.kernels.reference import rope_cos_sin_cache
from tandem.quantize.dense import (GROUPS, LINEAR_NAMES, GroupHook, calibration_segments,
                                   check_output, data_path, decoder_linears, expert_groups,
                                   layer_linear_module, layer_weights, load_dense,
                                   progress_bar, quantized_state, run_layer, write_checkpoint)
from tandem.quantize.gptq import HessianAccumulator, gptq_quantize
from tandem.quantize.rtn import check_group_size, quantize_rtn

logger = logging.getLogger(__name__)

METHODS = ("gptq", "rtn")

# The linears of one decoder layer (module names under ``model.layers.{i}``), in the
# groups that share an input, in the order the layer uses them.
LINEAR_GROUPS: dict[str, tuple[str, ...]] = {
    group: tuple(LINEAR_NAMES[short] for short in shorts) for group, shorts in GROUPS.items()}


@dataclass
class QuantizeResult:
    """What :func:`quantize_model` wrote.

    Attributes:
        output: the checkpoint directory.
        quantized: module name (``model.layers.3.self_attn.q_proj``) -> its
            :class:`~tandem.engine.quantization.packing.QuantizedWeight`.
        quantization_config: the ``quantization_config`` written to config.json.
        num_calibration_tokens: calibration tokens used (0 for RTN).
        losses: GPTQ only: module name -> GPTQ's objective estimate (see
            :func:`~tandem.quantize.gptq.gptq_quantize`).
        rtn_experts: GPTQ of a mixture-of-experts model: the expert projections no
            calibration token was routed to, rounded to nearest instead.
    """

    output: str
    quantized: dict[str, QuantizedWeight]
    quantization_config: dict
    num_calibration_tokens: int = 0
    losses: dict[str, float] = field(default_factory=dict)
    rtn_experts: list[str] = field(default_factory=list)


# -- the layer-by-layer pass ----------------------------------------------------------------------
@torch.inference_mode()
def sequential_forward(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                       segments: Iterable[torch.Tensor],
                       on_group: Callable[[int, str, list[torch.Tensor], dict[str, torch.Tensor],
                                           list[torch.Tensor] | None],
                                          dict[str, torch.Tensor] | None],
                       num_layers: int | None = None, progress: bool = False
                       ) -> list[torch.Tensor]:
    """Run the decoder layer by layer over all segments, calling ``on_group`` with
    the inputs of each group of linears before that group is used.

    Args:
        cfg: the model's config; tensors: its float32 weights (Hugging Face names).
        segments: int64 token ids ``[T_s]``, each its own sequence (positions from 0).
        on_group: ``(layer, group, inputs, weights, residual)``: ``layer`` the layer
            index, the rest as :data:`~tandem.quantize.dense.GroupHook` (``group`` a
            key of :data:`LINEAR_GROUPS` or, in an MoE layer,
            of :func:`~tandem.quantize.dense.expert_groups`; ``inputs`` float32 ``[T_s, K]`` per segment,
            ``weights`` the layer's current weights by short name, ``residual``
            ``[T_s, H]`` per segment for ``o`` and ``down``); returns replacement
            weights by short name (for instance the dequantized ones), or None.
        num_layers: stop after this many layers (None: all).
        progress: show a progress bar (tqdm) over layers.

    Returns:
        The hidden states ``[T_s, H]`` after the last layer run (before the final norm).
    """
    num_layers = cfg.num_layers if num_layers is None else num_layers
    segments = list(segments)
    cos_sin = rope_cos_sin_cache(cfg.head_dim, max(len(s) for s in segments), cfg.rope_theta)
    embed = tensors["model.embed_tokens.weight"]
    hs = [embed[ids] for ids in segments]
    for i in progress_bar(range(num_layers), progress, "layers"):
        hook: GroupHook = (lambda group, inputs, weights, residual, i=i:
                           on_group(i, group, inputs, weights, residual))
        hs = [a.out for a in run_layer(cfg, layer_weights(tensors, i, cfg), hs, cos_sin, hook)]
    return hs


def capture_inputs(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                   segments: Iterable[torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The dense model's inputs to each linear group of decoder layer ``layer``.

    Returns:
        group (a key of :data:`LINEAR_GROUPS`) -> float32 ``[sum T_s, K]``.
    """
    captured: dict[str, torch.Tensor] = {}

    def record(i, group, inputs, weights, residual):
        if i == layer:
            captured[group] = torch.cat(inputs)
        return None

    sequential_forward(cfg, tensors, segments, record, num_layers=layer + 1)
    return captured


# -- quantizing ---------------------------------------------------------------------------------
SINK_WEIGHT = 64.0
"""Default weight of each segment's first token in the q/k/v Hessian (see
:func:`hessian_token_weights`)."""


def hessian_token_weights(group: str, inputs: list[torch.Tensor], weights: dict[str, torch.Tensor],
                          residual: list[torch.Tensor] | None, sink_weight: float = SINK_WEIGHT
                          ) -> list[torch.Tensor | None]:
    """How many times each calibration token counts in a group's Hessian
    ``H = 2 sum_t c_t x_t x_t^T / sum_t c_t`` (:class:`~tandem.quantize.gptq.HessianAccumulator`).

    The paper counts every token once (``c_t = 1``), so that GPTQ minimises each
    linear's output error summed over tokens. Two kinds of token break that
    proxy on a small calibration set (a few segments), and both are position 0 of
    a segment in the default model:

    - **the attention sink** (Xiao et al. 2023, "Efficient Streaming Language
      Models with Attention Sinks"): most queries of most heads attend to the first
      token, so its key and value enter nearly every attention output, yet it is
      one token in ``segment_len`` of the q/k/v Hessian. ``qkv``: the first token
      of each segment counts ``sink_weight`` times.
    - **massive activations** (Sun et al. 2024, "Massive Activations in Large
      Language Models"): in some layers the first token reaches down_proj with an
      input norm hundreds of times the median, dominating ``H``; GPTQ then trades
      a tiny error on that token for a larger error on every other one. But the
      token's residual stream is just as large, and the next RMSNorm divides it by
      its RMS, so an error there matters in proportion to ``1 / rms``. ``down``:
      ``c_t = 1 / mean(r_t**2)``, ``r_t`` the residual stream after the layer's output
      is added (dense weights).

    ``o`` and ``gate_up`` count every token once. On the default model (held-out
    perplexity, int4 g128, benchmarks/README.md) this takes GPTQ from worse than
    round-to-nearest to well ahead of it.

    Args:
        group: a key of :data:`LINEAR_GROUPS`.
        inputs: the group's inputs ``[T_s, K]`` per segment.
        weights: the layer's current weights by short name (``down``: ``down``'s is used).
        residual: ``down``: the residual stream ``[T_s, H]`` per segment before the
            group's output is added.
        sink_weight: the first token's count in the ``qkv`` Hessian.

    Returns:
        float32 ``[T_s]`` per segment, or None where every token counts once.
    """
    if group == "qkv":
        out = []
        for x in inputs:
            c = torch.ones(x.shape[0])
            c[0] = sink_weight
            out.append(c)
        return out
    if group == "down":
        w = weights["down"]
        return [1.0 / (r + F.linear(x, w)).pow(2).mean(-1) for x, r in zip(inputs, residual)]
    return [None] * len(inputs)


def quantize_model(model: str | None, output: str, method: str = "gptq", *, bits: int = 4,
                   group_size: int = 128, desc_act: bool = False, damp: float = 0.01,
                   calibration_file: str | None = None,
                   num_calibration_tokens: int | None = None, segment_len: int = 512,
                   block_size: int = 128, uniform_hessian: bool = False,
                   sink_weight: float = SINK_WEIGHT, progress: bool = False) -> QuantizeResult:
    """Quantize every decoder linear of ``model`` and write the checkpoint to ``output``.

    Args:
        model: None (the default model), a .gguf file or a dense checkpoint directory.
        output: the directory to write; it must not exist or be empty. Written in a
            temporary directory beside it and renamed into place when complete.
        method: ``gptq`` or ``rtn``.
        bits: bits per weight (2, 4 or 8).
        group_size: input columns per group (-1: one group per row).
        desc_act: GPTQ act-order (columns by decreasing ``diag(H)``).
        damp: GPTQ dampening, a fraction of the mean of ``diag(H)``.
        calibration_file: a text file (default: the shipped ``data/calibration.txt``).
        num_calibration_tokens: use only the first this many calibration tokens.
        segment_len: tokens per calibration sequence.
        block_size: GPTQ's lazy-batch width in columns.
        uniform_hessian: count every calibration token once in every Hessian (the
            paper's ``2 X X^T``) instead of :func:`hessian_token_weights`.
        sink_weight: see :func:`hessian_token_weights`.
        progress: show progress bars (tqdm).

    Returns:
        The :class:`QuantizeResult`.

    Raises:
        ValueError: (naming the argument) unknown ``method``; ``desc_act`` with
            ``rtn``; bad ``bits``, ``group_size``, ``damp``, token counts;
            a non-empty ``output``; an already quantized ``model``.
        UnsupportedModelError: an architecture the method does not quantize (GPTQ: a
            mixture-of-experts model other than Mixtral, Qwen2-MoE and Qwen3-MoE,
            naming the method and the architecture).
        FileNotFoundError: ``model`` or ``calibration_file`` does not exist.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if desc_act and method != "gptq":
        raise ValueError("desc_act: act-order needs calibration activations (method gptq)")
    pack_factor(bits)
    if not damp >= 0:
        raise ValueError(f"damp: must be >= 0, got {damp!r}")
    if not sink_weight > 0:
        raise ValueError(f"sink_weight: must be > 0, got {sink_weight!r}")
    check_output(output)
    # RTN needs no forward: it also quantizes Qwen2/3-MoE experts; GPTQ's forward has
    # Mixtral's MoE block
    dense = load_dense(model, forward=method == "gptq", who=f"tandem quantize --method {method}",
                       moe=True)
    cfg, tensors = dense.cfg, dense.weights
    modules = decoder_linears(cfg)
    for width in sorted({tensors[m + ".weight"].shape[1] for m in modules}):
        check_group_size(group_size, width, bits)

    from tandem.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(dense.files)
    quantized: dict[str, QuantizedWeight] = {}
    losses: dict[str, float] = {}
    rtn_experts: list[str] = []
    n_tokens = 0
    if method == "rtn":
        for module in progress_bar(modules, progress, "linears"):
            quantized[module] = quantize_rtn(tensors[module + ".weight"], bits, group_size)
    else:
        path = calibration_file or data_path("calibration.txt")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        segments = calibration_segments(tokenizer, text, segment_len, num_calibration_tokens)
        n_tokens = sum(len(s) for s in segments)

        experts = (expert_groups(cfg.moe.num_experts, bool(cfg.moe.shared_expert_intermediate_size))
                   if cfg.moe is not None else {})

        def quantize_group(i, group, inputs, weights, residual):
            shorts = GROUPS.get(group) or experts[group]
            # Rows are independent under one Hessian: the group's linears go
            # through GPTQ stacked, in one pass over the columns.
            stacked = torch.cat([weights[short] for short in shorts])
            sizes = [weights[short].shape[0] for short in shorts]
            modules = [layer_linear_module(cfg, i, short) for short in shorts]
            if group in experts and sum(x.shape[0] for x in inputs) == 0:
                # No calibration token reached this expert: no Hessian to work with.
                q, row_losses = quantize_rtn(stacked, bits, group_size), None
                rtn_experts.extend(modules)
            else:
                acc = HessianAccumulator(inputs[0].shape[-1])
                counts = ([None] * len(inputs) if uniform_hessian or group in experts else
                          hessian_token_weights(group, inputs, weights, residual, sink_weight))
                for x, c in zip(inputs, counts):
                    acc.add(x, c)
                q, row_losses = gptq_quantize(stacked, acc.result(), bits, group_size, damp,
                                              desc_act, block_size)
            new = {}
            for k, (short, module, part) in enumerate(zip(shorts, modules, q.split_rows(sizes))):
                quantized[module] = part
                if row_losses is not None:
                    losses[module] = float(row_losses.split(sizes)[k].sum())
                new[short] = part.dequantize()
            return new

        sequential_forward(cfg, tensors, segments, quantize_group, progress=progress)

    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
               "desc_act": bool(desc_act), "sym": False, "damp_percent": damp,
               "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
               "meta": {"quantizer": "tandem-serve", "method": method,
                        "calibration_tokens": n_tokens,
                        "hessian_token_weights": (None if method != "gptq" else "uniform"
                                                  if uniform_hessian else
                                                  f"sink {sink_weight:g}, down 1/ms(residual)"),
                        "calibration_file": (os.path.basename(calibration_file or "calibration.txt")
                                             if method == "gptq" else None)}}
    if rtn_experts:
        qconfig["meta"]["rtn_experts"] = len(rtn_experts)
    quantize_config = {k: qconfig[k] for k in
                       ("bits", "group_size", "damp_percent", "desc_act", "static_groups", "sym",
                        "true_sequential", "quant_method", "checkpoint_format")}
    quantize_config |= {"model_name_or_path": None, "model_file_base_name": "model"}
    state = quantized_state(tensors, lambda module, w: (quantized[module].pack()
                                                        if module in quantized else None))
    write_checkpoint(output, dense, state, qconfig, tokenizer,
                     {"quantize_config.json": quantize_config})
    return QuantizeResult(output, quantized, qconfig, n_tokens, losses, rtn_experts)
