"""``tandem quantize``: a model's linear layers to int GPTQ or RTN, written as a
Hugging Face checkpoint directory in the AutoGPTQ layout.

**Calibration pass (GPTQ).** The model runs layer by layer over the calibration
tokens, in float32, as a plain torch Llama forward over the checkpoint's dense
weights (RMSNorm, half-split RoPE, causal GQA attention, SwiGLU: the pure-torch
references of :mod:`tandem.kernels.reference`). Each decoder layer's linears are
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
for AutoGPTQ; the tokenizer files come along (for a GGUF source, the tokenizer
Tandem builds from the file, saved with ``save_pretrained``). RTN writes the same
layout: it is GPTQ's format without the error feedback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from tandem.engine.config import ModelConfig
from tandem.engine.model.model_files import ModelFiles, resolve_model
from tandem.engine.quantization.checkpoint import checkpoint_quantization_config
from tandem.engine.quantization.gptq import HessianAccumulator, gptq_quantize
from tandem.engine.quantization.packing import QuantizedWeight, pack_factor
from tandem.engine.quantization.rtn import check_group_size, quantize_rtn
from tandem.kernels.attention_backend import default_scale
from tandem.kernels.reference import (rms_norm_ref, rope_cos_sin_cache, rotary_embedding_ref,
                                      silu_and_mul_ref)

logger = logging.getLogger(__name__)

METHODS = ("gptq", "rtn")

# The linears of one decoder layer, in the groups that share an input, in the
# order the layer uses them.
LINEAR_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
QUANTIZED_LINEARS = tuple(name for names in LINEAR_GROUPS.values() for name in names)

# Tokenizer and generation files copied from a Hugging Face source directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def data_path(name: str) -> str:
    """Path of a text file shipped in ``tandem.engine.quantization/data``
    (``calibration.txt``, ``heldout.txt``)."""
    return str(resources.files("tandem.engine.quantization").joinpath("data", name))


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
            :func:`~tandem.engine.quantization.gptq.gptq_quantize`).
    """

    output: str
    quantized: dict[str, QuantizedWeight]
    quantization_config: dict
    num_calibration_tokens: int = 0
    losses: dict[str, float] = field(default_factory=dict)


def load_dense(model: str | None) -> tuple[ModelFiles, ModelConfig, dict[str, torch.Tensor]]:
    """A dense model's files, config and float32 tensors under Hugging Face names
    (a GGUF file's dequantized).

    Raises:
        FileNotFoundError: nothing loadable at ``model``.
        ValueError: (naming ``model``) the checkpoint is already quantized; not a
            Llama-family model.
    """
    from tandem.engine.model.loader import gguf_checkpoint
    from tandem.engine.model.weights import iter_safetensors

    files = resolve_model(model)
    if files.format == "gguf":
        cfg, tensors = gguf_checkpoint(files)
    else:
        if checkpoint_quantization_config(files) is not None:
            raise ValueError(f"model: {files.path} is already quantized (its config.json has a "
                             "quantization_config); quantize a dense checkpoint")
        cfg = ModelConfig.from_hf_config(files.path)
        cfg.check_plain_llama("tandem quantize")   # its dense forward is Llama's
        tensors = iter_safetensors(files.path)
    dense = {name: t.to(torch.float32) for name, t in tensors
             if not name.endswith("rotary_emb.inv_freq")}
    return files, cfg, dense


def calibration_segments(tokenizer, text: str, segment_len: int = 512,
                         max_tokens: int | None = None) -> list[torch.Tensor]:
    """Calibration text -> consecutive token segments.

    Args:
        tokenizer: a :class:`~tandem.engine.text.tokenizer.Tokenizer` (or anything
            with ``encode(text, add_special_tokens=False)``).
        text: the calibration text (tokenized whole, without special tokens).
        segment_len: tokens per segment (the last one may be shorter).
        max_tokens: keep only the first this many tokens (None: all).

    Returns:
        int64 tensors ``[T_s]``, ``sum T_s`` = the tokens kept.

    Raises:
        ValueError: ``segment_len`` or ``max_tokens`` < 1, or the text has no tokens.
    """
    if segment_len < 1:
        raise ValueError(f"segment_len: must be >= 1, got {segment_len}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"num_calibration_tokens: must be >= 1, got {max_tokens}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise ValueError("calibration_file: the calibration text has no tokens")
    t = torch.tensor(ids, dtype=torch.int64)
    return list(t.split(segment_len))


# -- the plain torch forward over dense weights -------------------------------------------------
def _linear_weight(tensors: dict[str, torch.Tensor], layer: int, name: str) -> torch.Tensor:
    return tensors[f"model.layers.{layer}.{name}.weight"]


def _attention(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor,
               cos_sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one segment before o_proj: ``x`` ``[T, H]`` -> ``[T, Hq * D]``."""
    t = x.shape[0]
    q = F.linear(x, w["self_attn.q_proj"]).reshape(t, cfg.num_heads, cfg.head_dim)
    k = F.linear(x, w["self_attn.k_proj"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = F.linear(x, w["self_attn.v_proj"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    rotary_embedding_ref(torch.arange(t), q, k, cos_sin)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True,
                                       scale=default_scale(cfg.head_dim))
    return o[0].transpose(0, 1).reshape(t, cfg.num_heads * cfg.head_dim)


# on_group(layer, group, inputs, weights, residual) -> new dense weights for some
# of the group's linears (or None): the hook where quantization happens.
GroupHook = Callable[[int, str, list[torch.Tensor], dict[str, torch.Tensor],
                      "list[torch.Tensor] | None"], "dict[str, torch.Tensor] | None"]


@torch.inference_mode()
def sequential_forward(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                       segments: Iterable[torch.Tensor], on_group: GroupHook,
                       num_layers: int | None = None, progress: bool = False
                       ) -> list[torch.Tensor]:
    """Run the decoder layer by layer over all segments, calling ``on_group`` with
    the inputs of each group of linears before that group is used.

    Args:
        cfg: the model's config; tensors: its float32 weights (Hugging Face names).
        segments: int64 token ids ``[T_s]``, each its own sequence (positions from 0).
        on_group: ``(layer, group, inputs, weights, residual)`` with ``group`` a key
            of :data:`LINEAR_GROUPS`, ``inputs`` the group's float32 inputs
            ``[T_s, K]`` per segment, ``weights`` the layer's current weights by short
            name (``self_attn.q_proj``), ``residual`` (``o`` and ``down``, which
            write into the residual stream; None for the others) the residual stream
            ``[T_s, H]`` per segment that the group's output is added to; returns
            replacement weights (for instance the dequantized ones), used from then
            on, or None.
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
    eps = cfg.rms_norm_eps
    for i in _progress(range(num_layers), progress, "layers"):
        w = {name: _linear_weight(tensors, i, name) for name in QUANTIZED_LINEARS}
        norm_in = tensors[f"model.layers.{i}.input_layernorm.weight"]
        norm_post = tensors[f"model.layers.{i}.post_attention_layernorm.weight"]

        def run(group: str, inputs: list[torch.Tensor], residual=None) -> None:
            new = on_group(i, group, inputs, w, residual)
            if new:
                w.update(new)

        xs = [rms_norm_ref(h, norm_in, eps) for h in hs]
        run("qkv", xs)
        attn = [_attention(cfg, w, x, cos_sin) for x in xs]
        run("o", attn, hs)
        hs = [h + F.linear(a, w["self_attn.o_proj"]) for h, a in zip(hs, attn)]
        xs = [rms_norm_ref(h, norm_post, eps) for h in hs]
        run("gate_up", xs)
        ms = [silu_and_mul_ref(torch.cat([F.linear(x, w["mlp.gate_proj"]),
                                          F.linear(x, w["mlp.up_proj"])], dim=-1)) for x in xs]
        run("down", ms, hs)
        hs = [h + F.linear(m, w["mlp.down_proj"]) for h, m in zip(hs, ms)]
    return hs


def final_logits(cfg: ModelConfig, tensors: dict[str, torch.Tensor], hidden: torch.Tensor
                 ) -> torch.Tensor:
    """float32 logits ``[T, V]`` from the last layer's hidden states ``[T, H]``."""
    h = rms_norm_ref(hidden, tensors["model.norm.weight"], cfg.rms_norm_eps)
    head = tensors["model.embed_tokens.weight"] if cfg.tie_word_embeddings else tensors["lm_head.weight"]
    return F.linear(h, head)


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
    ``H = 2 sum_t c_t x_t x_t^T / sum_t c_t`` (:class:`~tandem.engine.quantization.gptq.HessianAccumulator`).

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
        weights: the layer's current weights (``down``: ``mlp.down_proj``'s is used).
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
        w = weights["mlp.down_proj"]
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
    if (os.path.isdir(output) and os.listdir(output)) or \
            (os.path.exists(output) and not os.path.isdir(output)):
        raise ValueError(f"output: {output} exists and is not an empty directory")
    files, cfg, tensors = load_dense(model)
    for name in QUANTIZED_LINEARS:       # every layer has the same shapes
        check_group_size(group_size, _linear_weight(tensors, 0, name).shape[1], bits)

    from tandem.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(files)
    quantized: dict[str, QuantizedWeight] = {}
    losses: dict[str, float] = {}
    n_tokens = 0
    if method == "rtn":
        names = [f"model.layers.{i}.{name}" for i in range(cfg.num_layers) for name in QUANTIZED_LINEARS]
        for module in _progress(names, progress, "linears"):
            quantized[module] = quantize_rtn(tensors[module + ".weight"], bits, group_size)
    else:
        path = calibration_file or data_path("calibration.txt")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        segments = calibration_segments(tokenizer, text, segment_len, num_calibration_tokens)
        n_tokens = sum(len(s) for s in segments)

        def quantize_group(i, group, inputs, weights, residual):
            acc = HessianAccumulator(inputs[0].shape[-1])
            counts = ([None] * len(inputs) if uniform_hessian else
                      hessian_token_weights(group, inputs, weights, residual, sink_weight))
            for x, c in zip(inputs, counts):
                acc.add(x, c)
            hessian = acc.result()
            names = LINEAR_GROUPS[group]
            # Rows are independent under one Hessian: the group's linears go
            # through GPTQ stacked, in one pass over the columns.
            stacked = torch.cat([weights[name] for name in names])
            q, row_losses = gptq_quantize(stacked, hessian, bits, group_size, damp, desc_act,
                                          block_size)
            sizes = [weights[name].shape[0] for name in names]
            new = {}
            for name, part, loss in zip(names, q.split_rows(sizes), row_losses.split(sizes)):
                module = f"model.layers.{i}.{name}"
                quantized[module], losses[module] = part, float(loss.sum())
                new[name] = part.dequantize()
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
    write_checkpoint(output, files, cfg, tensors, quantized, qconfig, tokenizer)
    return QuantizeResult(output, quantized, qconfig, n_tokens, losses)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face ``LlamaForCausalLM`` config.json for ``cfg`` (what
    :meth:`ModelConfig.from_hf_config` reads back to the same config)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_model_len,
            "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}


def write_checkpoint(output: str, files: ModelFiles, cfg: ModelConfig,
                     tensors: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight],
                     quantization_config: dict, tokenizer) -> None:
    """Write the checkpoint directory (layout in the module docstring).

    Args:
        files: the source model (its config.json and tokenizer files are copied for
            a Hugging Face source).
        tensors: the source's dense tensors; the ``.weight`` of each module in
            ``quantized`` is replaced by its packed tensors, the rest are stored in float16.
        quantized: module name -> :class:`QuantizedWeight`.
        tokenizer: the source's :class:`~tandem.engine.text.tokenizer.Tokenizer`
            (saved for a GGUF source).
    """
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.rpartition(".")[0]
        if module in quantized or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        state[name] = t.to(torch.float16).contiguous()
    for module, q in quantized.items():
        for leaf, t in q.pack().items():
            state[f"{module}.{leaf}"] = t

    if files.format == "hf":
        with open(os.path.join(files.path, "config.json")) as f:
            config = json.load(f)
    else:
        config = hf_config_dict(cfg)
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "float16"
    if "dtype" in config:
        config["dtype"] = "float16"
    quantize_config = {k: quantization_config[k] for k in
                       ("bits", "group_size", "damp_percent", "desc_act", "static_groups", "sym",
                        "true_sequential", "quant_method", "checkpoint_format")}
    quantize_config |= {"model_name_or_path": None, "model_file_base_name": "model"}

    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output)}.tmp-")
    try:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "quantize_config.json"), "w") as f:
            json.dump(quantize_config, f, indent=2, sort_keys=True)
        if files.format == "hf":
            for name in _TOKENIZER_FILES:
                src = os.path.join(files.path, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(tmp, name))
        else:
            tokenizer.hf_tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)      # mkdtemp made it private
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.isdir(output):
            os.rmdir(output)            # empty (checked by the caller)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _progress(items, enabled: bool, unit: str):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:     # tqdm comes with transformers; a bare install still works
        return items
    return tqdm(items, unit=unit, desc="quantize")
