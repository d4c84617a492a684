"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE: the Qwen attention with
sparse mixture-of-experts MLPs (:mod:`tandem.engine.model.moe`)."""

from __future__ import annotations

from tandem.engine.config import ModelConfig
from tandem.engine.model.moe import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: Q/K/V biases (``qkv_bias``, true in every released checkpoint;
    false is refused); experts of width ``moe_intermediate_size``, top-k routing
    renormalised only with ``norm_topk_prob``, weights rounded to the model dtype;
    a shared expert on every token, scaled by ``sigmoid(shared_expert_gate(x))``.
    Layers in ``mlp_only_layers``, or off every ``decoder_sparse_step``-th, are dense."""

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": True}


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head Q/K RMSNorm, ``attention_bias``) and
    Qwen2-MoE's routing without the shared expert."""

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": True}
