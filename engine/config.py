"""Configuration: one validated dataclass per concern, built once at the edge.

``ModelConfig`` is our own description of a decoder-only model of a registered
architecture (:mod:`tandem.engine.model.registry`); it is converted once from GGUF
metadata or a Hugging Face ``config.json``, refusing any field whose feature the
implementation lacks, and model code never sees Hugging Face objects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.model.hf_config import MoEConfig, RopeScaling, check_hf_features
from tandem.engine.model.registry import MODEL_REGISTRY, UnsupportedModelError


if TYPE_CHECKING:
    import torch

# Names only: torch is imported where a dtype object is needed, so the
# scheduling layers (which import this module for their configs) stay torch-free.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_dtype_name(name: str) -> str:
    """Validate a dtype name without importing torch; returns it.

    Raises:
        ValueError: not one of :data:`DTYPE_NAMES`.
    """
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return name


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int4")
"""``CacheConfig.kv_cache_dtype`` names: ``auto`` stores K/V in the model dtype;
``fp8_e4m3`` stores them as ``torch.float8_e4m3fn`` (1 byte per element) with
per-(layer, KV head) float32 scales calibrated at engine start (see
:mod:`tandem.engine.runtime.kv_scales`); ``int4`` stores packed 4-bit rows after
KIVI, K per channel over each block's tokens and V per token (48 bytes per token
and KV head at head dim 64 and blocks of 16; see :mod:`tandem.kernels.int4_kv`)."""


def parse_dtype(name: str) -> "torch.dtype":
    """``"float32" | "bfloat16" | "float16"`` -> torch dtype (imports torch).

    Raises:
        ValueError: another name.
    """
    import torch

    return getattr(torch, check_dtype_name(name))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model of a registered architecture.

    Attributes:
        hidden_size, intermediate_size: model and FFN widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention geometry (GQA when
            num_kv_heads < num_heads).
        vocab_size: rows of the embedding.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE frequency base (GGUF ``rope.freq_base``).
        max_model_len: maximum context in tokens (prompt + output).
        tie_word_embeddings: lm_head shares the embedding matrix.
        bos_token_id, eos_token_id: special ids from the model file.
        architecture: the registered architecture name
            (:data:`~tandem.engine.model.registry.MODEL_REGISTRY`), e.g.
            ``Qwen3ForCausalLM``; it decides the model class.
        attention_bias: the checkpoint's ``attention_bias`` (biases on the Q/K/V
            and output projections, for the architectures that read it; Qwen2 has
            Q/K/V biases whatever it says).
        rope_scaling: the RoPE scaling, or None (plain RoPE); of the global layers
            when ``rope_local_theta`` is set.
        rope_local_theta: the RoPE base of the sliding-window layers, unscaled (Gemma
            3's local base), or None (every layer uses ``rope_theta``/``rope_scaling``).
        layer_windows: per layer, its sliding window in tokens (a query at position
            ``p`` sees keys ``p - w + 1 .. p``) or None for full attention; empty:
            no layer has a window. A window of ``max_model_len`` or more never binds
            (the layer attends fully) but still marks a sliding layer.
        hidden_act: the gated MLP's activation, ``silu`` or ``gelu_pytorch_tanh``.
        attn_logit_softcapping: attention scores capped to ``c * tanh(s / c)``
            before the softmax (Gemma 2), or None.
        final_logit_softcapping: the same on the output logits, or None.
        query_pre_attn_scalar: the softmax scale is ``query_pre_attn_scalar ** -0.5``
            instead of ``head_dim ** -0.5`` (Gemma), or None.
        moe: the mixture-of-experts layers (Mixtral, Qwen2/3-MoE), or None (dense).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if isinstance(self.rope_scaling, dict):     # read back from JSON (the GGUF cache)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows: {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")
        MODEL_REGISTRY.info(self.architecture)

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (tokens), or None for full attention."""
        return self.layer_windows[i] if self.layer_windows else None

    def check_plain_llama(self, who: str) -> None:
        """Refuse a model that is not numerically a plain Llama (a Llama or Mistral
        without attention biases or RoPE scaling), for code that has only a Llama
        forward of its own (``who``: the offline quantizers).

        Raises:
            UnsupportedModelError: naming ``architectures``, ``attention_bias`` or
                ``rope_scaling``.
        """
        if self.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
            raise UnsupportedModelError("architectures", f"{who} handles Llama-layout models "
                                        f"only, not {self.architecture}")
        self.check_plain_attention(who)

    def check_plain_attention(self, who: str, allow_bias: bool = False) -> None:
        """Refuse a model whose attention is not Llama's (biases, RoPE scaling, a
        sliding window), for ``who``'s own Llama attention (an MoE model's check,
        whose feed-forward ``who`` computes separately); ``allow_bias``: ``who``
        adds q/k/v biases itself.

        Raises:
            UnsupportedModelError: naming ``attention_bias``, ``rope_scaling`` or
                ``sliding_window``.
        """
        if self.attention_bias and not allow_bias:
            raise UnsupportedModelError("attention_bias", f"{who} does not handle attention "
                                        "biases")
        if self.rope_scaling is not None:
            raise UnsupportedModelError("rope_scaling", f"{who} does not handle RoPE scaling "
                                        f"{self.rope_scaling.rope_type!r}")
        if any(w is not None and w < self.max_model_len for w in self.layer_windows):
            raise UnsupportedModelError("sliding_window", f"{who} does not handle "
                                        "sliding-window attention")

    @classmethod
    def from_gguf_fields(cls, fields: dict, has_output_weight: bool,
                         tensor_names: tuple[str, ...] | None = None,
                         rope_factors: dict[str, list[float]] | None = None) -> "ModelConfig":
        """From GGUF key/values (``{"llama.block_count": 30, ...}``), through the
        ``config.json`` they were converted from
        (:func:`~tandem.engine.model.gguf_config.hf_config_from_gguf`) and
        :meth:`from_hf_dict`, so both formats are refused alike.

        Args:
            has_output_weight: the file has ``output.weight`` (else the output
                projection is tied to the embedding).
            tensor_names: the file's tensor names (Q/K/V biases are told by them);
                None: only ``output.weight`` as ``has_output_weight`` says.
            rope_factors: Phi-3's ``rope_factors_long.weight`` /
                ``rope_factors_short.weight`` values, when the file has them.

        Raises:
            UnsupportedModelError: an architecture the GGUF reader does not map
                (field ``general.architecture``), a GGUF key whose feature is not
                served (named by key, e.g. ``{arch}.rope.scaling.type``), or a
                config field :meth:`from_hf_dict` refuses.
            ValueError: a required key missing.
        """
        from tandem.engine.model.gguf_config import hf_config_from_gguf

        names = set(tensor_names or ()) | ({"output.weight"} if has_output_weight else set())
        if not has_output_weight:
            names.discard("output.weight")
        return cls.from_hf_dict(hf_config_from_gguf(fields, names, rope_factors))

    @classmethod
    def from_hf_config(cls, path: str) -> "ModelConfig":
        """From a Hugging Face checkpoint directory's ``config.json``.

        The architecture is resolved through the model registry; every field whose
        feature Tandem does not implement is refused
        (:func:`~tandem.engine.model.hf_config.check_hf_features`).

        Raises:
            UnsupportedModelError: an unregistered architecture or a feature not
                implemented; its ``field`` names the config field.
            ValueError: a required field missing.
        """
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return cls.from_hf_dict(cfg)

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """:meth:`from_hf_config` on an already parsed ``config.json`` (same errors)."""
        architecture = MODEL_REGISTRY.resolve_hf(cfg)
        features = check_hf_features(cfg, architecture)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            # transformers >= 5 writes the base inside "rope_parameters" only.
            rope_theta=features.rope_theta or 10000.0,
            max_model_len=features.max_model_len or cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            architecture=architecture,
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=features.rope_scaling,
            rope_local_theta=features.rope_local_theta,
            layer_windows=features.layer_windows,
            hidden_act=features.hidden_act,
            attn_logit_softcapping=features.attn_logit_softcapping,
            final_logit_softcapping=features.final_logit_softcapping,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar")
            if architecture in _QUERY_PRE_ATTN_SCALAR else None,
            moe=features.moe,
        )


# The architectures whose attention scale transformers takes from query_pre_attn_scalar.
_QUERY_PRE_ATTN_SCALAR = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool; None sizes the pool from ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: memory for K and V of all layers when num_blocks is None
            (with ``int4``, the open-block K store for ``max_num_seqs`` sequences
            included).
        enable_prefix_caching: reuse full blocks across requests by block hash.
        swap_space_bytes: host memory for the blocks of swapped-out requests
            (pinned when the device is CUDA), when ``num_host_blocks`` is None.
            Not allocated when the preemption mode is ``recompute``.
        num_host_blocks: host blocks for swapped-out requests; None sizes the
            host pool from ``swap_space_bytes``; 0 disables swapping.
        kv_cache_dtype: element type of the K and V caches (device and host pool),
            one of :data:`KV_CACHE_DTYPES`: ``auto`` (the model dtype) or
            ``fp8_e4m3`` (``torch.float8_e4m3fn``, one byte per element: twice the
            blocks of bfloat16 in the same ``kv_cache_memory_bytes``, four times
            those of float32; K and V quantized with fixed per-(layer, KV head)
            scales calibrated at engine start) or ``int4`` (48 bytes per token and
            head at head dim 64 and blocks of 16: 2.7x the blocks of bfloat16; K
            per channel, V per token, after KIVI; no speculative decoding).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 1 << 30
    num_host_blocks: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes: must be >= 0, got {self.swap_space_bytes}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks: must be >= 0, got {self.num_host_blocks}")


PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: sequences in one step's batch.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        enable_chunked_prefill: split prompts longer than the remaining budget
            across steps; when off, a prompt is scheduled whole or not at all
            (and the budget grows to fit one max-length prompt).
        preemption_mode: how a request preempted for lack of KV blocks gives
            them up (see :mod:`tandem.engine.scheduling.preemption`): ``swap`` (copy its
            blocks to the host pool; recompute when the host pool is full),
            ``recompute`` (free its blocks, prefill it again later) or ``auto``
            (per request, the cheaper of the two by the cost model below).
        recompute_tokens_per_s: the cost model's prefill speed (tokens/s): a
            recompute costs ``tokens to recompute / recompute_tokens_per_s``.
        swap_bytes_per_s: the cost model's device<->host copy speed (bytes/s):
            a swap costs ``bytes out and back in / swap_bytes_per_s``.
        burst_prefill_tokens: how a burst of new prompts is split over steps
            (tokens per decoding sequence; None: not split, only the token budget
            limits a step). A step that already holds prompt tokens admits
            another new prompt only while its prompt tokens stay within
            ``burst_prefill_tokens x (the step's decoding sequences + 1)``. With
            few sequences decoding, a step is cheap to repeat: the burst's first
            prompts get their first token a step sooner instead of waiting for the
            whole burst's prefill. With many, every extra step holds them all
            back, and the burst goes in as the budget allows. A prompt alone is
            never held back, a prompt is never cut by this rule (only by the
            budget), and a burst whose prompt tokens exceed two steps' budgets is
            left to the budget, which spreads it over steps already.

    The two speeds' defaults were measured for the default model in float32 on
    a 2-core CPU by ``benchmarks/kv_pressure.py`` (it prints both: 730 tokens/s
    prefilling a 512-token prompt, 2.5 GB/s swapping 64 blocks out and in).
    Only their ratio matters; with it, swapping wins for any request whose KV
    is not mostly a shared cached prefix. Set them for other devices.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    recompute_tokens_per_s: float = 700.0
    swap_bytes_per_s: float = 2.5e9
    burst_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.burst_prefill_tokens is not None and self.burst_prefill_tokens < 1:
            raise ValueError(f"burst_prefill_tokens: must be >= 1 or None, "
                             f"got {self.burst_prefill_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: unknown {self.preemption_mode!r}, "
                             f"expected one of {', '.join(PREEMPTION_MODES)}")
        if not self.recompute_tokens_per_s > 0 or not self.swap_bytes_per_s > 0:
            raise ValueError("recompute_tokens_per_s and swap_bytes_per_s: must be > 0")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts ``num_speculative_tokens`` tokens per
    running request and the target verifies them in its next decode step, with
    exact rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023), so
    outputs keep the target's distribution (greedy: the target's exact tokens).
    See :mod:`tandem.engine.spec_decode`.

    Attributes:
        method: a key of :data:`tandem.engine.spec_decode.PROPOSERS`: ``ngram``
            (prompt lookup: the tokens that followed the longest earlier match of
            the sequence's suffix, in prompt + output) or ``draft_model`` (a smaller
            model with the same tokenizer, run autoregressively on the same worker).
        num_speculative_tokens: draft tokens per request and step (``k``), >= 1.
        prompt_lookup_min, prompt_lookup_max: ``ngram``: the suffix lengths
            (tokens) tried, longest first.
        draft_model: ``draft_model``: a .gguf file or checkpoint directory; None
            means the target's own model (self-drafting, which accepts every
            draft: a check, and the upper bound of acceptance).
        draft_num_blocks: KV blocks of the draft model's own paged cache (None:
            as many as the target's); a request whose draft KV does not fit gets no
            draft in that step.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft_model: str | None = None
    draft_num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method: unknown speculative method {self.method!r}, "
                             f"expected one of {', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens: must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min, prompt_lookup_max: need 1 <= min <= max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.draft_num_blocks is not None and self.draft_num_blocks < 1:
            raise ValueError(f"draft_num_blocks: must be >= 1, got {self.draft_num_blocks}")


#: ``EngineConfig.activation_quantization`` values.
ACTIVATION_QUANTIZATIONS = ("none", "int8")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; built once at the edge (CLI, gRPC, tests).

    Attributes:
        model: None (the default model), a .gguf path, or a checkpoint directory.
        dtype: weights and activations dtype name (and the KV cache's, unless
            ``cache.kv_cache_dtype`` says otherwise).
        device: ``"cpu"`` or ``"cuda[:N]"``.
        attention_backend: ``auto``, ``torch``, ``cpu`` (compiled CPU kernels) or
            ``triton``.
        quantization: the linear layers' weight format, a key of
            :data:`tandem.engine.quantization.registry.LINEAR_METHODS` (``none``: dense, in
            ``dtype``). A checkpoint whose config.json has a ``quantization_config``
            (GPTQ, AWQ) is loaded with its own method when this is ``none``.
        max_model_len: cap on the context length (None = the model's).
        num_threads: torch intra-op threads of the process running this engine
            (None = leave as is); applied by the process's entry point with
            :func:`tandem.engine.runtime.threads.apply_thread_settings`, never by the engine.
        batch_invariant: compute every token the same way whatever else is batched
            (CPU; float32 or bfloat16; the ``auto``/``cpu`` attention backend): linear
            layers through the batch-invariant kernel of
            :func:`tandem.kernels.cpu.linear.invariant_linear`, and attention of every
            query token (prefill chunks too) through the paged decode kernel, one
            fixed-order pass over its cached context. A request's tokens then do not
            depend on batch composition, chunking, prefix-cache hits or preemption
            (see docs/batch_invariance.md).
        small_batch_linear: bfloat16 on a CPU with AMX: dense linear layers also keep
            their weight in 16-column panels, and inputs of at most 1280 rows (decode
            steps and most prompts) multiply on AMX tiles reading it
            (:func:`tandem.kernels.cpu.linear.amx_linear`, 1.05-1.3x oneDNN's speed
            there, and no oneDNN primitive to create for a token count new to the
            process; ``TANDEM_AMX_LINEAR_MAX_ROWS`` in the environment moves the
            bound); longer inputs keep oneDNN. On an AVX-512 BF16 CPU without AMX the
            same copy serves inputs of at most 256 rows through
            :func:`tandem.kernels.cpu.linear.dpbf16_linear` (1.3-1.7x oneDNN's speed at
            1-16 rows; ``TANDEM_DPBF16_LINEAR_MAX_ROWS`` moves that bound). float32 on
            an AVX-512F CPU: inputs of at most 1024 rows through
            :func:`tandem.kernels.cpu.linear.avx512_f32_linear` from a float32 panel
            copy (``TANDEM_AVX512_F32_LINEAR_MAX_ROWS``). Costs a second copy of
            those weights. None (default): on while that copy takes at most a tenth
            of the machine's memory; True / False: on / off. Nothing elsewhere (GPUs,
            quantized layers, CPUs without AVX-512, ``batch_invariant``).
        speculative: speculative decoding (:class:`SpeculativeConfig`); None: off.
            Only decode steps speculate: a prefill worker ignores it.
        activation_quantization: ``none``: quantized linear layers multiply the
            activations as they are (the values of dequantize-then-matmul); ``int8``
            (CPU): decode-sized products quantize each 32-value chunk of the
            activations to int8 and multiply in integers (AVX-512 VNNI / AVX2), as
            llama.cpp's CPU backend does. Needs weights kept in quantized blocks
            (``quantization`` gguf, or a GPTQ / AWQ checkpoint); see
            docs/quantization.md.
        tensor_parallel_size: ranks the model is sharded over (Megatron-LM's
            column/row split, :mod:`tandem.engine.parallel`): rank 0 runs in the
            engine's process with the scheduler and the sampler, ranks 1.. are
            worker processes (Gloo on the CPU, NCCL on CUDA); 1: no sharding. Above
            1 dense, GGUF, GPTQ and AWQ weights shard, the KV cache may be fp8 or
            int4, and speculative decoding runs; see docs/tensor_parallel.md.
        enable_expert_parallel: a mixture-of-experts model on ``tensor_parallel_size``
            ranks: False (vLLM's default) splits every expert's FFN width over the
            ranks, True spreads whole experts over them (expert parallelism). Ignored
            for a dense model or one rank.
        moe_dispatch: with ``enable_expert_parallel``, how the experts meet the
            tokens: ``all_reduce`` (every rank runs its experts' share of every
            token and one all-reduce sums the ranks' outputs) or ``all_to_all``
            (each rank's share of the tokens is dispatched to its experts' ranks and
            combined back by two all-to-alls, then all-gathered: bit-identical to
            one rank's expert layer); see docs/tensor_parallel.md.
    """

    model: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    attention_backend: str = "auto"
    quantization: str = "none"
    max_model_len: int | None = None
    num_threads: int | None = None
    batch_invariant: bool = False
    small_batch_linear: bool | None = None
    speculative: SpeculativeConfig | None = None
    activation_quantization: str = "none"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    moe_dispatch: str = "all_reduce"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        # The registries live with torch code: imported here, not at module level, so
        # that importing this module (the scheduler does) never loads torch.
        from tandem.engine.quantization.registry import LINEAR_METHODS
        from tandem.kernels.registry import ATTENTION_BACKENDS

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: unknown {self.attention_backend!r}, "
                             f"expected one of {', '.join(ATTENTION_BACKENDS)}")
        if self.quantization not in LINEAR_METHODS:
            raise ValueError(f"quantization: unknown {self.quantization!r}, "
                             f"expected one of {', '.join(LINEAR_METHODS)}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization: expected one of "
                             f"{', '.join(ACTIVATION_QUANTIZATIONS)}, got "
                             f"{self.activation_quantization!r}")
        if self.activation_quantization != "none" and not self.device.startswith("cpu"):
            raise ValueError(f"activation_quantization: {self.activation_quantization!r} runs on "
                             f"the CPU only, not {self.device!r}")
        if self.small_batch_linear not in (None, True, False):
            raise ValueError(f"small_batch_linear: expected None, True or False, got "
                             f"{self.small_batch_linear!r}")
        if self.batch_invariant:
            if not self.device.startswith("cpu"):
                raise ValueError(f"batch_invariant: runs on the CPU only, not {self.device!r}")
            if self.attention_backend not in ("auto", "cpu"):
                raise ValueError("batch_invariant: needs the compiled CPU kernels "
                                 f"(attention_backend auto or cpu), not {self.attention_backend!r}")
            if self.dtype not in ("float32", "bfloat16"):
                raise ValueError(f"batch_invariant: float32 or bfloat16, not {self.dtype!r}")
            if self.cache.kv_cache_dtype != "auto":
                raise ValueError("batch_invariant: needs kv_cache_dtype auto (the invariant "
                                 f"attention path has no {self.cache.kv_cache_dtype!r} KV cache)")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be an integer >= 1, "
                             f"got {self.tensor_parallel_size!r}")
        if self.moe_dispatch not in ("all_reduce", "all_to_all"):
            raise ValueError("moe_dispatch: expected all_reduce or all_to_all, "
                             f"got {self.moe_dispatch!r}")
        if self.moe_dispatch == "all_to_all" and not self.enable_expert_parallel:
            raise ValueError("moe_dispatch: all_to_all dispatches tokens to whole experts "
                             "spread over the ranks; it needs enable_expert_parallel")
        if self.cache.kv_cache_dtype == "int4" and self.speculative is not None:
            raise ValueError("speculative: not with kv_cache_dtype int4 (a rejected draft token "
                             "can complete a block, which is then quantized per channel with it)")

    @property
    def torch_dtype(self) -> "torch.dtype":
        """``dtype`` as a torch dtype (imports torch)."""
        return parse_dtype(self.dtype)
