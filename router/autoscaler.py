"""Applying the planner's targets to a running cluster's Ray actors.

:class:`RayPoolController` is the :class:`~tandem.control.planner.PoolController`
of ``tandem serve --autoscale``: growing a pool starts worker actors that ask for
the pool's custom resource (``{"prefill": 1}`` / ``{"decode": 1}``), so while no
node has a free unit they stay *pending* and the Ray autoscaler (or KubeRay's)
adds a node of that type; shrinking a pool retires workers
(:meth:`~tandem.router.launcher.TandemServer.retire_worker`: drain, then migrate
what is left), after which the autoscaler removes the idle node. A worker that
was asked for and has not started is cancelled first when a pool shrinks.

A worker of tensor-parallel size N is one worker here as in the planner: one
actor asking for one unit of its pool's resource (and, on CUDA, N GPUs: rank 0
in the actor, ranks 1.. its subprocesses on the same node). The controller
tells the planner how many devices each pool's workers hold
(:func:`devices_per_worker`, from the workers' engine configuration), so that
its device budget counts N per worker.

Every change is appended to :attr:`RayPoolController.events` (time, action,
worker id), which the tests and the autoscaling benchmark read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from tandem.control.planner import POOLS, PoolSize

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolEvent:
    """One change of a pool: ``t`` (monotonic seconds), ``action`` (``requested``,
    ``ready``, ``failed``, ``draining``, ``retired``), ``pool``, ``worker_id``, and
    for ``retired`` the requests it still had (migrated)."""

    t: float
    action: str
    pool: str
    worker_id: str
    migrated: int = 0


def _pool(role: str) -> str:
    return "prefill" if role == "prefill" else "decode"


def devices_per_worker(config) -> dict[str, int]:
    """Devices (GPUs, or CPU core sets) one worker of each pool holds: its engine's
    ``tensor_parallel_size``, the ranks of its group.

    Args:
        config: the workers' :class:`~tandem.router.launcher.ServeConfig`; prefill
            workers run ``prefill_engine`` when it is set, every other worker ``engine``.

    Returns:
        ``{"prefill": N, "decode": M}`` (colocated workers count as ``decode``).
    """
    return {"prefill": (config.prefill_engine or config.engine).tensor_parallel_size,
            "decode": config.engine.tensor_parallel_size}


class RayPoolController:
    """Adds and retires the worker actors of a :class:`~tandem.router.launcher.TandemServer`.

    Use it from the server's event loop. Counts are workers (tensor-parallel groups);
    :meth:`pool_sizes` also says how many devices each holds.

    Args:
        server: the running server (its registry, actors and KV wiring).

    Attributes:
        events: every :class:`PoolEvent`, oldest first.
    """

    def __init__(self, server) -> None:
        self.server = server
        self.events: list[PoolEvent] = []
        self._pending: dict[asyncio.Task, str] = {}     # start task -> pool
        # worker id -> (pool, retire task), until the retirement has completed
        self._draining: dict[str, tuple[str, asyncio.Task]] = {}
        self._joined: dict[str, float] = {}
        self._started = time.monotonic()
        self._devices = devices_per_worker(server.config)
        server.registry.add_worker_up_listener(self._up)

    def _up(self, w) -> None:
        self._joined[w.worker_id] = time.monotonic()

    def _event(self, action: str, pool: str, worker_id: str, migrated: int = 0) -> None:
        self.events.append(PoolEvent(time.monotonic(), action, pool, worker_id, migrated))

    # -- what the planner reads ------------------------------------------------------------
    def pool_sizes(self) -> dict[str, PoolSize]:
        out = {}
        for pool in POOLS:
            live = self.server.registry.alive(pool)
            out[pool] = PoolSize(
                ready=sum(1 for w in live if not w.draining and w.worker_id not in self._draining),
                pending=sum(1 for p in self._pending.values() if p == pool),
                # Until its retirement completes (deregistered, actor shut down), not
                # only while the registry still lists it: the pool is still changing.
                draining=sum(1 for p, _ in self._draining.values() if p == pool),
                devices_per_worker=self._devices[pool])
        return out

    def worker_ages(self) -> dict[str, float]:
        now = time.monotonic()
        return {w.worker_id: now - self._joined.get(w.worker_id, self._started)
                for w in self.server.registry.alive() if w.worker_id not in self._draining}

    # -- applying ----------------------------------------------------------------------------
    async def scale(self, pool: str, target: int) -> None:
        """Bring ``pool`` towards ``target`` workers: start the missing ones (pending
        until they serve), or cancel pending ones and retire the least loaded.

        Raises:
            ValueError: unknown ``pool``, or ``target`` < 1.
        """
        if pool not in POOLS:
            raise ValueError(f"pool: expected one of {', '.join(POOLS)}, got {pool!r}")
        if target < 1:
            raise ValueError(f"target: a pool keeps at least one worker, got {target}")
        size = self.pool_sizes()[pool]
        current = size.ready + size.pending
        for _ in range(target - current):
            task = asyncio.ensure_future(self.server.add_worker(pool))
            self._pending[task] = pool
            task.add_done_callback(self._started_one)
            self._event("requested", pool, "")
        excess = current - target
        for task, p in list(self._pending.items()):
            if excess <= 0:
                break
            if p == pool:
                task.cancel()
                excess -= 1
        if excess > 0:
            serving = [w for w in self.server.registry.alive(pool)
                       if not w.draining and w.worker_id not in self._draining]
            # The newest first (its prefix cache is the coldest, and it is the node the
            # autoscaler added last); the least loaded among equals.
            serving.sort(key=lambda w: (-_index(w.worker_id), _load(w)))
            for w in serving[:min(excess, len(serving) - 1)]:
                self._draining[w.worker_id] = (
                    pool, asyncio.ensure_future(self._retire(w.worker_id, pool)))
                self._event("draining", pool, w.worker_id)

    def _started_one(self, task: asyncio.Task) -> None:
        pool = self._pending.pop(task, None)
        if pool is None:
            return
        if task.cancelled():
            self._event("cancelled", pool, "")
        elif task.exception() is not None:
            logger.error("adding a %s worker failed: %s", pool, task.exception())
            self._event("failed", pool, "")
        else:
            self._event("ready", pool, task.result().worker_id)

    async def _retire(self, worker_id: str, pool: str) -> None:
        try:
            migrated = await self.server.retire_worker(worker_id)
            self._event("retired", pool, worker_id, migrated)
        except Exception as exc:
            logger.error("retiring %s failed: %s", worker_id, exc)
            self._event("failed", pool, worker_id)
        finally:
            self._draining.pop(worker_id, None)
            self._joined.pop(worker_id, None)

    async def stop(self) -> None:
        """Cancel pending starts and wait for retirements in progress."""
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, *(t for _, t in self._draining.values()),
                             return_exceptions=True)


def _load(w) -> int:
    s = w.stats
    return 0 if s is None else s.num_running + s.num_waiting + s.queued_prefill_tokens


def _index(worker_id: str) -> int:
    try:
        return int(worker_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0
