"""The dense model every offline quantizer starts from: one loader, one float32
forward, one ``config.json`` builder and one checkpoint writer, shared by GPTQ / RTN
(:mod:`~tandem.quantize.autogptq`) and AWQ (:mod:`~tandem.quantize.awq`).

**Loading** reads through the engine's own readers (a GGUF file dequantized by
:func:`~tandem.engine.model.loader.gguf_checkpoint`, a Hugging Face directory by
:func:`~tandem.engine.model.weights.iter_safetensors`), so the architecture is the
one the engine's model registry resolves (:attr:`ModelConfig.architecture`) and
the tensors carry Hugging Face names whatever the source format.

**The forward** is the plain torch decoder of a Llama-layout model (RMSNorm,
half-split RoPE, causal grouped-query attention, SwiGLU; the pure-torch references of
:mod:`tandem.kernels.reference`), in float32. It is the only one: a quantizer that
needs a layer's activations runs :func:`run_layer` with a hook, rather than a
forward of its own. A model whose registered architecture computes anything else
(biases, Q/K norms, sliding windows, RoPE scaling) is refused at load with
:meth:`ModelConfig.check_plain_llama` instead of being calibrated wrongly; serving
such a model in quantized form means extending this one forward (and
:data:`LINEAR_NAMES`), not copying the loader.

**Mixture of experts.** A quantizer that needs no forward (RTN) loads with
``forward=False``: then Mixtral, Qwen2-MoE and Qwen3-MoE are accepted too
(:data:`WEIGHTS_ONLY_MOE`), and :func:`expert_linear` names each expert's
projections (``block_sparse_moe.experts.{e}.w1``, ``mlp.experts.{e}.gate_proj``, ...;
transformers 5's stacked ``experts.gate_up_proj`` / ``experts.down_proj`` are split
into those per-expert names at load, as the engine's loader reads them; Qwen2-MoE's
shared expert is quantized like a dense MLP). The routers (``gate``,
``shared_expert_gate``) stay dense. A calibrated method that runs the forward through MoE
layers (GPTQ and AWQ, ``moe=True``) accepts Mixtral, Qwen2-MoE and Qwen3-MoE
(:data:`FORWARD_MOE`: Llama attention, with Qwen2-MoE's q/k/v biases and Qwen3's
per-head Q/K RMSNorm before RoPE): :func:`run_layer` then routes each token as the
engine does (float32 softmax over the router logits, top-k, renormalised where the
model does) and calls the hook once per expert, with the tokens routed to it, then
for Qwen2-MoE's shared expert with every token (:func:`expert_groups`); AWQ runs the
block itself with trial weights (:func:`moe_block`).

A decoder layer's tensors go by short names (:data:`LINEAR_NAMES`,
:data:`NORM_NAMES`: ``q`` .. ``down``, ``ln1``, ``ln2``) in every quantizer.

Shapes: ``B`` sequences of ``S`` tokens, ``H`` hidden size, ``Hq`` / ``Hkv`` query
and KV heads, ``D`` head dim, ``F`` FFN width, ``V`` vocab size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from tandem.engine.config import ModelConfig
from tandem.engine.model.model_files import ModelFiles
from tandem.engine.model.weights import WeightLoadError
from tandem.kernels.attention_backend import default_scale
from tandem.kernels.reference import rms_norm_ref

# Short name -> the Hugging Face module under ``model.layers.{i}``.
LINEAR_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}
NORM_NAMES = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
# The linears of one decoder layer in the groups that share an input, in the order
# the layer uses them (the order of :func:`run_layer`'s hook calls).
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",),
                                      "gate_up": ("gate", "up"), "down": ("down",)}
# Architectures whose experts a weights-only quantizer (RTN) quantizes (``forward=False``).
WEIGHTS_ONLY_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Mixture-of-experts architectures :func:`run_layer` computes (Llama attention and a
# top-k SwiGLU MoE block): what a calibrated quantizer with ``moe=True`` accepts.
FORWARD_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Tokenizer and generation files copied from a Hugging Face source directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def data_path(name: str) -> str:
    """Path of a text file in ``tandem.quantize``'s package data ``data/``
    (``calibration.txt``, ``heldout.txt``). Found beside this file: ``importlib.resources``
    cannot read the editable install's ``__path__`` of a namespace portion."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", name)


# -- loading --------------------------------------------------------------------------------
class DenseModel(NamedTuple):
    """A dense model as the quantizers read it.

    Attributes:
        files: the resolved source (:class:`~tandem.engine.model.model_files.ModelFiles`).
        cfg: its :class:`~tandem.engine.config.ModelConfig`.
        weights: Hugging Face name -> float32 tensor (a GGUF file's dequantized; a
            tied ``lm_head.weight`` is left out: the embedding stands for it).
    """

    files: ModelFiles
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]


def load_dense(model: str | None, forward: bool = True,
               who: str = "tandem quantize", moe: bool = False) -> DenseModel:
    """A dense model's files, config and float32 tensors.

    Args:
        model: None (the default model), a .gguf file or a Hugging Face checkpoint
            directory.
        forward: the caller runs :func:`run_layer` on it (calibration): the model
            must be numerically a plain Llama. False (weights only, RTN): Mixtral and
            Qwen3-MoE Hugging Face checkpoints are accepted too (:data:`WEIGHTS_ONLY_MOE`).
        who: the method, as errors name it (``tandem quantize --method gptq``).
        moe: with ``forward``, accept the mixture-of-experts models whose MoE block
            :func:`run_layer` computes (:data:`FORWARD_MOE`).

    Raises:
        FileNotFoundError: nothing loadable at ``model``.
        ValueError: (naming ``model``) the checkpoint is already quantized; a
            mixture-of-experts GGUF file (its config.json would have to be rebuilt
            from the file's metadata: requantize it to a GGUF type instead).
        UnsupportedModelError: the architecture (or a feature of it) is not what the
            dense forward computes (:meth:`ModelConfig.check_plain_llama`); with
            ``forward``, a mixture-of-experts model (field ``architectures``, naming
            ``who`` and the architecture); without, an MoE architecture not in
            :data:`WEIGHTS_ONLY_MOE`.
        WeightLoadError: a tensor the forward (or the writer) needs is missing.
    """
    from tandem.engine.model.loader import gguf_checkpoint
    from tandem.engine.model.model_files import resolve_model
    from tandem.engine.model.registry import UnsupportedModelError
    from tandem.engine.model.weights import iter_safetensors
    from tandem.engine.quantization.checkpoint import checkpoint_quantization_config

    files = resolve_model(model)
    if files.format == "gguf":
        cfg, tensors = gguf_checkpoint(files)
    else:
        if checkpoint_quantization_config(files) is not None:
            raise ValueError(f"model: {files.path} is already quantized (its config.json has a "
                             "quantization_config); quantize a dense checkpoint")
        cfg = ModelConfig.from_hf_config(files.path)
        tensors = iter_safetensors(files.path)
    if cfg.moe is not None:
        if forward and not (moe and cfg.architecture in FORWARD_MOE):
            raise UnsupportedModelError(
                "architectures", f"{who} cannot quantize {cfg.architecture}: its calibration "
                "runs a forward with " + ("the mixture-of-experts block of "
                                          f"{', '.join(FORWARD_MOE)} only" if moe else
                                          "no mixture-of-experts block")
                + " (use --method rtn, or a GGUF type on a .gguf file)")
        if forward:      # run_layer adds q/k/v biases (Qwen2-MoE); nothing else
            cfg.check_plain_attention(who, allow_bias=True)
        elif cfg.architecture not in WEIGHTS_ONLY_MOE:
            raise UnsupportedModelError(
                "architectures", f"{who} quantizes the experts of "
                f"{', '.join(WEIGHTS_ONLY_MOE)} only, not {cfg.architecture}")
        if files.format == "gguf":
            raise ValueError(f"model: {files.path} is a mixture-of-experts GGUF file; {who} "
                             "writes Hugging Face checkpoints of such models from their "
                             "Hugging Face directory (a GGUF type rewrites the file)")
    else:
        cfg.check_plain_llama(who)
    weights = {name: t.to(torch.float32).contiguous() for name, t in tensors
               if not name.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if cfg.moe is not None:
        _split_stacked_experts(cfg, weights)
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"{m}.weight" for m in decoder_linears(cfg)] + [
        f"model.layers.{i}.{v}.weight" for i in range(cfg.num_layers)
        for v in NORM_NAMES.values()]
    if not cfg.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in weights]
    if missing:
        raise WeightLoadError(f"checkpoint lacks {missing[:4]}"
                              + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
    return DenseModel(files, cfg, weights)


def _moe_names(cfg: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """``(block, (gate, up, down))``: the checkpoint's name of the MoE block and of
    each expert's gate, up and down projections (Mixtral: ``block_sparse_moe``,
    ``w1``, ``w3``, ``w2``), as the engine's model class maps them."""
    from tandem.engine.model.registry import MODEL_REGISTRY

    cls = MODEL_REGISTRY.model_class(cfg.architecture)
    by_role = {v: k for k, v in cls.expert_projections.items()}
    return cls.checkpoint_block, (by_role[("gate_up_proj", 0)], by_role[("gate_up_proj", 1)],
                                  by_role[("down_proj", 0)])


def decoder_linears(cfg: ModelConfig) -> list[str]:
    """Module names of every linear a quantizer replaces, layer by layer: q/k/v/o,
    then a dense layer's gate/up/down or a sparse layer's experts' (expert by expert,
    gate, up, down; then Qwen2-MoE's shared expert's gate, up, down; the router and
    the shared expert's gate are not among them)."""
    out = []
    moe = cfg.moe
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out += [f"{p}.{LINEAR_NAMES[k]}" for k in ("q", "k", "v", "o")]
        if moe is not None and moe.sparse_layers[i]:
            block, projs = _moe_names(cfg)
            out += [f"{p}.{block}.experts.{e}.{proj}" for e in range(moe.num_experts)
                    for proj in projs]
            if moe.shared_expert_intermediate_size:
                out += [f"{p}.{block}.shared_expert.{proj}"
                        for proj in ("gate_proj", "up_proj", "down_proj")]
        else:
            out += [f"{p}.{LINEAR_NAMES[k]}" for k in ("gate", "up", "down")]
    return out


def _split_stacked_experts(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Replace transformers 5's stacked ``{block}.experts.gate_up_proj`` ``[E, 2I, H]``
    (gate rows, then up rows) and ``{block}.experts.down_proj`` ``[E, H, I]`` in
    ``weights`` by per-expert ``{block}.experts.{e}.{proj}.weight`` tensors."""
    block, (gate, up, down) = _moe_names(cfg)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.{block}.experts"
        gate_up = weights.pop(f"{p}.gate_up_proj", None)
        if gate_up is not None:
            g, u = gate_up.chunk(2, dim=1)
            for e in range(gate_up.shape[0]):
                weights[f"{p}.{e}.{gate}.weight"] = g[e].contiguous()
                weights[f"{p}.{e}.{up}.weight"] = u[e].contiguous()
        stacked_down = weights.pop(f"{p}.down_proj", None)
        if stacked_down is not None:
            for e in range(stacked_down.shape[0]):
                weights[f"{p}.{e}.{down}.weight"] = stacked_down[e].contiguous()


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
    return list(torch.tensor(ids, dtype=torch.int64).split(segment_len))


# -- the float32 forward --------------------------------------------------------------------
def layer_weights(weights: dict[str, torch.Tensor], layer: int,
                  cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The tensors of decoder layer ``layer`` under short names (``q``, ..., ``down``:
    ``[out, in]``; ``ln1``, ``ln2``: ``[H]``): a new dict holding the same tensor
    objects as ``weights`` (Hugging Face names). A mixture-of-experts layer of
    ``cfg`` has ``router`` ``[E, H]`` and ``experts.{e}.gate`` / ``.up`` / ``.down``
    in place of ``gate``, ``up``, ``down``, and with a shared expert (Qwen2-MoE)
    ``shared_expert.gate`` / ``.up`` / ``.down`` and ``shared_expert_gate`` ``[1, H]``.
    Attention biases (Qwen2-MoE) come as ``q_bias``, ``k_bias``, ``v_bias``."""
    p = f"model.layers.{layer}"
    names = {k: v for k, v in LINEAR_NAMES.items()} | NORM_NAMES
    if f"{p}.self_attn.q_norm.weight" in weights:              # Qwen3: per-head Q/K norms
        names |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    if cfg is not None and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        names = {k: v for k, v in names.items() if k not in ("gate", "up", "down")}
        block, projs = _moe_names(cfg)
        names["router"] = f"{block}.gate"
        for e in range(cfg.moe.num_experts):
            for short, proj in zip(("gate", "up", "down"), projs):
                names[f"experts.{e}.{short}"] = f"{block}.experts.{e}.{proj}"
        if cfg.moe.shared_expert_intermediate_size:
            names |= {f"shared_expert.{short}": f"{block}.shared_expert.{short}_proj"
                      for short in ("gate", "up", "down")}
            names["shared_expert_gate"] = f"{block}.shared_expert_gate"
    out = {k: weights[f"{p}.{v}.weight"] for k, v in names.items()}
    for short in ("q", "k", "v"):
        bias = weights.get(f"{p}.{LINEAR_NAMES[short]}.bias")
        if bias is not None:
            out[f"{short}_bias"] = bias
    return out


def expert_groups(num_experts: int, shared_expert: bool = False) -> dict[str, tuple[str, ...]]:
    """The linear groups of an MoE layer's experts, in the order :func:`run_layer`
    calls them (each expert's gate/up, then its down; then the shared expert's):
    ``experts.{e}.gate_up`` -> ``(experts.{e}.gate, experts.{e}.up)``,
    ``experts.{e}.down`` -> ``(experts.{e}.down,)``, ``shared_expert.gate_up`` ->
    ``(shared_expert.gate, shared_expert.up)``, ``shared_expert.down``."""
    out: dict[str, tuple[str, ...]] = {}
    for e in [*(f"experts.{e}" for e in range(num_experts)),
              *(["shared_expert"] if shared_expert else [])]:
        out[f"{e}.gate_up"] = (f"{e}.gate", f"{e}.up")
        out[f"{e}.down"] = (f"{e}.down",)
    return out


def layer_linear_module(cfg: ModelConfig, layer: int, short: str) -> str:
    """The module name of a layer's linear given by short name (``q``, ...,
    ``experts.3.down``): ``model.layers.{layer}.self_attn.q_proj``,
    ``model.layers.{layer}.block_sparse_moe.experts.3.w2``,
    ``model.layers.{layer}.mlp.shared_expert.down_proj``, ..."""
    p = f"model.layers.{layer}"
    if short.startswith("shared_expert."):
        block, _ = _moe_names(cfg)
        return f"{p}.{block}.shared_expert.{short.split('.')[1]}_proj"
    if short.startswith("experts."):
        _, e, role = short.split(".")
        block, projs = _moe_names(cfg)
        return f"{p}.{block}.experts.{e}.{projs[('gate', 'up', 'down').index(role)]}"
    return f"{p}.{LINEAR_NAMES[short]}"


def decoder_linear(name: str) -> str | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3.mlp.up_proj`` (a
    decoder linear's weight, what the quantizers replace); None for any other tensor."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".", 3)
    if (leaf == "weight" and len(parts) == 4 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and parts[3] in LINEAR_NAMES.values()):
        return module
    return None


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def expert_linear(name: str) -> str | None:
    """``model.layers.3.mlp.experts.5.up_proj.weight`` (or Mixtral's
    ``...block_sparse_moe.experts.5.w3.weight``, or Qwen2-MoE's
    ``model.layers.3.mlp.shared_expert.up_proj.weight``) -> the expert projection's
    module name; None for any other tensor (the routers and ``shared_expert_gate``
    included)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    if leaf != "weight" or parts[:2] != ["model", "layers"] or not parts[2:3] \
            or not parts[2].isdigit():
        return None
    if (len(parts) == 7 and parts[3] in ("mlp", "block_sparse_moe") and parts[4] == "experts"
            and parts[5].isdigit() and parts[6] in _EXPERT_PROJS):
        return module
    if len(parts) == 6 and parts[3:5] == ["mlp", "shared_expert"] and parts[5] in _EXPERT_PROJS:
        return module
    return None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (Hugging Face Llama) rotation of ``[B, heads, S, D]`` by ``[S, D/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attend(cfg: ModelConfig, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
            wv: torch.Tensor, cos_sin: torch.Tensor, q_norm: torch.Tensor | None = None,
            k_norm: torch.Tensor | None = None,
            biases: tuple[torch.Tensor | None, ...] = (None, None, None)) -> torch.Tensor:
    """Causal attention of ``x`` ``[B, S, H]`` (or ``[S, H]``, one sequence) before
    ``o_proj``: ``[B, S, Hq D]`` (or ``[S, Hq D]``). ``q_norm`` / ``k_norm`` ``[D]``:
    Qwen3's RMSNorm of each head's query and key before RoPE; ``biases``: the q, k
    and v projections' (Qwen2-MoE), None where absent."""
    one = x.dim() == 2
    if one:
        x = x[None]
    b, s, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k, v = (x @ w.t() if bias is None else x @ w.t() + bias
               for w, bias in zip((wq, wk, wv), biases))
    q = q.view(b, s, hq, d).transpose(1, 2)                     # [B, Hq, S, D]
    k = k.view(b, s, hkv, d).transpose(1, 2)                    # [B, Hkv, S, D]
    v = v.view(b, s, hkv, d).transpose(1, 2)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, cfg.rms_norm_eps), rms_norm_ref(k, k_norm, cfg.rms_norm_eps)
    cos, sin = cos_sin[:s, : d // 2], cos_sin[:s, d // 2:]
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=default_scale(d),
                                       enable_gqa=hq != hkv)
    o_in = o.transpose(1, 2).reshape(b, s, hq * d)
    return o_in[0] if one else o_in


def attention_block(cfg: ModelConfig, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                    wv: torch.Tensor, wo: torch.Tensor, cos_sin: torch.Tensor,
                    lw: dict[str, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention of ``B`` sequences, as the served model computes it.

    Args:
        x: normalised hidden states ``[B, S, H]`` float32.
        wq, wk, wv, wo: ``[Hq D, H]``, ``[Hkv D, H]``, ``[Hkv D, H]``, ``[H, Hq D]``.
        cos_sin: ``[>= S, D]`` from :func:`~tandem.kernels.reference.rope_cos_sin_cache`.
        lw: the layer's :func:`layer_weights`, for what else its attention has
            (Qwen3's ``q_norm`` / ``k_norm``, Qwen2-MoE's ``q_bias`` ...); None: none.

    Returns:
        ``(o_in, out)``: the attention output before ``o_proj`` ``[B, S, Hq D]`` and
        the block's output ``[B, S, H]``.
    """
    lw = lw or {}
    o_in = _attend(cfg, x, wq, wk, wv, cos_sin, lw.get("q_norm"), lw.get("k_norm"),
                   (lw.get("q_bias"), lw.get("k_bias"), lw.get("v_bias")))
    return o_in, o_in @ wo.t()


def mlp_block(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU MLP: ``x`` ``[..., H]`` -> ``(down_proj input [..., F], output [..., H])``."""
    act = F.silu(x @ wg.t()) * (x @ wu.t())
    return act, act @ wd.t()


@dataclass
class LayerActivations:
    """One decoder layer's float32 activations on one batch (``[B, S, .]`` or ``[S, .]``)."""

    attn_in: torch.Tensor      # input_layernorm(h): q/k/v input
    o_in: torch.Tensor         # attention output: o_proj input
    attn_out: torch.Tensor     # o_proj output
    mlp_in: torch.Tensor       # post_attention_layernorm(h + attn_out): gate/up input
    down_in: torch.Tensor      # silu(gate) * up: down_proj input
    mlp_out: torch.Tensor      # down_proj output
    out: torch.Tensor          # the layer's output (next layer's input)


# on_group(group, inputs, weights, residual) -> replacement weights (short names) or None.
GroupHook = Callable[[str, list[torch.Tensor], dict[str, torch.Tensor],
                      "list[torch.Tensor] | None"], "dict[str, torch.Tensor] | None"]


def run_layer(cfg: ModelConfig, lw: dict[str, torch.Tensor], hs: list[torch.Tensor],
              cos_sin: torch.Tensor, on_group: GroupHook | None = None
              ) -> list[LayerActivations]:
    """One float32 pre-norm decoder layer over several batches, calling ``on_group``
    with the inputs of each group of linears (:data:`GROUPS`) before that group is used.

    Args:
        cfg: the model's config.
        lw: :func:`layer_weights` of the layer; the weights ``on_group`` returns
            replace entries of this dict (not the tensors) from then on.
        hs: the layer's inputs, one tensor per batch, each ``[B, S, H]`` or ``[S, H]``
            (batches may differ in length; positions start at 0 in each).
        cos_sin: ``[>= max S, D]`` from :func:`~tandem.kernels.reference.rope_cos_sin_cache`.
        on_group: ``(group, inputs, weights, residual)``, with ``inputs`` the group's
            float32 inputs per batch, ``weights`` the layer's current ``lw``, and
            ``residual`` (``o`` and ``down``, which write into the residual stream;
            None for the others) the residual stream per batch that the group's output
            is added to; returns replacement weights by short name (for instance the
            rounded ones) or None.

    Returns:
        One :class:`LayerActivations` per batch, computed with the weights in effect
        when each activation was reached.
    """
    def group(name: str, inputs: list[torch.Tensor], residual=None) -> None:
        if on_group is not None:
            new = on_group(name, inputs, lw, residual)
            if new:
                lw.update(new)

    eps = cfg.rms_norm_eps
    attn_in = [rms_norm_ref(h, lw["ln1"], eps) for h in hs]
    group("qkv", attn_in)
    biases = (lw.get("q_bias"), lw.get("k_bias"), lw.get("v_bias"))
    o_in = [_attend(cfg, x, lw["q"], lw["k"], lw["v"], cos_sin, lw.get("q_norm"),
                    lw.get("k_norm"), biases) for x in attn_in]
    group("o", o_in, hs)
    attn_out = [o @ lw["o"].t() for o in o_in]
    mid = [h + a for h, a in zip(hs, attn_out)]
    mlp_in = [rms_norm_ref(m, lw["ln2"], eps) for m in mid]
    if "router" in lw:
        down_in = [None] * len(hs)
        mlp_out = _moe_block(cfg, lw, mlp_in, group)
    else:
        group("gate_up", mlp_in)
        down_in = [F.silu(x @ lw["gate"].t()) * (x @ lw["up"].t()) for x in mlp_in]
        group("down", down_in, mid)
        mlp_out = [a @ lw["down"].t() for a in down_in]
    return [LayerActivations(a, o, ao, mi, di, mo, m + mo) for a, o, ao, mi, di, mo, m in
            zip(attn_in, o_in, attn_out, mlp_in, down_in, mlp_out, mid)]


def moe_block(cfg: ModelConfig, lw: dict[str, torch.Tensor], x: torch.Tensor,
              on_group: Callable[[str, torch.Tensor], None] | None = None) -> torch.Tensor:
    """A layer's MoE feed-forward of ``x`` ``[..., H]`` with the weights in ``lw``
    (:func:`layer_weights`), float32, as :func:`run_layer` computes it; ``on_group(name,
    inputs)`` sees each expert group's inputs (``experts.{e}.gate_up``: the tokens
    routed to ``e``, ``[T_e, H]``; ``experts.{e}.down``: their ``silu(gate) * up``;
    ``shared_expert.*``: every token's)."""
    hook = (lambda name, inputs: on_group(name, inputs[0])) if on_group else (lambda *_: None)
    return _moe_block(cfg, lw, [x], hook)[0]


def _moe_block(cfg: ModelConfig, lw: dict[str, torch.Tensor], xs: list[torch.Tensor],
               group: Callable) -> list[torch.Tensor]:
    """The MoE feed-forward of each batch in ``xs`` (``[..., H]``), float32: tokens
    routed as the engine routes them (:func:`~tandem.engine.model.moe.route`, the
    router dense), then expert by expert ``group("experts.{e}.gate_up", its tokens'
    inputs)``, its SwiGLU, ``group("experts.{e}.down", ...)``, and the outputs summed
    with the routing weights; then a shared expert (Qwen2-MoE) on every token,
    ``group("shared_expert.gate_up" / ".down", ...)``, its output scaled by
    ``sigmoid(x shared_expert_gate^T)`` and added. An expert no token reached gets
    empty ``[0, K]`` inputs."""
    from tandem.engine.model.moe import route

    moe = cfg.moe
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    routes = [route(x @ lw["router"].t(), moe.num_experts_per_tok, moe.norm_topk_prob, True)
              for x in flat]
    outs = [torch.zeros_like(x) for x in flat]
    for e in range(moe.num_experts):
        # per batch: (token rows, routing weight) of the tokens routed to expert e
        picks = [((ids == e).nonzero(as_tuple=True)[0], w[ids == e]) for w, ids in routes]
        group(f"experts.{e}.gate_up", [x[rows] for x, (rows, _) in zip(flat, picks)])
        acts = [F.silu(x[rows] @ lw[f"experts.{e}.gate"].t()) * (x[rows] @ lw[f"experts.{e}.up"].t())
                for x, (rows, _) in zip(flat, picks)]
        group(f"experts.{e}.down", acts)
        for out, a, (rows, w) in zip(outs, acts, picks):
            out.index_add_(0, rows, (a @ lw[f"experts.{e}.down"].t()) * w[:, None])
    if "shared_expert.gate" in lw:
        group("shared_expert.gate_up", flat)
        acts = [F.silu(x @ lw["shared_expert.gate"].t()) * (x @ lw["shared_expert.up"].t())
                for x in flat]
        group("shared_expert.down", acts)
        for out, x, a in zip(outs, flat, acts):
            out += torch.sigmoid(x @ lw["shared_expert_gate"].t()) * (a @ lw["shared_expert.down"].t())
    return [o.view(x.shape) for o, x in zip(outs, xs)]


def decoder_layer(cfg: ModelConfig, lw: dict[str, torch.Tensor], h: torch.Tensor,
                  cos_sin: torch.Tensor) -> LayerActivations:
    """One float32 decoder layer on ``h`` ``[B, S, H]``, keeping its activations
    (:func:`run_layer` of one batch, without a hook)."""
    return run_layer(cfg, lw, [h], cos_sin)[0]


def final_logits(cfg: ModelConfig, weights: dict[str, torch.Tensor], hidden: torch.Tensor
                 ) -> torch.Tensor:
    """float32 logits ``[..., V]`` from the last layer's hidden states ``[..., H]``
    (final norm, then the output projection: ``lm_head`` or the tied embedding)."""
    h = rms_norm_ref(hidden, weights["model.norm.weight"].float(), cfg.rms_norm_eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return h @ head.float().t()


def model_logits(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 input_ids: torch.Tensor) -> torch.Tensor:
    """float32 logits ``[B, S, V]`` of the float model in ``weights`` on ``input_ids``
    ``[B, S]``."""
    from tandem.kernels.reference import rope_cos_sin_cache

    cos_sin = rope_cos_sin_cache(cfg.head_dim, input_ids.shape[1], cfg.rope_theta)
    h = weights["model.embed_tokens.weight"].float()[input_ids]
    for i in range(cfg.num_layers):
        h = decoder_layer(cfg, {k: v.float() for k, v in layer_weights(weights, i, cfg).items()},
                          h, cos_sin).out
    return final_logits(cfg, weights, h)


# -- writing --------------------------------------------------------------------------------
def hf_config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face ``LlamaForCausalLM`` config.json for ``cfg`` (what
    :meth:`ModelConfig.from_hf_config` reads back to the same config): the config of
    a GGUF source, which has no config.json of its own."""
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


def check_output(output: str, argument: str = "output") -> None:
    """Raises ValueError (naming ``argument``) unless ``output`` is absent or an empty
    directory: a quantizer never writes over files (the source's among them)."""
    if (os.path.isdir(output) and os.listdir(output)) or \
            (os.path.exists(output) and not os.path.isdir(output)):
        raise ValueError(f"{argument}: {output} exists and is not an empty directory")


def quantized_state(weights: dict[str, torch.Tensor],
                    pack: Callable[[str, torch.Tensor], "dict[str, torch.Tensor] | None"]
                    ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: for each decoder linear (:func:`decoder_linear`,
    and each expert projection, :func:`expert_linear`) ``pack(module, weight)``
    gives its packed tensors by leaf name (``qweight``, ``scales``, ...; stored as
    ``{module}.{leaf}``), or None to keep it dense; every other tensor is stored in
    float16."""
    state: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        module = decoder_linear(name) or expert_linear(name)
        packed = pack(module, t) if module is not None else None
        if packed is None:
            state[name] = t.to(torch.float16).contiguous()
        else:
            state.update({f"{module}.{leaf}": p for leaf, p in packed.items()})
    return state


def write_checkpoint(output: str, dense: DenseModel, state: dict[str, torch.Tensor],
                     quantization_config: dict, tokenizer=None,
                     extra_files: dict[str, dict] | None = None) -> None:
    """Write a quantized Hugging Face checkpoint directory, atomically.

    Writes ``model.safetensors`` (``state``), ``config.json`` (the source's, or
    :func:`hf_config_dict` for a GGUF source, with ``torch_dtype`` float16 and
    ``quantization_config``), each of ``extra_files`` as JSON, and the tokenizer (a
    Hugging Face source's files, or a GGUF source's tokenizer saved with
    ``save_pretrained``). Everything goes into a temporary directory beside
    ``output``, renamed into place when complete.

    Args:
        output: the directory (absent or empty: see :func:`check_output`).
        dense: the source model.
        state: the tensors (:func:`quantized_state`).
        quantization_config: the config.json entry that selects the serving method.
        tokenizer: the source's :class:`~tandem.engine.text.tokenizer.Tokenizer`, if
            built (None: built from ``dense.files`` when needed).
        extra_files: file name -> JSON object (``quantize_config.json`` for AutoGPTQ).

    Raises:
        ValueError: ``output`` is not absent or empty.
        OSError: writing failed (nothing is left at ``output``).
    """
    from safetensors.torch import save_file

    check_output(output)
    files = dense.files
    if files.format == "hf":
        with open(os.path.join(files.path, "config.json")) as f:
            config = json.load(f)
    else:
        config = hf_config_dict(dense.cfg)
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "float16"
    if "dtype" in config:
        config["dtype"] = "float16"

    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output)}.tmp-")
    try:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        for name, obj in {"config.json": config, **(extra_files or {})}.items():
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2, sort_keys=True)
        if files.format == "hf":
            for name in TOKENIZER_FILES:
                src = os.path.join(files.path, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(tmp, name))
        else:
            if tokenizer is None:
                from tandem.engine.text.tokenizer import Tokenizer

                tokenizer = Tokenizer(files)
            tokenizer.hf_tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)      # mkdtemp made it private
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.isdir(output):
            os.rmdir(output)            # empty (checked above)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def progress_bar(items, enabled: bool, unit: str):
    """``items``, wrapped in a tqdm progress bar when ``enabled`` and tqdm is installed."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:     # tqdm comes with transformers; a bare install still works
        return items
    return tqdm(items, unit=unit, desc="quantize")
