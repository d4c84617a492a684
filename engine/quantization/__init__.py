"""Quantized weight formats: their linear methods and the quantizers that write them.

- :mod:`~tandem.engine.quantization.registry`: ``EngineConfig.quantization`` -> linear
  method; :mod:`~tandem.engine.quantization.checkpoint` picks a checkpoint's own
  method from its ``quantization_config``;
- :mod:`~tandem.engine.quantization.gguf_linear`: ``gguf``, a GGUF file's blocks kept
  packed; :mod:`~tandem.engine.quantization.gguf_writer` rewrites a GGUF file in
  another block type;
- :mod:`~tandem.engine.quantization.rtn`: round-to-nearest asymmetric int quantization
  in groups along the input dimension;
- :mod:`~tandem.engine.quantization.gptq`: GPTQ (Frantar et al. 2022), the same format
  with second-order error feedback from calibration activations;
- :mod:`~tandem.engine.quantization.packing`: the AutoGPTQ checkpoint layout
  (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and exact (un)packing;
- :mod:`~tandem.engine.quantization.quantize`: ``tandem quantize``: the layer-by-layer
  calibration pass over a model and the checkpoint writer;
- :mod:`~tandem.engine.quantization.gptq_linear`: the ``gptq`` linear method;
- :mod:`~tandem.engine.quantization.awq` / :mod:`~tandem.engine.quantization.awq_linear`:
  AWQ (Lin et al. 2023) and the ``awq`` linear method.
"""
