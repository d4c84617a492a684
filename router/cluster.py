"""The router's view of the cluster: the worker registry, the routing policy, the
reservations, the output pumps and the per-request queues they feed.

One pump task per worker reads its step outputs (as subscriber ``router_id``:
with several routers each gets its own requests' deltas), pushed on the
worker's output stream or, without one, long-polled:
stats go to the registry, KV cache events to the routing policy (which blocks
each worker caches, for prefix-aware routing) unless they come from Redis
streams (:meth:`Cluster.feed_kv_events`), and a decode (or colocated) worker's
token deltas to the queue of the request they belong to. When a worker dies,
each of its requests' queues gets a :class:`WorkerLost` (the orchestrator
migrates the request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.control.reservations import InProcessReservations, Reservations

from tandem.engine.runtime.output_stream import OutputStream, OutputStreamError
from tandem.engine.runtime.outputs import AddResult, RequestDelta, StepOutput, WorkerRequest
from tandem.router.registry import WorkerHandle, WorkerRegistry
from tandem.router.routing import RoutingPolicy

logger = logging.getLogger(__name__)

RESERVATION_TTL_S = 60.0
"""Seconds a decode reservation lives unless refreshed (a dead router's expire)."""
STREAM_SILENCE_S = 10.0
"""Seconds without a frame (the worker sends a heartbeat every second) after which
the router asks the worker whether it is there (a Ray call that fails if it died)."""
STREAM_RETRY_S = 60.0
"""Seconds a router polls a worker whose output stream it could not reach before it
tries the stream again."""


@dataclass(frozen=True)
class ServerStopping:
    """Put in every request's queue when the router shuts down: the request ends
    with ``UNAVAILABLE`` (an error frame over HTTP) instead of a cut connection."""


@dataclass(frozen=True)
class WorkerLost:
    """Put in a request's queue when its decode worker died (or was replaced).

    Attributes:
        worker_id: the worker; reason: why it counts as gone (for logs).
    """

    worker_id: str
    reason: str


def _serving(workers: list[WorkerHandle]) -> list[WorkerHandle]:
    """The workers that take new requests: those not draining, or all of them when
    every one is draining (a request is never refused because of a scale-down)."""
    return [w for w in workers if not w.draining] or workers


class Cluster:
    """Workers plus the per-request queues their outputs feed.

    Args:
        registry: the workers (:class:`~tandem.router.registry.WorkerRegistry`).
        policy: picks the workers of each request
            (:class:`~tandem.router.routing.RoutingPolicy`).
        on_step: called with each :class:`StepOutput` (metrics).
        on_health: called with True/False when every pool has / lacks a live worker.
        reservations: in-flight requests per decode worker, shared by every router
            (:class:`~tandem.control.reservations.RedisReservations`); default: this
            router's own count.
        router_id: this router's subscriber id on the workers ("" for the only router).
        kv_events_from_steps: apply the KV events of step outputs to the policy
            (False when they come from Redis streams).
    """

    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy,
                 on_step: Callable[[WorkerHandle, StepOutput], None] | None = None,
                 on_health: Callable[[bool], None] | None = None,
                 reservations: Reservations | None = None, router_id: str = "",
                 kv_events_from_steps: bool = True):
        self.registry, self.policy = registry, policy
        self.on_step = on_step
        self.reservations = reservations if reservations is not None else InProcessReservations()
        self.router_id = router_id
        self.kv_events_from_steps = kv_events_from_steps
        registry.add_worker_down_listener(policy.forget_worker)
        registry.add_worker_down_listener(self._worker_down)
        registry.add_worker_up_listener(self._worker_up)
        if on_health is not None:
            registry.add_health_listener(on_health)
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}            # request id -> decode worker id
        self._pumps: dict[str, asyncio.Task] = {}   # worker id -> pump of its current handle
        # worker id -> (the incarnation, its output stream while one is open)
        self._streams: dict[str, tuple[WorkerHandle, OutputStream]] = {}
        # worker id -> request key -> the future of its AddResult (requests sent on its stream)
        self._answers: dict[str, dict[tuple, asyncio.Future]] = {}
        self._started = False
        self._refresher: asyncio.Task | None = None
        self._down_waiters: dict[str, list[asyncio.Future]] = {}
        self._up_waiters: list[asyncio.Future] = []

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
        """Health says SERVING: requests can be served (a decode-side worker is
        alive; with the prefill pool empty the decode workers prefill for
        themselves, degraded but served)."""
        return self.registry.can_serve

    @property
    def can_serve(self) -> bool:
        """A decode-side worker is alive (requests are served, maybe degraded)."""
        return self.registry.can_serve

    # -- routing ------------------------------------------------------------------------------
    def reserve_decode(self, request_id: str, prompt_token_ids: Sequence[int],
                       exclude: Sequence[WorkerHandle] = ()) -> WorkerHandle:
        """Pick the request's decode worker and reserve it, in one atomic step shared
        by every router (the policy's costs plus every router's in-flight requests,
        see :class:`~tandem.router.routing.RoutingPolicy`). The reservation ends
        with :meth:`unregister` (or expires if this router dies).

        Args:
            exclude: worker incarnations not to pick (the one a migrated request
                left, which the registry may not know dead yet); a replacement
                under the same id is another handle and may be picked.

        Raises:
            RuntimeError: no (other) decode worker is alive.
        """
        alive = _serving([w for w in self.registry.alive("decode")
                          if not any(w is x for x in exclude)])
        ranked = self.policy.decode_candidates(alive, prompt_token_ids)
        try:
            wid = self.reservations.reserve("decode", [(w.worker_id, c) for w, c in ranked],
                                            request_id, RESERVATION_TTL_S)
        except ValueError:
            raise
        except Exception as exc:     # the cluster state is unreachable: this router's own count
            logger.warning("reserving a decode worker failed (%s); picking locally", exc)
            mine: dict[str, int] = {}
            for owner in self._owner.values():
                mine[owner] = mine.get(owner, 0) + 1
            wid = self.policy.pick_decode(alive, prompt_token_ids, mine).worker_id
        old = self._owner.get(request_id)
        if old is not None and old != wid:
            self.reservations.release("decode", old, request_id)
        if request_id in self._queues:
            self._owner[request_id] = wid
        return next(w for w, _ in ranked if w.worker_id == wid)

    def pick_prefill(self, prompt_token_ids: Sequence[int]) -> WorkerHandle:
        """The policy's prefill worker for this prompt.

        Raises:
            RuntimeError: no prefill worker is alive.
        """
        return self.policy.pick_prefill(_serving(self.registry.alive("prefill")), prompt_token_ids)

    # -- request queues -----------------------------------------------------------------------
    def register(self, request_id: str, worker: WorkerHandle) -> asyncio.Queue:
        """The queue of ``request_id``'s deltas from ``worker`` (its reserved decode worker)."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._owner[request_id] = worker.worker_id
        return q

    def unregister(self, request_id: str) -> None:
        """The request is over here: drop its queue and release its reservation."""
        self._queues.pop(request_id, None)
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            self._release(owner, request_id)

    def _release(self, worker_id: str, request_id: str) -> None:
        try:
            self.reservations.release("decode", worker_id, request_id)
        except Exception as exc:     # Redis down: the reservation expires by itself
            logger.warning("releasing %s on %s failed: %s", request_id, worker_id, exc)

    def num_requests_on(self, worker_id: str, besides: str | None = None) -> int:
        """This router's requests registered on ``worker_id``, not counting ``besides``."""
        return sum(1 for rid, owner in self._owner.items()
                   if owner == worker_id and rid != besides)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    def stop_requests(self) -> int:
        """End every request in flight (shutdown): each gets :class:`ServerStopping`.
        Returns how many."""
        for q in self._queues.values():
            q.put_nowait(ServerStopping())
        return len(self._queues)

    # -- pumps --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start a pump per registered worker (and one for each worker added later),
        and the refresh of this router's reservations."""
        self._started = True
        for w in self.registry.workers():
            self._start_pump(w)
        self._refresher = asyncio.ensure_future(self._refresh_reservations())

    async def stop(self) -> None:
        self._started = False
        tasks = [*self._pumps.values(), *([self._refresher] if self._refresher else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pumps.clear()
        self._refresher = None

    def _start_pump(self, w: WorkerHandle) -> None:
        old = self._pumps.pop(w.worker_id, None)
        if old is not None:
            old.cancel()
        if w.alive:
            task = self._pumps[w.worker_id] = asyncio.ensure_future(self._pump(w))
            task.add_done_callback(lambda t: self._pump_ended(w, t))

    def _pump_ended(self, w: WorkerHandle, task: asyncio.Task) -> None:
        """A pump that died of an exception in the router's own code (stats, routing
        policy, metrics) must not leave its worker's requests waiting on queues
        nothing feeds any more: the worker is treated as lost, so its requests
        migrate (or wait for its replacement) and resume from their tokens, and the
        supervisor replaces it, fencing the incarnation whose outputs were missed."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("output pump of %s failed; treating the worker as lost", w.worker_id,
                     exc_info=task.exception())
        self.mark_dead(w, task.exception())

    def _worker_up(self, w: WorkerHandle) -> None:
        if self._started:
            self._start_pump(w)
        waiters, self._up_waiters = self._up_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(w.worker_id)

    async def wait_worker_up(self, timeout_s: float) -> bool:
        """Wait until a worker comes into service (a supervisor's replacement, a
        scale-up), at most ``timeout_s`` seconds; whether one did. Callers check
        that it is one they can use."""
        fut = asyncio.get_running_loop().create_future()
        self._up_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if fut in self._up_waiters:
                self._up_waiters.remove(fut)

    async def _refresh_reservations(self) -> None:
        while True:
            await asyncio.sleep(RESERVATION_TTL_S / 3)
            entries = [(owner, rid) for rid, owner in self._owner.items()]
            if entries:
                try:
                    await asyncio.to_thread(self.reservations.refresh, "decode", entries,
                                            RESERVATION_TTL_S)
                    # Refresh re-creates what is missing (lost with a Redis flush):
                    # what ended or moved while it ran is released again.
                    for owner, rid in entries:
                        if self._owner.get(rid) != owner:
                            self._release(owner, rid)
                except Exception as exc:
                    logger.warning("refreshing reservations failed: %s", exc)

    async def _pump(self, w: WorkerHandle) -> None:
        """Feed worker ``w``'s step outputs to its requests' queues until it is dead,
        replaced or removed.

        Outputs come pushed on the worker's output stream
        (:mod:`~tandem.engine.runtime.output_stream`); a worker without one, or whose
        first stream cannot be opened, is polled (and its stream tried again after
        :data:`STREAM_RETRY_S`). When a stream ends, a new one is opened at once; the
        worker is marked dead (its requests resume elsewhere) if that fails (it died,
        its engine failed, or it cannot be reached) or if outputs were lost with the
        old connection. No ``poll`` runs while an old stream's thread may still hold
        outputs, so every delta arrives once and in order."""
        routes_deltas = w.role != "prefill"     # a prefill worker's results return by call
        stream: OutputStream | None = None
        next_try = 0.0                           # monotonic time to try a stream again
        frames: int | None = None                # frames with outputs read on w's streams
        try:
            while True:
                if stream is None and time.monotonic() >= next_try:
                    try:
                        stream = await self._open_stream(w)
                    except asyncio.CancelledError:
                        raise
                    except AttributeError:        # a worker object without a stream
                        next_try = float("inf")
                    except Exception as exc:
                        if frames is not None:    # it had one: gone or unreachable
                            self.mark_dead(w, exc)
                            return
                        logger.warning("%s: no output stream (%s); polling for %.0f s",
                                       w.worker_id, exc, STREAM_RETRY_S)
                        next_try = time.monotonic() + STREAM_RETRY_S
                    if stream is not None:
                        if frames is not None and stream.frames_before != frames:
                            self.mark_dead(w, OutputStreamError(
                                f"{stream.frames_before - frames} batch(es) of step outputs "
                                "lost with a broken output stream"))
                            return
                        frames = stream.frames_before
                        self._streams[w.worker_id] = (w, stream)
                if stream is not None:
                    try:
                        steps = await stream.read(STREAM_SILENCE_S)
                    except OutputStreamError as exc:
                        logger.info("%s: %s; reconnecting", w.worker_id, exc)
                        self._drop_stream(w, stream)
                        stream, next_try = None, 0.0
                        continue
                    if steps is None:
                        # Not even a heartbeat: is the worker there at all?
                        try:
                            await w.client.info()
                        except asyncio.CancelledError:
                            raise
                        except Exception as exc:
                            self.mark_dead(w, exc)
                            return
                        continue
                    if steps:
                        frames += 1
                else:
                    try:
                        steps = await w.client.poll(1.0, self.router_id)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        self.mark_dead(w, exc)
                        return
                if not self._take_steps(w, steps, routes_deltas):
                    return
        finally:
            if stream is not None:
                self._drop_stream(w, stream)

    def _drop_stream(self, w: WorkerHandle, stream: OutputStream) -> None:
        """Close ``stream``; the requests sent on it that have no answer yet fail
        with :class:`OutputStreamError` (whether the worker read them is unknown)."""
        stream.close()
        if self._streams.get(w.worker_id, (None, None))[1] is stream:
            del self._streams[w.worker_id]
            for fut in self._answers.pop(w.worker_id, {}).values():
                if not fut.done():
                    fut.set_exception(OutputStreamError(
                        f"{w.worker_id}: the output stream ended before the answer"))

    def add_on_stream(self, w: WorkerHandle, request: WorkerRequest) -> asyncio.Future | None:
        """Send ``request`` to ``w`` on its output stream (see
        :mod:`~tandem.engine.runtime.output_stream`): a future of the worker's
        :class:`AddResult`, or None where ``w`` has no open stream that takes
        requests (the caller makes the ``add_request`` call). The future fails with
        :class:`OutputStreamError` if the stream ends first: the request may or may
        not have been read, and the call, marked ``sent_on_stream``, settles it."""
        entry = self._streams.get(w.worker_id)
        if entry is None or entry[0] is not w or not entry[1].takes_requests:
            return None
        if not entry[1].send(request):
            return None
        fut = asyncio.get_running_loop().create_future()
        self._answers.setdefault(w.worker_id, {})[AddResult.key_of(request)] = fut
        return fut

    def forget_answer(self, w: WorkerHandle, request: WorkerRequest) -> None:
        """Stop waiting for ``request``'s answer on ``w``'s stream (the caller asks
        by call instead)."""
        self._answers.get(w.worker_id, {}).pop(AddResult.key_of(request), None)

    async def _open_stream(self, w: WorkerHandle) -> OutputStream:
        """``w``'s output stream for this router.

        Raises:
            AttributeError: ``w`` has none (an in-process worker object without it).
            WorkerDiedError, WorkerError: the call failed (``w`` is gone, or its engine
                failed).
            OutputStreamError: it could not be reached.
        """
        rendezvous = await w.client.open_output_stream(self.router_id)
        return await OutputStream.connect(rendezvous)

    def _take_steps(self, w: WorkerHandle, steps: list[StepOutput], routes_deltas: bool) -> bool:
        """Apply a batch of ``w``'s step outputs; False once ``w`` is no longer the
        current, live incarnation (its pump then ends)."""
        current = self._is_current(w)   # not a replaced (or removed) incarnation
        if steps:
            w.last_output_at = time.monotonic()
            w.last_step_s = max((s.step_time_s for s in steps
                                 if isinstance(s, StepOutput) and s.step_time_s),
                                default=w.last_step_s)
        for step in steps:
            if not current:
                break
            if isinstance(step, AddResult):
                fut = self._answers.get(w.worker_id, {}).pop(step.key, None)
                if fut is not None and not fut.done():
                    fut.set_result(step)
                continue
            self.registry.update_stats(w.worker_id, step.stats)
            if step.kv_events and self.kv_events_from_steps:
                self.policy.on_kv_events(w.worker_id, step.kv_events)
            if self.on_step is not None:
                self.on_step(w, step)
            if not routes_deltas:
                continue
            for d in step.deltas:
                q = self._queues.get(d.request_id)
                if q is not None and self._owner.get(d.request_id) == w.worker_id:
                    q.put_nowait(d)
        return current and w.alive

    def _is_current(self, w: WorkerHandle) -> bool:
        try:
            return self.registry.get(w.worker_id) is w
        except KeyError:                 # removed
            return False

    def feed_kv_events(self, worker_id: str, events: Sequence) -> None:
        """KV cache events of ``worker_id`` read from the cluster state (Redis streams)."""
        try:
            w = self.registry.get(worker_id)
        except KeyError:
            return
        if w.alive:
            self.policy.on_kv_events(worker_id, events)

    def mark_dead(self, w: WorkerHandle, exc: BaseException) -> None:
        """A call to worker ``w`` failed because it is gone: mark it dead (its
        requests' queues get a :class:`WorkerLost`)."""
        if not self._is_current(w) or not w.alive:
            return
        logger.error("worker %s is gone: %s", w.worker_id, exc)
        self.registry.mark_dead(w.worker_id)

    def watch_down(self, w: WorkerHandle) -> asyncio.Future:
        """A future that completes when worker ``w`` (this incarnation) is marked dead,
        replaced or removed; done at once if it already is. Cancel it when done with it."""
        fut = asyncio.get_running_loop().create_future()
        if not self._is_current(w) or not w.alive:
            fut.set_result(w.worker_id)
        else:
            waiters = self._down_waiters.setdefault(w.worker_id, [])
            waiters[:] = [f for f in waiters if not f.done()]
            waiters.append(fut)
        return fut

    def _worker_down(self, worker_id: str) -> None:
        """Registry listener: tell every request on that worker (and every
        :meth:`watch_down` waiter), and drop its reservations."""
        for fut in self._down_waiters.pop(worker_id, []):
            if not fut.done():
                fut.set_result(worker_id)
        for rid, owner in list(self._owner.items()):
            if owner == worker_id:
                self._queues[rid].put_nowait(WorkerLost(worker_id, "worker died or was replaced"))
        try:
            self.reservations.drop_worker("decode", worker_id)
        except Exception as exc:
            logger.warning("dropping reservations of %s failed: %s", worker_id, exc)

    def replace(self, w: WorkerHandle) -> None:
        """Put a (new) worker in service in place of the one with the same id (its
        pump starts by the registry's worker-up event)."""
        self.registry.add(w)
