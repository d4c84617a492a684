"""Serving quantized weights: the linear methods of each format and how a checkpoint
picks one. (The offline quantizers that write these formats are the separate
``tandem.quantize`` package, behind ``tandem quantize``; nothing here imports it.)

- :mod:`~tandem.engine.quantization.registry`: ``EngineConfig.quantization`` -> linear
  method; :mod:`~tandem.engine.quantization.checkpoint` picks a checkpoint's own
  method from its ``quantization_config``;
- :mod:`~tandem.engine.quantization.gguf_linear`: ``gguf``, a GGUF file's blocks kept
  packed;
- :mod:`~tandem.engine.quantization.packing`: the AutoGPTQ checkpoint layout
  (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and exact (un)packing;
- :mod:`~tandem.engine.quantization.gptq_linear`: the ``gptq`` linear method;
- :mod:`~tandem.engine.quantization.awq_linear`: the ``awq`` linear method (AutoAWQ's
  "gemm" layout);
- :mod:`~tandem.engine.quantization.int4_packed`: the INT4_ZP blocks that 4-bit GPTQ
  and AWQ layers are kept in at load.
"""
