"""tandem.engine.kv: Blocks and the KV cache: block pool (ref counts, free queue, block hashes), KV cache
manager (block tables, copy-on-write), prefix cache, host swap space, KV cache events,
and the KV connector interface of disaggregation. Plain Python, no torch.
"""
