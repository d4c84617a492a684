"""tandem.engine.sampling: Sampling: validated sampling parameters and the sampler (penalties, top-k/p,
min-p, seeded generators, logprobs).
"""
