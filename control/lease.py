"""A worker's lease on its id: register, renew in the background, fence itself.

A worker process holds one :class:`LeaseKeeper`. While the keeper is not
:attr:`~LeaseKeeper.fenced`, the worker may act as ``worker_id`` (accept requests,
publish KV events); once fenced it must stop, because another incarnation may
own the id or the routers may already count it dead::

    renewal answer / event           keeper state
    "renewed", "reasserted"          unfenced
    "fenced"                         fenced for good (a newer generation exists)
    no success for ttl_s             fenced until a renewal succeeds again
                                     (only with ``fence_when_unreachable``)

The second fence is measured by the local monotonic clock from the start of the
last successful renewal, so it never lags the lease's expiry in Redis. It may
be lifted: the lease can only have been taken over if the generation counter
moved, and a renewal then answers ``"fenced"``.

Workers of ``tandem serve`` run without that second fence
(:class:`~tandem.control.worker_control.ControlConfig`): a Redis that nobody can
reach is an outage of the cluster state, not of the worker, and refusing work
for it would turn it into an outage of the whole service. They keep serving,
:attr:`LeaseKeeper.state_reachable` says the state is out of reach, and the
first renewal that gets through re-asserts the lease or, if a newer incarnation
registered meanwhile, fences the worker for good.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from tandem.control.state import (LEASE_TTL_S, RENEW_INTERVAL_S, ClusterState,
                                  ClusterStateUnavailable)

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """A worker's lease: registers, then renews every interval on a daemon thread; self-fences.

    Self-fencing: on a ``"fenced"`` answer the keeper is permanently fenced (a
    newer incarnation exists); when no renewal has succeeded for ``ttl_s`` (by
    the local monotonic clock: Redis unreachable) it is fenced until a later
    renewal succeeds (``"renewed"`` or ``"reasserted"``), since nobody can have
    replaced it unless the counter moved (that case answers ``"fenced"``).

    Callbacks run on the keeper's thread; they must not block for long.

    Args:
        state: the cluster state connection.
        worker_id, role, actor_name, info: what :meth:`ClusterState.register_worker` stores.
        ttl_s: lease lifetime, in seconds.
        interval_s: time between renewals, in seconds (well under ``ttl_s``).
        on_fenced: called with the reason each time the keeper becomes fenced.
        on_unfenced: called when a temporary fence is lifted.
        min_generation: passed to :meth:`ClusterState.register_worker` (one more
            than the incarnation this worker replaces; 0 for a first start).
        fence_when_unreachable: fence while no renewal has succeeded for ``ttl_s``
            (Redis unreachable); False: keep working through a Redis outage (see
            the module docstring).

    Attributes:
        generation: this incarnation's generation (set by :meth:`start`; 0 before).

    Raises:
        ValueError: ``ttl_s`` or ``interval_s`` is not positive, or ``interval_s >= ttl_s``.
    """

    def __init__(self, state: ClusterState, worker_id: str, role: str, actor_name: str, info: dict,
                 ttl_s: float = LEASE_TTL_S, interval_s: float = RENEW_INTERVAL_S,
                 on_fenced: Callable[[str], None] | None = None,
                 on_unfenced: Callable[[], None] | None = None, min_generation: int = 0,
                 fence_when_unreachable: bool = True) -> None:
        if not (ttl_s > 0 and interval_s > 0 and interval_s < ttl_s):
            raise ValueError(f"need 0 < interval_s < ttl_s, got interval_s={interval_s}, ttl_s={ttl_s}")
        self.state = state
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.record = {"role": role, "actor_name": actor_name, "info": info}
        self.generation = 0
        self.min_generation = min_generation
        self.fence_when_unreachable = fence_when_unreachable
        self._on_fenced = on_fenced
        self._on_unfenced = on_unfenced
        self._lock = threading.Lock()
        self._fenced_for_good = False
        self._fenced_lost = False
        self._reason: str | None = None
        self._last_ok = 0.0            # monotonic start of the last successful renewal
        self._last_error: str | None = None    # why the last renewal failed (None: it did not)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        """Register (synchronously) and start renewing on a daemon thread.

        Returns:
            ``self``.

        Raises:
            RuntimeError: already started.
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        if self._thread is not None:
            raise RuntimeError(f"lease keeper for {self.worker_id!r} already started")
        t0 = time.monotonic()
        self.generation = self.state.register_worker(self.worker_id, self.record["role"],
                                                     self.record["actor_name"], self.record["info"],
                                                     self.ttl_s, self.min_generation)
        self._last_ok = t0
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    @property
    def fenced(self) -> bool:
        """The worker must not act as ``worker_id`` now (see the class docstring).

        Also true between renewal attempts once ``ttl_s`` has passed since the
        last successful one, before the thread has noticed.
        """
        with self._lock:
            return self._fenced_for_good or self._fenced_lost or self._overdue()

    @property
    def fence_reason(self) -> str | None:
        """Why the keeper is (or was last) fenced; ``None`` if it never was."""
        with self._lock:
            if self._reason is None and self._overdue():
                return (f"{ClusterStateUnavailable.PREFIX} at {self.state.address}: no lease "
                        f"renewal succeeded for {self.ttl_s} s")
            return self._reason

    @property
    def state_reachable(self) -> bool:
        """The last renewal reached Redis (whatever it answered)."""
        with self._lock:
            return self._last_error is None

    @property
    def state_error(self) -> str | None:
        """Why the last renewal failed to reach Redis; None when it reached it."""
        with self._lock:
            return self._last_error

    def _overdue(self) -> bool:
        running = self._thread is not None and not self._stop.is_set()
        return (self.fence_when_unreachable and running
                and time.monotonic() - self._last_ok >= self.ttl_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t0 = time.monotonic()
            try:
                answer = self.state.renew_lease(self.worker_id, self.generation, self.ttl_s, self.record)
            except redis.exceptions.RedisError as e:
                with self._lock:
                    first = self._last_error is None
                    self._last_error = f"{ClusterStateUnavailable.PREFIX} at " \
                                       f"{self.state.address}: {e}"
                if first:
                    logger.warning("worker %r: %s; %s", self.worker_id, self._last_error,
                                   "fencing after the TTL" if self.fence_when_unreachable
                                   else "serving on without renewing its lease")
                if self.fence_when_unreachable and time.monotonic() - self._last_ok >= self.ttl_s:
                    self._fence(False, f"{ClusterStateUnavailable.PREFIX} at "
                                       f"{self.state.address}: no lease renewal succeeded for "
                                       f"{self.ttl_s} s (generation {self.generation}): {e!r}")
                continue
            with self._lock:
                was_down, self._last_error = self._last_error is not None, None
            if was_down:
                logger.warning("worker %r: the cluster state is reachable again (%s)",
                               self.worker_id, answer)
            if answer == "fenced":
                current = self._current_generation()
                self._fence(True, f"worker {self.worker_id!r} generation {self.generation} was "
                                  f"fenced: the current generation is {current}")
                return
            with self._lock:
                self._last_ok = t0
                lifted = self._fenced_lost and not self._fenced_for_good
                self._fenced_lost = False
            if answer == "reasserted":
                logger.warning("worker %r reasserted its lease (generation %d): the cluster "
                               "state had lost it", self.worker_id, self.generation)
            if lifted and self._on_unfenced is not None:
                self._on_unfenced()

    def _current_generation(self) -> int | str:
        try:
            current = self.state.generation(self.worker_id)
        except redis.exceptions.RedisError:
            return "unknown"
        return "unknown" if current is None else current

    def _fence(self, for_good: bool, reason: str) -> None:
        with self._lock:
            # Notify on every escalation: unfenced -> fenced, and temporary -> for good.
            news = not self._fenced_for_good and (for_good or not self._fenced_lost)
            if for_good:
                self._fenced_for_good = True
            else:
                self._fenced_lost = True
            self._reason = reason
        if news:
            logger.warning("lease fenced: %s", reason)
            if self._on_fenced is not None:
                self._on_fenced(reason)

    def stop(self, deregister: bool = True) -> None:
        """Stop renewing; with ``deregister``, drop the worker's record and lease.

        Dropping happens only if this generation is still the latest, and a
        Redis error while dropping is logged, not raised (the lease then lapses
        by itself within ``ttl_s``). Idempotent.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread is not threading.current_thread():     # stop() may be called from a callback
            thread.join()
        if deregister and not self._fenced_for_good:
            try:
                self.state.drop_worker(self.worker_id, self.generation)
            except redis.exceptions.RedisError as e:
                logger.warning("could not drop worker %r generation %d: %r",
                               self.worker_id, self.generation, e)
