"""Phi-3 (mini, small context and 128k ``longrope`` variants of the ``Phi3`` layout):
the shared decoder (:mod:`tandem.engine.model.layers`). Its checkpoints store the
projections already fused (``qkv_proj``, ``gate_up_proj``, in the order the shared
layers use), so they load whole; ``longrope`` RoPE scaling comes from the config
(:mod:`tandem.engine.model.rotary`)."""

from __future__ import annotations

from tandem.engine.model.layers import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3: Llama's computation, no biases, fused Q/K/V and gate/up tensors.
    Tensor parallelism: a fused checkpoint tensor is cut into its Q, K, V (gate,
    up) rows first and each is sliced by the rank's heads (features)
    (:class:`~tandem.engine.parallel.layers.ColumnParallelLinear`)."""

    supports_tensor_parallel = True
