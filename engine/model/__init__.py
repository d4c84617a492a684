"""tandem.engine.model: the models. The registry of served architectures (registry),
the shared decoder layers and RoPE tables (layers, rotary) and the per-architecture
wiring (llama, qwen), building a model from its files (loader), checkpoint files and
weight loading (model_files, weights), linear-layer methods (dense here; quantized
formats plug in through linear).
"""
