"""Gemma 2 and Gemma 3 (text): the shared decoder (:mod:`tandem.engine.model.layers`)
with Gemma's options: embeddings scaled by ``sqrt(H)``, ``(1 + w)`` RMSNorms,
sandwich norms around attention and MLP, GeGLU (``hidden_activation``
``gelu_pytorch_tanh``, from the config), the attention scale from
``query_pre_attn_scalar``, interleaved sliding-window and global layers
(``layer_types``), and, from the config too, Gemma 2's attention and final logit
soft-capping and Gemma 3's local RoPE base for its sliding layers."""

from __future__ import annotations

from tandem.engine.config import ModelConfig
from tandem.engine.model.layers import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2: ``attention_bias`` on all four attention projections. Tensor
    parallelism (Gemma 3 too): the embedding scale follows the vocabulary-parallel
    lookup's all-reduce, norms are replicated, GeGLU acts on each rank's features,
    soft-capping runs per head and, on the gathered logits, on rank 0."""

    supports_tensor_parallel = True
    scale_embeddings = True
    norm_offset = True
    sandwich_norms = True

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text-only ``Gemma3ForCausalLM``): Gemma 2's layout plus per-head
    ``(1 + w)`` RMSNorms of Q and K before RoPE; sliding layers rotate with
    ``rope_local_base_freq`` (unscaled), global ones with ``rope_theta`` and the
    RoPE scaling."""

    @classmethod
    def attention_options(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": True,
                "qk_norm_offset": True}
