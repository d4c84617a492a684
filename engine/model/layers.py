"""The decoder layers every registered architecture is wired from.

Plain torch modules with shape comments (gpt-fast style). Q/K/V and gate/up
projections are fused at load time (one matmul each); parameter names follow the
Hugging Face checkpoint names so that loading is the declared mapping in
:meth:`DecoderForCausalLM.weight_mapping`. The projections are
:class:`~tandem.engine.model.linear.Linear` layers, whose linear method (dense, or a
quantized format) owns their storage and matmul. The hot per-layer operations
(attention over the paged cache, RMSNorm, RoPE, SiLU-and-mul) go through an
:class:`~tandem.kernels.attention_backend.AttentionBackend`.

Architectures differ by constructor arguments of these layers (vLLM's way), not by
copies: :meth:`DecoderForCausalLM.attention_options` says which biases and norms a
model's attention has; the model files (``llama.py``, ``qwen.py``) are wiring.

Shapes: ``T`` packed tokens of the step, ``H`` hidden size, ``Hq``/``Hkv`` query
and KV heads, ``D`` head dim, ``V`` vocab size, ``F`` FFN width.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.model.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from tandem.engine.model.rotary import rope_cos_sin_cache
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata, default_scale

# Checkpoint projection -> (fused projection, shard id): the sub-matrices that
# load into one fused layer, in the order of its output sizes.
_FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """RMSNorm's parameters (``weight`` ``[N]``, ``eps``); the backend computes it
    (``x / rms(x) * weight``, in float32, as transformers' Llama/Qwen norms)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache, with RoPE.

    Args:
        cfg: the model's config (geometry, ``rms_norm_eps``).
        linear_method: the projections' linear method.
        qkv_bias: biases on the Q, K and V projections (Qwen2; Llama's
            ``attention_bias``).
        o_bias: a bias on the output projection (Llama's and Qwen3's ``attention_bias``).
        qk_norm: RMSNorm over each head's ``D`` features of Q and K before RoPE
            (Qwen3: ``q_norm`` / ``k_norm``, weight ``[D]``).
    """

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               linear_method, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, linear_method, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = default_scale(cfg.head_dim)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                cos_sin_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        t = h.shape[0]
        qkv = self.qkv_proj(h)                                   # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:                              # per head: over D
            q = backend.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight,
                                 self.q_norm.eps)                # [T Hq, D]
            k = backend.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight,
                                 self.k_norm.eps)                # [T Hkv, D]
        q = q.reshape(t, self.num_heads, self.head_dim)          # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = backend.rotary_embedding(positions, q, k, cos_sin_cache)
        o = backend.attention(q, k, v, key_cache, value_cache, meta, self.scale,
                              k_scale, v_scale)                  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up fused into one ``[2F, H]`` matmul."""

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase):
        super().__init__()
        f = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [f, f], linear_method)
        self.down_proj = Linear(f, cfg.hidden_size, linear_method)

    def forward(self, h: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(h)))   # [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase, **attention_options):
        super().__init__()
        self.self_attn = Attention(cfg, linear_method, **attention_options)
        self.mlp = GatedMLP(cfg, linear_method)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """A pre-norm decoder-only causal LM whose attention reads and writes a paged KV
    cache: the Llama layout, which the registered architectures share.

    A subclass (one per architecture) says how its attention differs through
    :meth:`attention_options`; everything else (embedding, tied or untied output
    projection, GGUF blocks, the forward pass) is this class's.

    Args:
        cfg: the model's :class:`ModelConfig`.
        linear_method: the decoder layers' linear method (dense when None).
    """

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        """Keyword arguments of :class:`Attention` for this architecture."""
        return {}

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
        options = self.attention_options(cfg)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, linear_method, **options)
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
        the tensor's leaf (``weight``, ``bias``, or a quantized format's ``qweight``,
        ``scales``, ...) is kept, so the mapping holds for every linear method.
        """
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in _FUSED_PROJECTIONS:
            fused, shard_id = _FUSED_PROJECTIONS[proj]
            return f"{parent}.{fused}.{leaf}", shard_id
        return name, None

    def init_rope(self, device: torch.device) -> None:
        """Build the float32 cos/sin table ``[max_model_len, D]`` once, with the
        config's RoPE scaling (:func:`~tandem.engine.model.rotary.rope_cos_sin_cache`)."""
        self.cos_sin_cache = rope_cos_sin_cache(self.cfg, device)

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
