"""Qwen2 / Qwen2.5 and Qwen3 (dense): the shared decoder
(:mod:`tandem.engine.model.layers`) wired as their checkpoints define it."""

from __future__ import annotations

from tandem.engine.config import ModelConfig
from tandem.engine.model.layers import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: biases on Q, K and V (always; none on the output
    projection), as transformers' ``Qwen2Attention``. With ``use_sliding_window``
    the layers from ``max_window_layers`` on (``layer_types``) attend within
    ``sliding_window`` tokens. Tensor parallelism: the Q/K/V biases split with
    their heads' rows."""

    supports_tensor_parallel = True

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": True}


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense): per-head RMSNorm of Q and K before RoPE (``q_norm`` /
    ``k_norm``, weight ``[D]``); ``attention_bias`` on all four projections.
    Tensor parallelism: the norms act within a head, so every rank applies the
    whole (replicated) ``[D]`` weights to its own heads."""

    supports_tensor_parallel = True

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": True}
