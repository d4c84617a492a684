"""Process-wide thread settings, applied once at a process's entry point.

torch's intra-op thread pool belongs to the process, not to an engine: two
engines in one process (tests, ``LLM(weights_from=...)``) must not resize it
behind each other's back. So :class:`~tandem.engine.runtime.llm_engine.LLMEngine`
never touches it; the entry points do: the worker actors' process set-up, the
offline :class:`~tandem.engine.runtime.llm_engine.LLM` (the process's entry point in
offline use) and scripts that build an engine themselves.
"""

from __future__ import annotations

from tandem.engine.config import EngineConfig


def apply_thread_settings(config: EngineConfig) -> int:
    """Size torch's intra-op thread pool to ``config.num_threads``.

    Process-wide: call it where the process starts, not per engine.
    ``num_threads=None`` leaves the pool as it is (torch's default, or what
    CPU pinning set).

    Returns:
        The number of intra-op threads in effect afterwards.
    """
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return torch.get_num_threads()
