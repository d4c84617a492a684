"""tandem.engine.model.llama: The model: Llama over a paged KV cache, checkpoint files and weight loading,
linear-layer methods (dense today; quantized formats plug in here).
"""
