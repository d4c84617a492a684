"""Supervision: every worker pool keeps its size.

The process that starts the workers (``tandem serve``) runs one
:class:`Supervisor`. When the registry reports a worker down (its actor died, a
call found it gone, its lease lapsed or it was fenced), the supervisor starts a
fresh worker under the same id, wires its KV channels and puts it in service;
requests that were on the old one have meanwhile moved elsewhere (see
:mod:`tandem.router.orchestrator`). A restart that fails is retried with
exponential backoff (1 s doubling to 30 s). Each recovery's time, from the
worker being seen down to its replacement in service, is kept in
:attr:`Supervisor.recoveries` and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from tandem.router.registry import WorkerRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """One replaced worker: ``worker_id``, ``seconds`` from down to back in service,
    ``attempts`` restarts it took."""

    worker_id: str
    seconds: float
    attempts: int


class Supervisor:
    """Replaces dead workers of ``registry``.

    Args:
        registry: the workers (down listeners trigger restarts).
        restart: ``await restart(worker_id)`` starts a fresh worker under that id and
            puts it in service (raises on failure).
        on_restarted: called with each :class:`Recovery` (metrics).
        min_backoff_s, max_backoff_s: wait before retrying a failed restart (seconds).
    """

    def __init__(self, registry: WorkerRegistry, restart: Callable[[str], Awaitable[None]],
                 on_restarted: Callable[[Recovery], None] | None = None,
                 min_backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.registry = registry
        self.restart = restart
        self.on_restarted = on_restarted
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.recoveries: list[Recovery] = []
        self._restarting: dict[str, asyncio.Task] = {}
        self._running = False
        registry.add_worker_down_listener(self._down)

    def start(self) -> None:
        """Begin supervising (workers already dead are restarted now)."""
        self._running = True
        for w in self.registry.workers():
            if not w.alive:
                self._down(w.worker_id)

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._restarting.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._restarting.clear()

    @property
    def restarting(self) -> list[str]:
        """Ids of workers being replaced now."""
        return list(self._restarting)

    def _down(self, worker_id: str) -> None:
        if not self._running or worker_id in self._restarting:
            return
        try:
            w = self.registry.get(worker_id)
        except KeyError:         # removed (scale-down): not ours to bring back
            return
        if w.alive:              # replaced by a live successor already
            return
        self._restarting[worker_id] = asyncio.ensure_future(self._replace(worker_id))

    async def _replace(self, worker_id: str) -> None:
        t0, attempt, backoff = time.monotonic(), 0, self.min_backoff_s
        try:
            while self._running:
                attempt += 1
                try:
                    await self.restart(worker_id)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.error("restarting %s failed (attempt %d): %s; retrying in %.0f s",
                                 worker_id, attempt, exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, self.max_backoff_s)
            else:
                return
        finally:
            self._restarting.pop(worker_id, None)
        rec = Recovery(worker_id, time.monotonic() - t0, attempt)
        self.recoveries.append(rec)
        logger.warning("worker %s replaced in %.1f s", worker_id, rec.seconds)
        if self.on_restarted is not None:
            self.on_restarted(rec)
