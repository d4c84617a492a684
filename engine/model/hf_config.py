"""What a Hugging Face ``config.json`` asks for beyond the fields every registered
architecture reads: RoPE scaling, and the features Tandem refuses by name.

Torch-free (the config layer imports it). :func:`check_hf_features` is the one list
of refusals; docs/models.md has it as a table.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.model.registry import UnsupportedModelError

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope", "dynamic")
"""``RopeScaling.rope_type`` values (besides ``default``, no scaling) that
:mod:`tandem.engine.model.rotary` implements as transformers defines them.
``dynamic`` (NTK) is decided per sequence and per token: a token rotates with the
base of the context transformers' ``generate`` would have when it computes it (the
prompt length for prompt tokens, its own position + 1 for generated ones), not
with transformers' state across calls (docs/models.md, "Dynamic NTK")."""

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""``hidden_act`` / ``hidden_activation`` values of the gated MLP: SwiGLU, and
Gemma's GeGLU with torch's tanh-approximated GELU."""

SOFTCAP_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""Architectures whose transformers implementation reads ``attn_logit_softcapping``
and ``final_logit_softcapping`` (set on any other, they are refused)."""

SLIDING_WINDOW_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
"""Without ``layer_types``: every n-th layer is global, the others sliding (Gemma 2
alternates; Gemma 3's ``sliding_window_pattern`` defaults to 6)."""


WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
"""Architectures whose transformers implementation applies ``sliding_window`` to
every layer (ignoring ``layer_types`` and ``max_window_layers``)."""

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
"""Mixture-of-experts architectures (:class:`MoEConfig`; docs/models.md)."""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts decoder's feed-forward layers, as transformers builds them.

    Attributes:
        num_experts: routed experts per MoE layer (``num_local_experts`` /
            ``num_experts``).
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: each expert's FFN width (Mixtral: ``intermediate_size``).
        norm_topk_prob: the top-k probabilities are divided by their sum (Mixtral
            always; Qwen's ``norm_topk_prob``).
        topk_weights_float32: the routing weights multiply the experts' outputs in
            float32 (Mixtral keeps the softmax's float32 values); otherwise they are
            cast to the model dtype first (Qwen2/3-MoE).
        sparse_layers: per layer, whether its MLP is the MoE block (Qwen's
            ``mlp_only_layers`` and ``decoder_sparse_step`` make some layers dense,
            with ``intermediate_size``).
        shared_expert_intermediate_size: width of Qwen2-MoE's shared expert (run on
            every token, scaled by ``sigmoid(shared_expert_gate(x))``); 0: none.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    topk_weights_float32: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))


def hf_moe_config(cfg: dict, architecture: str | None) -> MoEConfig | None:
    """The :class:`MoEConfig` of a config.json of a :data:`MOE_ARCHITECTURES` model
    (None for any other architecture), as transformers reads it.

    Raises:
        UnsupportedModelError: ``num_experts`` / ``num_local_experts`` below 1,
            ``num_experts_per_tok`` outside ``1..num_experts``, ``decoder_sparse_step``
            below 1, ``shared_expert_intermediate_size`` below 1 (Qwen2-MoE),
            or ``qkv_bias`` false (Qwen2-MoE: only biased Q/K/V are implemented).
    """
    if architecture not in MOE_ARCHITECTURES:
        return None
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    num_experts = cfg.get(key)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise UnsupportedModelError(key, f"{num_experts!r} experts: needs at least 1")
    top_k = cfg.get("num_experts_per_tok", 2)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise UnsupportedModelError("num_experts_per_tok", f"{top_k!r} experts per token, "
                                    f"expected 1..{num_experts}")
    n = cfg["num_hidden_layers"]
    if architecture == "MixtralForCausalLM":
        return MoEConfig(num_experts, top_k, cfg["intermediate_size"], norm_topk_prob=True,
                         topk_weights_float32=True, sparse_layers=(True,) * n)
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise UnsupportedModelError("decoder_sparse_step", f"{step!r}: needs at least 1")
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = cfg.get("shared_expert_intermediate_size", 5632)
        if not isinstance(shared, int) or shared < 1:
            raise UnsupportedModelError("shared_expert_intermediate_size",
                                        f"{shared!r}: Qwen2-MoE's shared expert needs a width")
        if not cfg.get("qkv_bias", True):
            raise UnsupportedModelError("qkv_bias", "Qwen2-MoE without Q/K/V biases is not "
                                        "supported")
    return MoEConfig(num_experts, top_k, cfg["moe_intermediate_size"],
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     topk_weights_float32=False, sparse_layers=sparse,
                     shared_expert_intermediate_size=shared)


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (``rope_parameters`` / ``rope_scaling`` in its
    config.json), as transformers' ``ROPE_INIT_FUNCTIONS`` read it.

    Attributes:
        rope_type: one of :data:`ROPE_SCALING_TYPES`.
        factor: the context extension factor (``linear``: positions divided by it).
        original_max_position_embeddings: the pre-training context (``llama3``, ``yarn``,
            ``longrope``; ``dynamic``: the config's ``max_position_embeddings``, the
            context beyond which transformers grows the base).
        low_freq_factor, high_freq_factor: ``llama3``'s wavelength band edges.
        beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate:
            ``yarn``'s ramp bounds (rotations), cos/sin scale (None: from ``factor``,
            ``mscale``, ``mscale_all_dim``) and whether the ramp bounds are rounded.
            ``longrope`` uses ``attention_factor`` too (None: from ``factor``).
        short_factor, long_factor: ``longrope``'s ``D/2`` per-frequency divisors for
            sequences up to ``original_max_position_embeddings`` tokens, and longer.
        freq_factors: ``llama3``'s ``D/2`` per-frequency divisors as a GGUF file
            holds them (llama.cpp's ``rope_freqs`` tensor, which the converter
            computes from the band parameters); when set they replace the band
            computation, whose parameters the file does not keep. Not a config.json key.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor", "freq_factors"):   # JSON gives lists back
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))


def hf_rope_dict(cfg: dict) -> tuple[str, dict]:
    """``(field name, dict)`` of a config.json's RoPE parameters: transformers >= 5
    writes ``rope_parameters``, older versions ``rope_scaling`` (null when unscaled)."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key):
            return key, cfg[key]
    return "rope_parameters", {}


@dataclass(frozen=True)
class HFFeatures:
    """What :func:`check_hf_features` reads from a config.json beyond the geometry.

    Attributes:
        rope_scaling: the (global layers') RoPE scaling, or None.
        rope_theta: the (global layers') RoPE base, or None (the caller's default).
        rope_local_theta: the RoPE base of sliding-window layers when it differs
            (Gemma 3's ``rope_local_base_freq``), else None.
        layer_windows: per layer, its sliding window in tokens or None (full
            attention); empty when no layer has a window that can bind.
        hidden_act: one of :data:`ACTIVATIONS`.
        attn_logit_softcapping, final_logit_softcapping: Gemma 2's caps, or None.
        moe: the mixture-of-experts layers (:func:`hf_moe_config`), or None.
        max_model_len: the context the model serves when it is not
            ``max_position_embeddings``: with ``dynamic`` RoPE scaling,
            ``max_position_embeddings * factor`` (vLLM's rule); else None.
    """

    rope_scaling: RopeScaling | None = None
    rope_theta: float | None = None
    rope_local_theta: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoEConfig | None = None
    max_model_len: int | None = None


def check_hf_features(cfg: dict, architecture: str | None = None) -> HFFeatures:
    """Refuse a config.json field whose feature ``architecture`` (the registered
    name) does not implement, naming it; return the features it does.

    Checked: ``hidden_act`` / ``hidden_activation`` (:data:`ACTIVATIONS`),
    ``rope_parameters`` / ``rope_scaling`` type (:data:`ROPE_SCALING_TYPES`; per
    layer type only ``sliding_attention`` / ``full_attention``, the sliding one
    unscaled) and ``partial_rotary_factor``, ``layer_types`` (``full_attention`` and
    ``sliding_attention`` only), ``attn_logit_softcapping`` /
    ``final_logit_softcapping`` (:data:`SOFTCAP_ARCHITECTURES` only), ``mlp_bias``,
    and the mixture-of-experts fields (:func:`hf_moe_config`).

    Raises:
        UnsupportedModelError: the first such field found.
    """
    acts = [cfg[k] for k in ("hidden_activation", "hidden_act") if cfg.get(k) is not None]
    for key in ("hidden_act", "hidden_activation"):
        if cfg.get(key) is not None and cfg[key] not in ACTIVATIONS:
            raise UnsupportedModelError(key, f"activation {cfg[key]!r} is not supported "
                                        f"({', '.join(ACTIVATIONS)})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None and architecture not in SOFTCAP_ARCHITECTURES:
            raise UnsupportedModelError(key, f"soft-capping ({cfg[key]}) is not supported "
                                        f"for {architecture}")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias", "biases in the MLP are not supported")
    moe = hf_moe_config(cfg, architecture)
    windows = hf_layer_windows(cfg, architecture)
    key, rope = hf_rope_dict(cfg)
    local_theta = cfg.get("rope_local_base_freq")
    if any(isinstance(v, dict) for v in rope.values()):
        other = sorted(set(rope) - {"full_attention", "sliding_attention"})
        if other:
            raise UnsupportedModelError(key, f"RoPE parameters for layer types {other} are "
                                        "not supported")
        local = rope.get("sliding_attention") or {}
        if (local.get("rope_type") or local.get("type") or "default") != "default":
            raise UnsupportedModelError(f"{key}.sliding_attention.rope_type", "RoPE scaling "
                                        "of sliding-window layers is not supported")
        local_theta = local.get("rope_theta", local_theta)
        key, rope = f"{key}.full_attention", rope.get("full_attention") or {}
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError("partial_rotary_factor",
                                    f"partial rotary embedding ({partial}) is not supported")
    theta = cfg.get("rope_theta") or rope.get("rope_theta")
    scaling = _rope_scaling(cfg, key, rope)
    max_model_len = None
    if scaling is not None and scaling.rope_type == "dynamic":
        max_model_len = int(scaling.original_max_position_embeddings * scaling.factor)
    return HFFeatures(
        max_model_len=max_model_len,
        rope_scaling=scaling, rope_theta=theta,
        rope_local_theta=float(local_theta) if local_theta is not None and windows else None,
        layer_windows=windows, hidden_act=acts[0] if acts else "silu",
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"), moe=moe)


def hf_layer_windows(cfg: dict, architecture: str | None = None) -> tuple[int | None, ...]:
    """Per layer, its sliding window (tokens) or None, as transformers builds the
    masks: Mistral, Mixtral and Qwen3-MoE window every layer
    (:data:`WINDOW_EVERY_LAYER`: they ignore ``layer_types``); otherwise
    ``layer_types`` says which layers slide, else Qwen2-MoE's rule (even-indexed
    layers below ``max_window_layers``), else Qwen2's ``max_window_layers``
    (layers from that index on), else :data:`SLIDING_WINDOW_PATTERNS`, else all.
    ``use_sliding_window: false`` or a null window turns windows off. Empty when no
    layer has a window. A window at least ``max_position_embeddings`` long is kept
    (the layer's type still decides its RoPE base in Gemma 3); the attention layer
    ignores it, since it cannot bind.

    Raises:
        UnsupportedModelError: a ``layer_types`` entry other than ``full_attention``
            and ``sliding_attention`` (field ``layer_types``); a window below 1.
    """
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise UnsupportedModelError("layer_types", f"layers of type {', '.join(other)} are not "
                                    "supported (full_attention, sliding_attention)")
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return ()
    if window < 1:
        raise UnsupportedModelError("sliding_window", f"a window of {window} tokens")
    if architecture in WINDOW_EVERY_LAYER:
        sliding = [True] * n
    elif layer_types:
        if len(layer_types) != n:
            raise UnsupportedModelError("layer_types", f"{len(layer_types)} entries for {n} "
                                        "layers")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif architecture == "Qwen2MoeForCausalLM":      # Qwen2MoeConfig's layer_types default
        sliding = [bool((i + 1) % 2) and i < cfg.get("max_window_layers", 28) for i in range(n)]
    elif "max_window_layers" in cfg:
        sliding = [i >= cfg["max_window_layers"] for i in range(n)]
    elif architecture in SLIDING_WINDOW_PATTERNS:
        every = cfg.get("sliding_window_pattern", SLIDING_WINDOW_PATTERNS[architecture])
        sliding = [bool((i + 1) % every) for i in range(n)]
    else:
        sliding = [True] * n
    if not any(sliding):
        return ()
    return tuple(int(window) if s else None for s in sliding)


def _rope_scaling(cfg: dict, key: str, rope: dict) -> RopeScaling | None:
    """The :class:`RopeScaling` of one RoPE parameter dict (``key`` names it in errors)."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(f"{key}.rope_type", f"RoPE scaling {rope_type!r} is not "
                                    f"supported (default, {', '.join(ROPE_SCALING_TYPES)})")

    def num(name: str, required: bool = True):
        if rope.get(name) is None:
            if required:
                raise UnsupportedModelError(f"{key}.{name}", f"RoPE scaling {rope_type!r} "
                                            "needs it")
            return None
        return rope[name]

    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor")
    if rope_type == "longrope":
        original = original or cfg.get("original_max_position_embeddings")
        if not original:
            raise UnsupportedModelError(f"{key}.original_max_position_embeddings",
                                        "RoPE scaling 'longrope' needs it")
        if factor is None:      # as transformers: the context extension ratio
            factor = cfg.get("max_position_embeddings", 2048) / original
        return RopeScaling("longrope", float(factor), int(original),
                           attention_factor=num("attention_factor", False),
                           short_factor=tuple(map(float, num("short_factor"))),
                           long_factor=tuple(map(float, num("long_factor"))))
    if rope_type == "dynamic":
        if factor is None:
            raise UnsupportedModelError(f"{key}.factor", "RoPE scaling 'dynamic' needs it")
        # transformers reads max_position_embeddings (not original_...) as the context
        # up to which the base is the config's
        return RopeScaling("dynamic", float(factor),
                           int(cfg.get("max_position_embeddings", 2048)))
    if rope_type == "yarn" and factor is None and original:
        factor = cfg.get("max_position_embeddings", 2048) / original
    if factor is None:
        raise UnsupportedModelError(f"{key}.factor", f"RoPE scaling {rope_type!r} needs it")
    if rope_type == "llama3" and rope.get("freq_factors") is not None:    # from a GGUF file
        return RopeScaling("llama3", float(factor),
                           freq_factors=tuple(map(float, rope["freq_factors"])))
    if rope_type == "llama3":
        return RopeScaling("llama3", float(factor), int(num("original_max_position_embeddings")),
                           low_freq_factor=float(num("low_freq_factor")),
                           high_freq_factor=float(num("high_freq_factor")))
    if rope_type == "yarn":
        return RopeScaling("yarn", float(factor), int(num("original_max_position_embeddings")),
                           beta_fast=num("beta_fast", False), beta_slow=num("beta_slow", False),
                           attention_factor=num("attention_factor", False),
                           mscale=num("mscale", False), mscale_all_dim=num("mscale_all_dim", False),
                           truncate=bool(rope.get("truncate", True)))
    return RopeScaling("linear", float(factor))
