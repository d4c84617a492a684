"""What both worker kinds do the same way: CPU pinning, engine construction, KV layout,
fencing."""

from __future__ import annotations

import logging
import os

import torch

from tandem.engine.config import EngineConfig

logger = logging.getLogger(__name__)


class WorkerFencedError(RuntimeError):
    """The worker fenced itself off (e.g. it lost its lease in the cluster registry) and
    takes no new work; the router sends the request elsewhere.

    Attributes:
        worker_id: the fenced worker; reason: why it fenced itself.
    """

    def __init__(self, worker_id: str, reason: str):
        super().__init__(f"worker {worker_id} is fenced: {reason}")
        self.worker_id, self.reason = worker_id, reason

    def __reduce__(self):
        # Rebuilt from its own arguments when it crosses Ray (pickled), not from the message.
        return type(self), (self.worker_id, self.reason)


class Fence:
    """A worker's self-fencing switch: while fenced it refuses new work.

    Args:
        worker_id: the worker (named in the error).
    """

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.reason: str | None = None

    def fence(self, reason: str) -> None:
        if self.reason is None:
            logger.warning("%s fenced: %s", self.worker_id, reason)
        self.reason = reason

    def unfence(self) -> None:
        if self.reason is not None:
            logger.warning("%s unfenced", self.worker_id)
        self.reason = None

    def check(self) -> None:
        """Raises:
            WorkerFencedError: while fenced.
        """
        if self.reason is not None:
            raise WorkerFencedError(self.worker_id, self.reason)


def pin_cpus(cpus: list[int] | None) -> list[int]:
    """Pin this process to ``cpus`` (and size torch's thread pool to match).

    Disaggregation's advantage is that prefill and decode do not share a device;
    on a CPU-only machine, pinning them to different cores is the closest
    equivalent. ``None`` leaves the affinity as it is.

    Returns:
        The cores this process may run on afterwards.
    """
    if cpus:
        os.sched_setaffinity(0, set(cpus))
        torch.set_num_threads(len(cpus))
    return sorted(os.sched_getaffinity(0))


def node_ip_address() -> str:
    """This node's address as Ray knows it (the one other nodes reach it at); 127.0.0.1
    outside Ray. A decode worker's KV listener binds to it, so a prefill worker on
    another node can connect."""
    import sys

    ray = sys.modules.get("ray")     # never import Ray from the engine
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def model_info(engine, config: EngineConfig) -> dict:
    return {"model_name": engine.model_files.name, "max_model_len": engine.max_model_len,
            "block_size": config.cache.block_size, "dtype": config.dtype,
            "kv_cache_dtype": config.cache.kv_cache_dtype,
            "vocab_size": engine.tokenizer.vocab_size,
            "model_vocab_size": engine.model_config.vocab_size,
            "num_blocks": engine.kv_cache_manager.num_usable_blocks}


def block_counts(engine) -> dict:
    """Check the engine's invariants (scheduler queues and block pools) and return its
    block and queue counts; call on the engine's loop thread."""
    kv = engine.kv_cache_manager
    engine.check_invariants()
    return {"num_blocks": kv.num_usable_blocks, "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.block_pool.num_cached_blocks,
            "num_running": engine.scheduler.num_running,
            "num_waiting": engine.scheduler.num_waiting,
            "num_swapped": engine.scheduler.num_swapped,
            "num_free_host_blocks": kv.num_free_host_blocks,
            "num_host_blocks": kv.num_host_blocks,
            "num_preemptions": engine.num_preemptions,
            "num_reserved": len(engine.scheduler.remote_kv)
            + len(engine.scheduler.remote_kv.orphaned)}
