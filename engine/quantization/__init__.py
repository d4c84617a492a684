"""Quantized weight formats: their linear methods (GGUF blocks, GPTQ, AWQ) and the
quantizers that write them."""
