"""tandem.engine.scheduling: Scheduling: requests and their states, the scheduler (continuous batching, chunked
prefill, preemption, remote-prefill requests), its per-step output. No torch.
"""
