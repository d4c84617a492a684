"""The worker registry shared by every router: worker records and leases in Redis.

Each worker registers itself (:class:`tandem.control.lease.LeaseKeeper`) with a
generation number and keeps a liveness key alive with a TTL. A router's
:class:`RedisRegistry` is a local :class:`InProcessRegistry` view of those
records, refreshed in the background (:meth:`RedisRegistry.refresh`, about once
a second), so routing a request never waits on Redis:

* a record with a larger generation than the handle's is a restarted worker:
  the handle is replaced (its prefix-index entries and requests go with it);
* a record whose lease lapsed marks the worker dead;
* a router that sees a worker's actor die (a failed call) marks it dead at once
  and deletes its lease (:meth:`~tandem.control.state.ClusterState.mark_suspect`),
  so every other router sees it on its next refresh, without waiting for the TTL;
* the view never drops workers because Redis lost its data (flushed or
  restarted empty): the workers re-assert their records within a renewal
  interval, some before others. A changed cluster-state epoch
  (:meth:`~tandem.control.state.ClusterState.epoch`), or every lease gone at
  once, starts a grace period: no worker is marked dead by its lease for
  ``flush_grace_s``; one still silent after that is;
* while Redis is unreachable the view is kept as it is (requests are routed on
  it; no worker is marked dead for want of a lease), and the first refresh that
  reaches it again starts the same grace: leases expired during the outage
  while nobody could renew them, and the workers renew at different moments.
  A worker whose actor dies meanwhile is still seen dead at once (a failed call).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import redis

from tandem.control.state import LEASE_TTL_S, ClusterState, ClusterStateUnavailable, WorkerRecord
from tandem.router.registry import InProcessRegistry, WorkerHandle

logger = logging.getLogger(__name__)


class RedisRegistry(InProcessRegistry):
    """:class:`InProcessRegistry` kept in step with the cluster state in Redis.

    Use it from the router's event loop; the Redis and actor lookups of
    :meth:`refresh` run on a thread.

    Args:
        state: the cluster state connection.
        resolve_actor: the actor handle of a record (e.g. ``ray.get_actor`` of its
            ``actor_name``); may raise when the actor is gone (the record is skipped).
        flush_grace_s: seconds every registered worker may be silent at once before
            they are believed dead (default: two lease TTLs); also the grace after
            Redis was unreachable.
    """

    def __init__(self, state: ClusterState, resolve_actor: Callable[[WorkerRecord], Any],
                 flush_grace_s: float = 2 * LEASE_TTL_S) -> None:
        super().__init__()
        self.state = state
        self.resolve_actor = resolve_actor
        self.flush_grace_s = flush_grace_s
        self._all_silent_since: float | None = None
        self._epoch: str | None = None
        self._unreachable_since: float | None = None
        self._state_error: str | None = None
        self._task: asyncio.Task | None = None
        self.starting: set[str] = set()
        """Ids whose new incarnation this process is still wiring (its supervisor puts
        it in service itself; a refresh must not do it before its KV channels exist)."""
        self.retiring: set[str] = set()
        """Ids this process is taking out of service (scale-down): a refresh must not
        put them back while their records are still being dropped."""

    # -- reachability -----------------------------------------------------------------------
    @property
    def state_reachable(self) -> bool:
        """The last refresh reached Redis (True before the first one)."""
        return self._unreachable_since is None

    @property
    def state_error(self) -> str | None:
        """Why the cluster state is unreachable (``"cluster state (Redis) unreachable at
        HOST:PORT/DB (...)"``); None while it is reachable."""
        return self._state_error

    def _unreachable(self, exc: BaseException) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
            self._state_error = str(ClusterStateUnavailable(self.state.address, "", exc))
            logger.warning("%s; routing on the last view of %d workers until it is back",
                           self._state_error, len(self._workers))

    def _reachable(self) -> None:
        if self._unreachable_since is None:
            return
        down_s = time.monotonic() - self._unreachable_since
        self._unreachable_since = self._state_error = None
        # Leases expired while nobody could renew them: give every worker the grace
        # to re-assert, as after a flush.
        self._all_silent_since = time.monotonic()
        logger.warning("the cluster state is reachable again after %.1f s; keeping %d "
                       "workers for %.0f s while they renew", down_s,
                       len(self.alive()), self.flush_grace_s)

    # -- refreshing ------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the records once and apply them (new, restarted and lapsed workers).

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable (the
                view is kept, and :attr:`state_reachable` is False until a refresh
                reaches it again).
        """
        def read():       # the epoch after the records: a loss between them is seen
            return self.state.workers(), self.state.draining(), self.state.epoch()
        try:
            records, draining, epoch = await asyncio.to_thread(read)
        except redis.exceptions.RedisError as exc:
            self._unreachable(exc)
            raise
        self._reachable()
        fresh: dict[str, tuple[WorkerRecord, Any]] = {}
        for rec in records:
            known = self._workers.get(rec.worker_id)
            if rec.worker_id in self.starting or rec.worker_id in self.retiring:
                continue
            if rec.alive and (known is None or rec.generation > known.generation):
                try:
                    actor = await asyncio.to_thread(self.resolve_actor, rec)
                except Exception as exc:      # registered but already gone
                    logger.debug("worker %s g%d: no actor (%s)", rec.worker_id, rec.generation, exc)
                    continue
                fresh[rec.worker_id] = (rec, actor)
        self.apply(records, fresh, epoch, draining)

    def apply(self, records: list[WorkerRecord],
              actors: dict[str, tuple[WorkerRecord, Any]], epoch: str | None = None,
              draining: dict[str, int] | None = None) -> None:
        """Apply one read of the records (:meth:`refresh` without the I/O).

        Args:
            records: every worker record in the cluster state.
            actors: for records to put in service: their record and actor handle.
            epoch: the cluster state's epoch read after ``records`` (None: unknown);
                a change since the last read starts the grace period.
            draining: worker id -> generation being drained (None: unknown, keep the
                handles' flags).
        """
        for rec, actor in actors.values():
            self.add(WorkerHandle(rec.worker_id, rec.role, actor, dict(rec.info),
                                  generation=rec.generation))
        if draining is not None:
            for w in self._workers.values():
                w.draining = draining.get(w.worker_id) == w.generation
        live = {r.worker_id: r for r in records if r.alive}
        lapsed = [w for w in self._workers.values()
                  if w.alive and (w.worker_id not in live
                                  or live[w.worker_id].generation != w.generation)]
        alive_now = [w for w in self._workers.values() if w.alive]
        now = time.monotonic()
        if epoch is not None:
            if self._epoch is not None and epoch != self._epoch:
                self._all_silent_since = now
                logger.warning("the cluster state was lost (Redis flushed or restarted); "
                               "keeping %d workers for %.0f s while they re-assert",
                               len(alive_now), self.flush_grace_s)
            self._epoch = epoch
        if (lapsed and len(lapsed) == len(alive_now) and not live
                and self._all_silent_since is None):
            # Nobody heartbeats: Redis lost its state; the workers will re-assert.
            self._all_silent_since = now
            logger.warning("no worker lease in the cluster state (every worker gave up or "
                           "lost its lease, or Redis was flushed or restarted); keeping %d "
                           "workers for %.0f s unless they are found dead",
                           len(lapsed), self.flush_grace_s)
        if self._all_silent_since is not None:
            # After such a loss every worker gets the grace to re-assert, not only
            # until the first one does.
            if now - self._all_silent_since < self.flush_grace_s:
                return
            self._all_silent_since = None
        for w in lapsed:
            rec = live.get(w.worker_id)
            if rec is not None and rec.generation > w.generation:
                continue            # its successor is being put in service (next refresh)
            logger.warning("worker %s g%d: lease lapsed", w.worker_id, w.generation)
            super().mark_dead(w.worker_id)

    def start(self, interval_s: float = 1.0) -> None:
        """Refresh every ``interval_s`` seconds on the running loop until :meth:`stop`."""
        async def run() -> None:
            while True:
                try:
                    await self.refresh()
                except asyncio.CancelledError:
                    raise
                except redis.exceptions.RedisError as exc:
                    # Redis down: keep the last view, try again (logged once per outage).
                    logger.debug("cluster state refresh failed: %s", exc)
                except Exception as exc:
                    logger.warning("cluster state refresh failed: %s", exc)
                await asyncio.sleep(interval_s)
        self._task = asyncio.ensure_future(run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- liveness --------------------------------------------------------------------------
    def mark_dead(self, worker_id: str) -> bool:
        """Mark the worker dead here at once, and (in the background) delete its
        lease so every router sees it (see the module docstring)."""
        w = self.get(worker_id)
        changed = super().mark_dead(worker_id)
        if changed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                loop.run_in_executor(None, self._suspect, worker_id, w.generation)
            else:
                self._suspect(worker_id, w.generation)
        return changed

    def _suspect(self, worker_id: str, generation: int) -> None:
        try:
            self.state.mark_suspect(worker_id, generation)
        except Exception as exc:
            logger.warning("marking %s suspect in the cluster state failed: %s", worker_id, exc)
