"""Llama-family decoder over a paged KV cache.

Plain torch modules with shape comments (gpt-fast style). Q/K/V and gate/up
projections are fused at load time (one matmul each); parameter names follow the
Hugging Face checkpoint names so that loading is the declared mapping in
:meth:`LlamaForCausalLM.weight_mapping`. The projections are
:class:`~tandem.engine.model.linear.Linear` layers, whose linear method (dense, or a
quantized format) owns their storage and matmul. The hot per-layer operations (attention
over the paged cache, RMSNorm, RoPE, SiLU-and-mul) go through an
:class:`~tandem.kernels.attention_backend.AttentionBackend`.

Shapes: ``T`` packed tokens of the step, ``H`` hidden size, ``Hq``/``Hkv`` query
and KV heads, ``D`` head dim, ``V`` vocab size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from typing import Callable

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.model.linear import (Linear, LinearMethodBase, UnquantizedLinearMethod,
                                        process_weights_after_loading)
from tandem.engine.quantization.checkpoint import linear_method_for
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata, default_scale
from tandem.kernels.reference import rope_cos_sin_cache

logger = logging.getLogger(__name__)

# Checkpoint projection -> (fused projection, shard id): the sub-matrices that
# load into one fused layer, in the order of its output sizes.
_FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               linear_method)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, linear_method)
        self.scale = default_scale(cfg.head_dim)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                cos_sin_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        t = h.shape[0]
        qkv = self.qkv_proj(h)                                   # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)          # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = backend.rotary_embedding(positions, q, k, cos_sin_cache)
        o = backend.attention(q, k, v, key_cache, value_cache, meta, self.scale,
                              k_scale, v_scale)                  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase):
        super().__init__()
        f = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [f, f], linear_method)
        self.down_proj = Linear(f, cfg.hidden_size, linear_method)

    def forward(self, h: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(h)))   # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, linear_method)
        self.mlp = LlamaMLP(cfg, linear_method)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a paged KV cache.

    Args:
        cfg: the model's :class:`ModelConfig`.
        linear_method: the decoder layers' linear method (dense when None).
    """

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase | None = None):
        super().__init__()
        self.cfg = cfg
        linear_method = linear_method or UnquantizedLinearMethod()
        self.model = nn.Module()
        gguf = linear_method.name == "gguf"
        tied = cfg.tie_word_embeddings
        if gguf:
            # The embedding and the output projection keep the file's blocks too; a
            # tied output projection reads the embedding's (see load_model).
            from tandem.engine.quantization.gguf_linear import GGUFEmbedding

            self.model.embed_tokens = GGUFEmbedding(cfg.vocab_size, cfg.hidden_size)
        else:
            # nn.Embedding's random init, but not on the meta device (where load_model
            # builds the model), on which normal_ runs torch's Python reference and
            # imports torch._dynamo: 1.5 s in every worker process.
            table = torch.empty(cfg.vocab_size, cfg.hidden_size)
            if not table.is_meta:
                nn.init.normal_(table)
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(cfg, linear_method)
                                          for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Otherwise the output projection stays dense: it multiplies by the dense
        # embedding when tied, and is what GPTQ/AWQ checkpoints keep dense otherwise.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size,
                              linear_method if gguf else UnquantizedLinearMethod())
        leaves = ("qweight", "qweight_type") if gguf else ("weight",)
        self.tied_parameters = ({f"lm_head.{x}": f"model.embed_tokens.{x}" for x in leaves}
                                if tied else {})
        self.ignored_checkpoint_names = ("lm_head.weight",) if tied else ()
        if tied and not gguf:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cos_sin_cache: torch.Tensor | None = None

    # -- loading ---------------------------------------------------------------------------
    def weight_mapping(self, name: str) -> tuple[str, int | None]:
        """Checkpoint (Hugging Face) name -> (parameter name, shard id or None).

        ``model.layers.3.self_attn.k_proj.weight`` -> ``(...qkv_proj.weight, 1)``;
        the tensor's leaf (``weight``, or a quantized format's ``qweight``,
        ``scales``, ...) is kept, so the mapping holds for every linear method.
        """
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in _FUSED_PROJECTIONS:
            fused, shard_id = _FUSED_PROJECTIONS[proj]
            return f"{parent}.{fused}.{leaf}", shard_id
        return name, None

    def init_rope(self, device: torch.device) -> None:
        """Build the float32 cos/sin table ``[max_model_len, D]`` once."""
        self.cos_sin_cache = rope_cos_sin_cache(
            self.cfg.head_dim, self.cfg.max_model_len, self.cfg.rope_theta, torch.float32, device)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend,
                after_layer: Callable[[int], None] | None = None,
                kv_scales: torch.Tensor | None = None,
                open_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder on one step's packed tokens.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 positions in their sequences.
            kv_caches: ``[L, 2, NB, BS, Hkv, D]``; this step's K/V are written into it.
            meta: slot mapping, block tables and sequence lengths of the step.
            backend: the attention backend.
            after_layer: called with the layer index once that layer's K/V are in
                ``kv_caches`` (the prefill worker starts that layer's KV transfer
                there, overlapping it with the next layer's compute).
            kv_scales: ``[L, 2, Hkv]`` float32 K and V scales of an fp8 ``kv_caches``
                (``KVCache.scales``); None otherwise.
            open_keys: ``[L, S, BS, Hkv, D]``, the open-block K store of an int4
                ``kv_caches`` (``KVCache.open_keys``; ``meta.int4_plan`` says where this
                step writes); None otherwise.

        Returns:
            Final hidden states ``[T, H]`` (after the last RMSNorm).
        """
        h = self.model.embed_tokens(input_ids)                   # [T, H]
        residual = None
        for i, layer in enumerate(self.model.layers):
            if residual is None:
                residual = h
                h = backend.rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
            else:
                h, residual = backend.rms_norm(h, layer.input_layernorm.weight,
                                               layer.input_layernorm.eps, residual)
            if open_keys is not None:      # int4: the layer's store stands in for k_scale
                k_scale, v_scale = open_keys[i], None
            else:
                k_scale = None if kv_scales is None else kv_scales[i, 0]
                v_scale = None if kv_scales is None else kv_scales[i, 1]
            h = layer.self_attn(h, positions, kv_caches[i, 0], kv_caches[i, 1], meta, backend,
                                self.cos_sin_cache, k_scale, v_scale)
            h, residual = backend.rms_norm(h, layer.post_attention_layernorm.weight,
                                           layer.post_attention_layernorm.eps, residual)
            h = layer.mlp(h, backend)
            if after_layer is not None:
                after_layer(i)
        h, _ = backend.rms_norm(h, self.model.norm.weight, self.model.norm.eps, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> float32 logits ``[N, V]``."""
        return self.lm_head(hidden).float()

_DEQUANTIZED_CACHE_FORMAT = "2"   # bump when iter_gguf_tensors' output changes


def gguf_checkpoint(files, native: bool = False
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """A GGUF model's config and its ``(hf_name, tensor)`` pairs
    (:func:`~tandem.engine.model.weights.iter_gguf_tensors`), converted once per file:
    dequantized to float32, or with ``native`` the projections' blocks as stored
    (``qweight`` / ``qweight_type``, for the ``gguf`` linear method).

    Opening a GGUF file parses every metadata field (the tokenizer's vocabulary and
    merges element by element: seconds) and dequantizing takes seconds more, every
    worker start. The first load saves the dequantized tensors and the config as one
    safetensors file in the model-file cache
    (:func:`~tandem.engine.model.model_files.derived_path`: keyed by the file's path,
    size, mtime and the ``gguf`` version); later loads read that file (under a
    second). The write is atomic; a cache that cannot be written is skipped.

    Raises:
        ValueError: not a Llama GGUF file (see :meth:`ModelConfig.from_gguf_fields`).
        WeightLoadError: an unknown tensor name.
    """
    from importlib.metadata import version

    from tandem.engine.model import weights

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.engine.model.model_files import derived_path, publish

    target = derived_path(files, "weights-native" if native else "weights", version("gguf"),
                          _DEQUANTIZED_CACHE_FORMAT)
    if target is not None:
        target += ".safetensors"
        if os.path.isfile(target):
            with safe_open(target, framework="pt") as f:
                cfg = ModelConfig(**json.loads(f.metadata()["model_config"]))

            def cached() -> Iterator[tuple[str, torch.Tensor]]:
                with safe_open(target, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            return cfg, cached()
    fields, reader = weights.read_gguf(files.path)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    cfg = ModelConfig.from_gguf_fields(fields, has_output)
    if target is None:
        return cfg, weights.iter_gguf_tensors(reader, cfg, native)
    tensors = dict(weights.iter_gguf_tensors(reader, cfg, native))
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        os.close(fd)
        save_file(tensors, tmp, metadata={"model_config": json.dumps(dataclasses.asdict(cfg))})
        publish(tmp, target)
    except OSError as exc:
        logger.debug("dequantized weight cache %s not written: %s", target, exc)
    return cfg, iter(tensors.items())


def load_model(files, dtype: torch.dtype, device: torch.device, quantization: str = "none",
               batch_invariant: bool = False,
               activation_quantization: str = "none") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from a GGUF file or a Hugging Face checkpoint directory.

    The module is created on the ``meta`` device (no random init), materialised on
    ``device`` in ``dtype``, filled strictly from the checkpoint, and then each
    linear layer's method prepares its weights for its kernel.

    Args:
        files: a resolved :class:`~tandem.engine.model.model_files.ModelFiles`.
        dtype: weights and activations dtype.
        device: where the weights live.
        quantization: the linear method's config string (``EngineConfig.quantization``);
            a checkpoint with a ``quantization_config`` (GPTQ) brings its own method
            when this is ``none`` (:func:`~tandem.engine.quantization.checkpoint.linear_method_for`).
        batch_invariant: batch-invariant linear kernels (``EngineConfig.batch_invariant``).
        activation_quantization: ``EngineConfig.activation_quantization``.

    Returns:
        ``(model, config)``; the model is in eval mode with its RoPE table built.

    Raises:
        ValueError: unknown ``quantization``, or one the checkpoint is not quantized
            with; ``batch_invariant`` off the CPU; ``activation_quantization`` int8
            for a model without quantized blocks.
        WeightLoadError: the checkpoint does not match the architecture.
    """
    from tandem.engine.model import weights

    if quantization == "gguf" and files.format != "gguf":
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's blocks, but the model "
                         f"{files.path} is a {files.format} checkpoint")
    if files.format == "gguf":
        cfg, tensors = gguf_checkpoint(files, native=quantization == "gguf")
    else:
        cfg = ModelConfig.from_hf_config(files.path)
        tensors = weights.iter_safetensors(files.path)
    linear_method = linear_method_for(files, quantization)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, linear_method)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        # Packed layers hold no float parameter for .to(dtype) to convert: tell them
        # the dtype their outputs (and any dense fallback) take.
        if hasattr(module, "params_dtype"):
            module.params_dtype = dtype
    weights.load_weights(model, tensors)
    if cfg.tie_word_embeddings and hasattr(model.model.embed_tokens, "share_with"):
        model.model.embed_tokens.share_with(model.lm_head)
    process_weights_after_loading(model, batch_invariant, activation_quantization)
    model.init_rope(device)
    model.eval()
    return model, cfg
