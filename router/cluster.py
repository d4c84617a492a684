"""The router's view of the cluster: the worker registry, the routing policy, the
output pumps and the per-request queues they feed.

One pump task per worker long-polls its step outputs: stats go to the
registry, KV cache events to the routing policy (which blocks each worker
caches, for prefix-aware routing), and a decode (or colocated) worker's token
deltas to the queue of the request they belong to.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from tandem.engine.runtime.outputs import RequestDelta, StepOutput
from tandem.router.registry import WorkerHandle, WorkerRegistry
from tandem.router.routing import RoutingPolicy
from tandem.router.worker_client import call_worker

logger = logging.getLogger(__name__)


class Cluster:
    """Workers plus the per-request queues their outputs feed.

    Args:
        registry: the workers (:class:`~tandem.router.registry.WorkerRegistry`).
        policy: picks the workers of each request
            (:class:`~tandem.router.routing.RoutingPolicy`).
        on_step: called with each :class:`StepOutput` (metrics).
        on_health: called with True/False when the cluster becomes able / unable to serve.
    """

    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy,
                 on_step: Callable[[WorkerHandle, StepOutput], None] | None = None,
                 on_health: Callable[[bool], None] | None = None):
        self.registry, self.policy = registry, policy
        self.on_step = on_step
        registry.add_worker_down_listener(policy.forget_worker)
        if on_health is not None:
            registry.add_health_listener(on_health)
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}            # request id -> decode worker id
        self._pumps: list[asyncio.Task] = []

    @property
    def prefill(self) -> list[WorkerHandle]:
        return self.registry.workers("prefill")

    @property
    def decode(self) -> list[WorkerHandle]:
        """Decode and colocated workers."""
        return self.registry.workers("decode")

    @property
    def disaggregated(self) -> bool:
        return self.registry.disaggregated

    @property
    def healthy(self) -> bool:
        return self.registry.healthy

    # -- routing ------------------------------------------------------------------------------
    def pick_decode(self, prompt_token_ids: Sequence[int]) -> WorkerHandle:
        """The policy's decode worker for this prompt.

        Raises:
            RuntimeError: no decode worker is alive.
        """
        return self.policy.pick_decode(self.registry.alive("decode"), prompt_token_ids)

    def pick_prefill(self, prompt_token_ids: Sequence[int]) -> WorkerHandle:
        """The policy's prefill worker for this prompt.

        Raises:
            RuntimeError: no prefill worker is alive.
        """
        return self.policy.pick_prefill(self.registry.alive("prefill"), prompt_token_ids)

    async def call(self, w: WorkerHandle, method: str, *args: Any) -> Any:
        """Call ``method`` on worker ``w``; errors are typed as
        :func:`~tandem.router.worker_client.call_worker` says."""
        return await call_worker(w.worker_id, w.actor, method, *args)

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
        for w in self.registry.workers():
            self._pumps.append(asyncio.ensure_future(self._pump(w)))

    async def stop(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()

    async def _pump(self, w: WorkerHandle) -> None:
        routes_deltas = w.role != "prefill"     # a prefill worker's results return by call
        while True:
            try:
                steps = await self.call(w, "poll", 1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.mark_dead(w, exc)
                return
            current = self.registry.get(w.worker_id) is w   # not a replaced incarnation
            for step in steps:
                if not current:
                    break
                self.registry.update_stats(w.worker_id, step.stats)
                if step.kv_events:
                    self.policy.on_kv_events(w.worker_id, step.kv_events)
                if self.on_step is not None:
                    self.on_step(w, step)
                if not routes_deltas:
                    continue
                for d in step.deltas:
                    q = self._queues.get(d.request_id.split("#", 1)[0])
                    if q is not None:
                        q.put_nowait(d)
            if not current:
                return

    def mark_dead(self, w: WorkerHandle, exc: BaseException) -> None:
        """A worker is gone: fail its requests (their streams end with ``error``)."""
        if self.registry.get(w.worker_id) is not w or not self.registry.mark_dead(w.worker_id):
            return
        logger.error("worker %s is gone: %s", w.worker_id, exc)
        for rid, owner in list(self._owner.items()):
            if owner == w.worker_id:
                self._queues[rid].put_nowait(RequestDelta(rid, (), (), "error",
                                                          f"worker {w.worker_id} failed"))

    def replace(self, w: WorkerHandle) -> None:
        """Put a (new) worker in service in place of the one with the same id."""
        self.registry.add(w)
        self._pumps.append(asyncio.ensure_future(self._pump(w)))
