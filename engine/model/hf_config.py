"""What a Hugging Face ``config.json`` asks for beyond the fields every registered
architecture reads: RoPE scaling, and the features Tandem refuses by name.

Torch-free (the config layer imports it). :func:`check_hf_features` is the one list
of refusals; docs/models.md has it as a table.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.model.registry import UnsupportedModelError

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
"""``RopeScaling.rope_type`` values (besides ``default``, no scaling) that
:mod:`tandem.engine.model.rotary` implements as transformers defines them. Not yet:
``dynamic`` (NTK scaling whose frequencies change with the running sequence length),
``longrope`` (Phi-3: short/long factor lists)."""


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (``rope_parameters`` / ``rope_scaling`` in its
    config.json), as transformers' ``ROPE_INIT_FUNCTIONS`` read it.

    Attributes:
        rope_type: one of :data:`ROPE_SCALING_TYPES`.
        factor: the context extension factor (``linear``: positions divided by it).
        original_max_position_embeddings: the pre-training context (``llama3``, ``yarn``).
        low_freq_factor, high_freq_factor: ``llama3``'s wavelength band edges.
        beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate:
            ``yarn``'s ramp bounds (rotations), cos/sin scale (None: from ``factor``,
            ``mscale``, ``mscale_all_dim``) and whether the ramp bounds are rounded.
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


def hf_rope_dict(cfg: dict) -> tuple[str, dict]:
    """``(field name, dict)`` of a config.json's RoPE parameters: transformers >= 5
    writes ``rope_parameters``, older versions ``rope_scaling`` (null when unscaled)."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key):
            return key, cfg[key]
    return "rope_parameters", {}


def check_hf_features(cfg: dict) -> RopeScaling | None:
    """Refuse a config.json field whose feature the registered architectures do not
    implement, naming it; return the RoPE scaling (None for plain RoPE).

    Checked: ``hidden_act`` (SiLU only), ``rope_parameters`` / ``rope_scaling`` type
    (:data:`ROPE_SCALING_TYPES`) and ``partial_rotary_factor``, ``sliding_window``
    (with ``use_sliding_window`` and ``layer_types``: any window that can bind),
    ``attn_logit_softcapping``, ``final_logit_softcapping``, ``mlp_bias``.

    Raises:
        UnsupportedModelError: the first such field found.
    """
    for key in ("hidden_act", "hidden_activation"):
        if cfg.get(key) not in (None, "silu"):
            raise UnsupportedModelError(key, f"activation {cfg[key]!r} is not supported "
                                        "(the gated MLP is SiLU-gated)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(key, f"soft-capping ({cfg[key]}) is not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias", "biases in the MLP are not supported")
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError("layer_types", f"layers of type {', '.join(other)} are not "
                                    "supported (full attention only)")
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True) and \
            window < cfg.get("max_position_embeddings", 2048):
        raise UnsupportedModelError("sliding_window", f"sliding-window attention (window "
                                    f"{window} tokens) is not supported yet")
    key, rope = hf_rope_dict(cfg)
    if any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError(key, "per-layer-type RoPE parameters are not supported")
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError("partial_rotary_factor",
                                    f"partial rotary embedding ({partial}) is not supported")
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
    if rope_type == "yarn" and factor is None and original:
        factor = cfg.get("max_position_embeddings", 2048) / original
    if factor is None:
        raise UnsupportedModelError(f"{key}.factor", f"RoPE scaling {rope_type!r} needs it")
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
