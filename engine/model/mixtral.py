"""Mixtral: Mistral's attention with a sparse mixture-of-experts MLP in every layer
(:mod:`tandem.engine.model.moe`)."""

from __future__ import annotations

from tandem.engine.model.moe import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral (8x7B, 8x22B layout): no attention biases; ``num_local_experts``
    SwiGLU experts of width ``intermediate_size``, top-``num_experts_per_tok``
    routing with the weights always renormalised and kept in float32; a
    ``sliding_window`` applies to every layer. The checkpoint's block is
    ``block_sparse_moe`` with per-expert ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    expert_projections = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                          "w2": ("down_proj", 0)}
    checkpoint_block = "block_sparse_moe"
