"""The router's view of the workers: handles, load, routing policy and the output pumps.

Routing (DESIGN.md step 2): a decode worker is picked by free KV blocks, then
running batch size; a prefill worker by the prompt tokens the router has sent it
that are not back yet (queued prefill tokens). One pump task per decode (or
colocated) worker long-polls its step outputs and hands each request's deltas to
that request's queue.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from tandem.engine.outputs import RequestDelta, StepOutput
from tandem.router.registry import WorkerHandle

logger = logging.getLogger(__name__)


class Cluster:
    """Workers plus the per-request queues their outputs feed.

    Args:
        prefill, decode: worker handles (colocated workers go in ``decode``).
        call: ``call(actor_method, *args) -> awaitable`` (Ray: ``m.remote(*args)``).
        on_step: called with each :class:`StepOutput` (metrics).
        on_health: called with True/False when the cluster becomes able / unable to serve.
    """

    def __init__(self, prefill: list[WorkerHandle], decode: list[WorkerHandle],
                 call: Callable, on_step: Callable[[WorkerHandle, StepOutput], None] | None = None,
                 on_health: Callable[[bool], None] | None = None):
        self.prefill, self.decode = prefill, decode
        self.call = call
        self.on_step = on_step
        self.on_health = on_health
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}            # request id -> decode worker id
        self._pumps: list[asyncio.Task] = []

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def healthy(self) -> bool:
        if not any(w.alive for w in self.decode):
            return False
        return not self.prefill or any(w.alive for w in self.prefill)

    # -- routing ------------------------------------------------------------------------------
    def pick_decode(self) -> WorkerHandle:
        """Most free KV blocks, then the smallest running batch.

        Raises:
            RuntimeError: no decode worker is alive.
        """
        alive = [w for w in self.decode if w.alive]
        if not alive:
            raise RuntimeError("no decode worker is alive")

        def load(w: WorkerHandle):
            s = w.stats
            if s is None:
                return (0, 0, w.worker_id)
            return (-s.num_free_blocks, s.num_running + s.num_waiting, w.worker_id)
        return min(alive, key=load)

    def pick_prefill(self) -> WorkerHandle:
        """Fewest queued prefill tokens.

        Raises:
            RuntimeError: no prefill worker is alive.
        """
        alive = [w for w in self.prefill if w.alive]
        if not alive:
            raise RuntimeError("no prefill worker is alive")
        return min(alive, key=lambda w: (w.inflight_prefill_tokens, w.worker_id))

    # -- request queues -----------------------------------------------------------------------
    def register(self, request_id: str, worker: WorkerHandle) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._owner[request_id] = worker.worker_id
        return q

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._owner.pop(request_id, None)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    # -- pumps --------------------------------------------------------------------------------
    def start(self) -> None:
        for w in self.decode:
            self._pumps.append(asyncio.ensure_future(self._pump(w)))
        for w in self.prefill:
            self._pumps.append(asyncio.ensure_future(self._watch(w)))

    async def _watch(self, w: WorkerHandle, period_s: float = 1.0) -> None:
        """Prefill workers send no step outputs: poll their stats, which also shows
        whether they are alive."""
        while w.alive:
            try:
                w.stats = await asyncio.wait_for(self.call(w.actor.stats), 30.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.mark_dead(w, exc)
                return
            if self.on_step is not None:
                self.on_step(w, StepOutput((), w.stats))
            await asyncio.sleep(period_s)

    async def stop(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()

    async def _pump(self, w: WorkerHandle) -> None:
        while True:
            try:
                steps = await self.call(w.actor.poll, 1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.mark_dead(w, exc)
                return
            for step in steps:
                w.stats = step.stats
                if self.on_step is not None:
                    self.on_step(w, step)
                for d in step.deltas:
                    q = self._queues.get(d.request_id.split("#", 1)[0])
                    if q is not None:
                        q.put_nowait(d)

    def mark_dead(self, w: WorkerHandle, exc: BaseException) -> None:
        """A worker is gone: fail its requests (their streams end with ``error``)."""
        if not w.alive:
            return
        logger.error("worker %s is gone: %s", w.worker_id, exc)
        w.alive = False
        for rid, owner in list(self._owner.items()):
            if owner == w.worker_id:
                self._queues[rid].put_nowait(RequestDelta(rid, (), (), "error",
                                                          f"worker {w.worker_id} failed"))
        if self.on_health is not None:
            self.on_health(self.healthy)

    def replace(self, w: WorkerHandle) -> None:
        """Put a (new) worker in service in place of the one with the same id."""
        pool = self.prefill if w.role == "prefill" else self.decode
        for i, old in enumerate(pool):
            if old.worker_id == w.worker_id:
                pool[i] = w
                break
        else:
            pool.append(w)
        watch = self._watch if w.role == "prefill" else self._pump
        self._pumps.append(asyncio.ensure_future(watch(w)))
        if self.on_health is not None:
            self.on_health(self.healthy)
