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
model's attention has, a few class attributes say how the decoder differs (Gemma's
embedding scale, ``(1 + w)`` norms and sandwich norms), and the rest comes from the
:class:`ModelConfig` (per-layer sliding windows, soft-capping, the activation, the
attention scale); the model files (``llama.py``, ``qwen.py``, ``gemma.py``,
``phi3.py``) are wiring.

Tensor parallelism: built with a :class:`~tandem.engine.parallel.communicator.Communicator`
(``tensor_parallel_size`` > 1), a model holds its rank's shard of every layer (Megatron-LM's
split, :mod:`tandem.engine.parallel.layers`): Q/K/V and gate-up column-parallel,
the output and down projections row-parallel (one all-reduce each), the embedding
and the LM head vocabulary-parallel; attention runs on the rank's heads
(:func:`~tandem.engine.parallel.partition.head_partition`). The forward pass is the
same code: the collectives are inside those layers. Without a communicator (one
rank) the layers are the plain ones.

Shapes: ``T`` packed tokens of the step, ``H`` hidden size, ``Hq``/``Hkv`` query
and KV heads (of this rank under tensor parallelism), ``D`` head dim, ``V`` vocab
size, ``F`` FFN width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.model.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from tandem.engine.model.registry import UnsupportedModelError
from tandem.engine.model.rotary import (dynamic_ntk_rows, local_rope_cos_sin_cache,
                                        rope_cos_sin_cache)
from tandem.engine.model.weights import copy_checked
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata, default_scale

if TYPE_CHECKING:   # tensor-parallel modules are imported only where a model is sharded
    from tandem.engine.parallel.communicator import Communicator

# Checkpoint projection -> (fused projection, shard id): the sub-matrices that
# load into one fused layer, in the order of its output sizes.
_FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """RMSNorm's parameters (``weight`` ``[N]``, ``eps``); the backend computes it
    (``x / rms(x) * weight``, in float32, as transformers' Llama/Qwen norms).

    Args:
        offset: the checkpoint stores ``w`` and the norm multiplies by ``1 + w``
            (Gemma); ``weight`` then holds ``1 + w``, added in float32 at load.
    """

    def __init__(self, hidden_size: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset

    def load_weight(self, leaf: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Called by :func:`~tandem.engine.model.weights.load_weights`.

        Raises:
            WeightLoadError: a shape that does not fit.
        """
        copy_checked(self.weight.data, 1.0 + loaded.float() if self.offset else loaded)


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
        qk_norm_offset: the Q/K norms multiply by ``1 + w`` (Gemma 3).
        layer_idx: the layer's index: its sliding window (``cfg.layer_windows``; one
            of ``max_model_len`` or more is dropped, it cannot bind) and, with
            ``cfg.rope_local_theta``, the local RoPE table for a sliding layer.
        comm: tensor parallelism's communicator: this rank's heads only, Q/K/V
            column-parallel and the output projection row-parallel; None: all heads.

    The softmax scale is ``cfg.query_pre_attn_scalar ** -0.5`` when set, else
    ``D ** -0.5``; ``cfg.attn_logit_softcapping`` caps the scores.
    """

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, qk_norm_offset: bool = False,
                 layer_idx: int = 0, comm: Communicator | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        if comm is None:
            self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                   linear_method, bias=qkv_bias)
            self.o_proj = Linear(self.q_size, cfg.hidden_size, linear_method, bias=o_bias)
        else:
            self._shard_heads(cfg, linear_method, qkv_bias, o_bias, comm)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, qk_norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, qk_norm_offset) if qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar
                      else default_scale(cfg.head_dim))
        window = cfg.layer_window(layer_idx)
        self.local_rope = window is not None and cfg.rope_local_theta is not None
        self.window = window if window is not None and window < cfg.max_model_len else None
        self.softcap = cfg.attn_logit_softcapping
        # Passed to the backend only when set: backends without them keep their signature.
        self.options = {k: v for k, v in (("window", self.window), ("softcap", self.softcap))
                        if v is not None}

    def _shard_heads(self, cfg: ModelConfig, linear_method: LinearMethodBase, qkv_bias: bool,
                     o_bias: bool, comm: Communicator) -> None:
        """Tensor parallelism: keep this rank's heads of the Q/K/V and output projections."""
        from tandem.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
        from tandem.engine.parallel.partition import head_partition

        heads = head_partition(cfg.num_heads, cfg.num_kv_heads, comm.world_size, comm.rank)
        d = cfg.head_dim
        q_rows = (heads.q_start * d, heads.num_heads * d)
        kv_rows = (heads.kv_start * d, heads.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [self.q_size, self.kv_size,
                                                               self.kv_size],
                                             [q_rows, kv_rows, kv_rows], linear_method,
                                             bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, q_rows, comm,
                                        linear_method, bias=o_bias)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size, self.kv_size = q_rows[1], kv_rows[1]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                cos_sin_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``h`` ``[T, H]`` -> ``[T, H]``; ``cos_sin_cache`` is this layer's RoPE table."""
        t = h.shape[0]
        qkv = self.qkv_proj.forward(h)                           # [T, (Hq + 2 Hkv) D]
        if self.q_norm is None:                  # the backend's fast path, where it has one
            o = backend.decode_from_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                        positions, cos_sin_cache, key_cache, value_cache, meta,
                                        self.scale, k_scale, v_scale, **self.options)
            if o is not None:
                return self.o_proj.forward(o)                    # [T, H]
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
                              k_scale, v_scale, **self.options)  # [T, Hq, D]
        return self.o_proj.forward(o.reshape(t, self.q_size))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up fused into one ``[2F, H]`` matmul;
    ``act`` is ``cfg.hidden_act``: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU).
    ``intermediate_size`` overrides ``cfg.intermediate_size`` (a MoE model's shared
    expert). With ``comm`` (tensor parallelism) this rank's share of the ``F``
    features: gate-up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase,
                 intermediate_size: int | None = None, comm: Communicator | None = None):
        super().__init__()
        f = intermediate_size or cfg.intermediate_size
        if comm is None:
            self.gate_up_proj = Linear(cfg.hidden_size, [f, f], linear_method)
            self.down_proj = Linear(f, cfg.hidden_size, linear_method)
        else:
            from tandem.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
            from tandem.engine.parallel.partition import split_in_units

            cols = split_in_units(f, linear_method.shard_units, comm.world_size, comm.rank)
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [f, f], [cols, cols],
                                                     linear_method)
            self.down_proj = RowParallelLinear(f, cfg.hidden_size, cols, comm, linear_method)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, h: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(h)                               # [T, 2F]
        act = backend.gelu_tanh_and_mul(gate_up) if self.gelu else backend.silu_and_mul(gate_up)
        return self.down_proj.forward(act)                                   # [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``; with
    ``sandwich`` norms (Gemma 2/3) the outputs of attention and MLP are normed too:
    ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``+ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(.)))``.

    ``mlp`` replaces the :class:`GatedMLP` (a mixture-of-experts block); any module
    with ``forward(h [T, H], backend) -> [T, H]``."""

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase, layer_idx: int = 0,
                 sandwich: bool = False, norm_offset: bool = False,
                 mlp: nn.Module | None = None, comm: Communicator | None = None,
                 **attention_options):
        super().__init__()
        self.self_attn = Attention(cfg, linear_method, layer_idx=layer_idx, comm=comm,
                                   **attention_options)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg, linear_method, comm=comm)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(h, eps, norm_offset)
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, norm_offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, norm_offset)


class DecoderForCausalLM(nn.Module):
    """A pre-norm decoder-only causal LM whose attention reads and writes a paged KV
    cache: the Llama layout, which the registered architectures share.

    A subclass (one per architecture) says how its attention differs through
    :meth:`attention_options`, and how its decoder differs through the class
    attributes below; everything else (embedding, tied or untied output projection,
    GGUF blocks, the forward pass) is this class's.

    Inside the decoder layers, modules are called through ``forward``: no hooks run
    on them (``nn.Module.__call__``'s hook dispatch costs ~2 us a call, six calls a
    layer, every step); the model itself and its ``lm_head`` are called as modules
    and take hooks (tensor parallelism's runner announces each step there).

    Args:
        cfg: the model's :class:`ModelConfig`.
        linear_method: the decoder layers' linear method (dense when None).
        comm: tensor parallelism: this rank's shard of every layer (module
            docstring); None: the whole model.

    Raises:
        NotImplementedError: ``comm`` for an architecture whose class does not set
            :attr:`supports_tensor_parallel`, or with a ``linear_method`` whose format
            does not shard (the message names ``tensor_parallel_size``).
        ValueError: head counts the ranks cannot share
            (:func:`~tandem.engine.parallel.partition.head_partition`).
    """

    scale_embeddings: bool = False
    """Embeddings multiplied by ``sqrt(H)`` (rounded to the model dtype; Gemma)."""
    norm_offset: bool = False
    """Every RMSNorm multiplies by ``1 + w`` (Gemma)."""
    sandwich_norms: bool = False
    """Attention and MLP outputs normed too (:class:`DecoderLayer`; Gemma 2/3)."""
    supports_tensor_parallel: bool = False
    """Whether the class may be built with a communicator (its tensor-parallel
    outputs are tested against the unsharded model's)."""

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        """Keyword arguments of :class:`Attention` for this architecture."""
        return {}

    def make_mlp(self, cfg: ModelConfig, linear_method: LinearMethodBase,
                 layer_idx: int, comm: Communicator | None = None) -> nn.Module | None:
        """Layer ``layer_idx``'s feed-forward block (this rank's share of it with
        ``comm``), or None for the :class:`GatedMLP` (mixture-of-experts
        architectures return their expert block)."""
        return None

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethodBase | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.cfg = cfg
        linear_method = linear_method or UnquantizedLinearMethod()
        self.model = nn.Module()
        gguf = linear_method.name == "gguf"
        tied = cfg.tie_word_embeddings
        if comm is not None:
            self._check_tensor_parallel(linear_method, comm)
            from tandem.engine.parallel.layers import VocabParallelEmbedding

            self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm,
                                                             gguf=gguf)
        elif gguf:
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
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, linear_method, i, self.sandwich_norms, self.norm_offset,
                         self.make_mlp(cfg, linear_method, i, comm), comm, **options)
            for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        if comm is not None:
            from tandem.engine.parallel.layers import ParallelLMHead

            # GGUF: the head keeps the file's blocks (a tied one shares the embedding's).
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, comm,
                                          quant_method=linear_method if gguf else None)
        else:
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
        self.local_cos_sin_cache: torch.Tensor | None = None

    def _check_tensor_parallel(self, linear_method: LinearMethodBase, comm: Communicator) -> None:
        if not self.supports_tensor_parallel:
            raise NotImplementedError(
                f"tensor_parallel_size {comm.world_size}: not implemented for "
                f"{type(self).__name__} yet (mixture-of-experts blocks are not sharded; "
                "the dense Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 models are)")
        if not linear_method.supports_tensor_parallel:
            raise NotImplementedError(
                f"tensor_parallel_size {comm.world_size}: {linear_method.name!r} linear "
                "layers are not sharded")

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
        config's RoPE scaling (:func:`~tandem.engine.model.rotary.rope_cos_sin_cache`;
        ``longrope``: ``[2 max_model_len, D]``, short then long), and the sliding
        layers' table when they have their own base (``cfg.rope_local_theta``)."""
        self.cos_sin_cache = rope_cos_sin_cache(self.cfg, device)
        if self.cfg.rope_local_theta is not None:
            self.local_cos_sin_cache = local_rope_cos_sin_cache(self.cfg, device)

    def check_backend(self, backend: AttentionBackend) -> None:
        """Refuse a backend that lacks an attention feature this model's layers use.

        Raises:
            UnsupportedModelError: field ``sliding_window`` or
                ``attn_logit_softcapping``, naming the backend.
        """
        attn = [layer.self_attn for layer in self.model.layers]
        if any(a.window is not None for a in attn) and not backend.supports_sliding_window:
            raise UnsupportedModelError("sliding_window", f"the {backend.name!r} attention "
                                        "backend does not implement sliding-window attention "
                                        "(use attention_backend torch or cpu)")
        if any(a.softcap is not None for a in attn) and not backend.supports_logit_softcap:
            raise UnsupportedModelError("attn_logit_softcapping", f"the {backend.name!r} "
                                        "attention backend does not implement attention logit "
                                        "soft-capping (use attention_backend torch or cpu)")

    @property
    def uses_prompt_lens(self) -> bool:
        """Whether :meth:`forward` reads ``meta.prompt_lens_cpu`` (``longrope``,
        ``dynamic``)."""
        s = self.cfg.rope_scaling
        return s is not None and s.rope_type in ("longrope", "dynamic")

    def _rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [T] int64, table [R, D] float32)``: the RoPE table the global
        layers read this step and each token's row in it. ``dynamic``: see
        :meth:`_dynamic_ntk_rows`; otherwise ``self.cos_sin_cache`` and
        :meth:`_rope_positions`."""
        s = self.cfg.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            return self._dynamic_ntk_rows(positions, meta)
        return self._rope_positions(positions, meta), self.cos_sin_cache

    def _dynamic_ntk_rows(self, positions: torch.Tensor, meta: AttentionMetadata
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: the token at position ``p`` of a sequence whose prompt has
        ``P`` tokens rotates with the base of a ``max(P, p + 1)``-token context.

        That is what transformers' ``generate`` does for one sequence: its prefill
        forward's longest sequence (the prompt, ``P``) sets the base of every prompt
        token, and decode step ``p`` (context ``p + 1``) that of its one token; keys in
        the cache keep the rotation they were computed with. The rule depends only on
        the token, so chunked prefill, recompute after preemption and speculative
        decoding give the same rotations as one unchunked prefill and single-token
        decode steps. Tokens with ``max(P, p + 1) = p + 1`` (generated ones, and
        every token of a prompt within ``max_position_embeddings``, where the base is
        the config's) read ``self.cos_sin_cache`` row ``p``; the prompt tokens of a
        longer prompt get rows computed here for its length, and the step then reads
        a ``[T, D]`` table of its own tokens' rows (``rows = arange(T)``).

        Without ``meta.prompt_lens_cpu`` (callers other than the model runner: the
        fp8 KV-scale calibration, exact there; a draft model, whose chunks of a long
        prompt then rotate with their context's base) the context after the step
        stands for the prompt length."""
        s = self.cfg.rope_scaling
        prompt_lens = meta.prompt_lens_cpu or meta.seq_lens_cpu
        qsl = meta.query_start_loc_cpu
        m = s.original_max_position_embeddings
        long = [i for i in range(meta.num_seqs) if prompt_lens[i] > m
                and meta.seq_lens_cpu[i] - (qsl[i + 1] - qsl[i]) < prompt_lens[i] - 1]
        if not long:
            return positions, self.cos_sin_cache
        table = self.cos_sin_cache[positions]                    # [T, D]
        for i in long:
            pos = positions[qsl[i]:qsl[i + 1]]
            in_prompt = pos < prompt_lens[i]
            rows = dynamic_ntk_rows(self.cfg, pos[in_prompt], prompt_lens[i])
            table[qsl[i]:qsl[i + 1]][in_prompt] = rows
        return torch.arange(positions.numel(), device=positions.device), table

    def _rope_positions(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Rows of the RoPE table: ``positions``, except with ``longrope`` the tokens
        of a sequence whose prompt, or whose context after this step, is longer than
        ``original_max_position_embeddings`` read the long half of the table.

        transformers picks the long factors for a whole forward when its longest
        sequence passes the original context: for one sequence, its prompt in the
        prefill, its context in each decode step. Deciding per sequence by
        ``max(prompt, context)`` gives the same choice under chunked prefill and in
        any batch. (Blocks from the prefix cache keep the factors they were computed
        with: a prompt within the original context that shares a prefix with a longer
        one reads K rotated with the long factors.)"""
        s = self.cfg.rope_scaling
        if s is None or s.rope_type != "longrope":
            return positions
        lens = meta.seq_lens_cpu
        if meta.prompt_lens_cpu is not None:
            lens = [max(a, b) for a, b in zip(lens, meta.prompt_lens_cpu)]
        long = torch.tensor(lens) > s.original_max_position_embeddings
        if not bool(long.any()):
            return positions
        qsl = meta.query_start_loc_cpu
        counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)])
        offset = torch.repeat_interleave(long.long(), counts) * self.cfg.max_model_len
        return positions + offset.to(positions.device)

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

        Raises:
            UnsupportedModelError: ``backend`` lacks a feature the model uses
                (:meth:`check_backend`).
        """
        self.check_backend(backend)
        h = self.model.embed_tokens(input_ids)                   # [T, H]
        if self.scale_embeddings:
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        rope_rows, rope_table = self._rope_rows(positions, meta)
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
            attn = layer.self_attn
            if attn.local_rope:
                h = attn.forward(h, positions, kv_caches[i, 0], kv_caches[i, 1], meta,
                                 backend, self.local_cos_sin_cache, k_scale, v_scale)
            else:
                h = attn.forward(h, rope_rows, kv_caches[i, 0], kv_caches[i, 1], meta,
                                 backend, rope_table, k_scale, v_scale)
            if layer.sandwich:
                h = backend.rms_norm(h, layer.post_attention_layernorm.weight,
                                     layer.post_attention_layernorm.eps)
                h, residual = backend.rms_norm(h, layer.pre_feedforward_layernorm.weight,
                                               layer.pre_feedforward_layernorm.eps, residual)
                h = layer.mlp.forward(h, backend)
                h = backend.rms_norm(h, layer.post_feedforward_layernorm.weight,
                                     layer.post_feedforward_layernorm.eps)
            else:
                h, residual = backend.rms_norm(h, layer.post_attention_layernorm.weight,
                                               layer.post_attention_layernorm.eps, residual)
                h = layer.mlp.forward(h, backend)
            if after_layer is not None:
                after_layer(i)
        h, _ = backend.rms_norm(h, self.model.norm.weight, self.model.norm.eps, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> float32 logits ``[N, V]`` (soft-capped to
        ``c * tanh(logits / c)`` with ``cfg.final_logit_softcapping``)."""
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:        # in the model dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
