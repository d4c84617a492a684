"""Llama and Mistral: the shared decoder (:mod:`tandem.engine.model.layers`) wired
as their checkpoints define it. :func:`tandem.engine.model.loader.load_model` builds
them (and every other registered architecture)."""

from __future__ import annotations

from tandem.engine.config import ModelConfig
from tandem.engine.model.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3.x (and the Llama-architecture checkpoints, SmolLM2 among them):
    ``attention_bias`` puts biases on all four attention projections (transformers'
    ``LlamaAttention``); RoPE scaling (``llama3``, ``linear``, ``yarn``) is the
    config's. Tensor parallelism: see :mod:`tandem.engine.model.layers`."""

    supports_tensor_parallel = True

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias}


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout without attention biases (transformers ignores
    ``attention_bias`` for it). A ``sliding_window`` applies to every layer (as
    transformers, which ignores ``layer_types`` for Mistral;
    :func:`~tandem.engine.model.hf_config.hf_layer_windows`)."""

    supports_tensor_parallel = True
