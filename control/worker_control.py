"""A worker's side of the cluster state: its lease and its KV event stream.

A worker started with a :class:`ControlConfig` registers itself in Redis under a
new generation, renews its lease on a thread and fences itself when it cannot
(:class:`~tandem.control.lease.LeaseKeeper`), and appends its KV cache events to
its Redis stream (:class:`~tandem.control.kv_events.KVEventPublisher`) for the
routers' prefix indexes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import redis

from tandem.control.kv_events import KVEventPublisher
from tandem.control.lease import LeaseKeeper
from tandem.control.state import (LEASE_TTL_S, RENEW_INTERVAL_S, ClusterState,
                                  ClusterStateUnavailable)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlConfig:
    """Where a worker finds the cluster state.

    Attributes:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        namespace: key prefix shared by the cluster's processes.
        actor_name: the worker's Ray actor name (routers look it up by it).
        lease_ttl_s, renew_interval_s: lease length and renewal period (seconds).
        min_generation: the least generation to register under (one more than the
            incarnation this worker replaces, 0 for a first start): generations stay
            increasing even if Redis lost the counter.
        cluster_secret: the secret a KV transfer peer must prove in the pair
            handshake (:mod:`tandem.kvtransfer.staging`); set in the worker's
            environment at start. Empty: keep the process's own (or none).
        fence_when_unreachable: refuse new work while Redis has been unreachable
            for a whole lease TTL. Off by default: a Redis outage is not the
            worker's, the routers keep their view of it, and a replacement (which
            fences it for good) can only happen through Redis anyway; see
            :mod:`tandem.control.lease`.
    """

    redis_url: str
    namespace: str = "tandem"
    actor_name: str = ""
    lease_ttl_s: float = LEASE_TTL_S
    renew_interval_s: float = RENEW_INTERVAL_S
    min_generation: int = 0
    cluster_secret: str = ""
    fence_when_unreachable: bool = False

    def __repr__(self) -> str:        # never print the secret
        return (f"ControlConfig(redis_url={self.redis_url!r}, namespace={self.namespace!r}, "
                f"actor_name={self.actor_name!r}, lease_ttl_s={self.lease_ttl_s}, "
                f"renew_interval_s={self.renew_interval_s}, min_generation={self.min_generation}, "
                f"fence_when_unreachable={self.fence_when_unreachable})")


class WorkerControl:
    """Registers the worker and keeps its lease; publishes its KV events.

    Args:
        config: the cluster state's address and the lease timing.
        worker_id, role: the worker.
        info: its model and cache facts (stored in its record).
        on_fenced: called with a reason when the lease is lost (stop taking work).
        on_unfenced: called when a lapsed lease is renewed again.

    Raises:
        ClusterStateUnavailable: Redis is unreachable at start-up (the worker cannot
            register; the message names Redis and its address).
    """

    def __init__(self, config: ControlConfig, worker_id: str, role: str, info: dict,
                 on_fenced: Callable[[str], None], on_unfenced: Callable[[], None]) -> None:
        self.config = config
        self.state = ClusterState(config.redis_url, config.namespace)
        self.lease = LeaseKeeper(self.state, worker_id, role, config.actor_name, info,
                                 ttl_s=config.lease_ttl_s, interval_s=config.renew_interval_s,
                                 on_fenced=on_fenced, on_unfenced=on_unfenced,
                                 min_generation=config.min_generation,
                                 fence_when_unreachable=config.fence_when_unreachable)
        try:
            self.lease.start()
        except redis.exceptions.RedisError as exc:
            self.state.close()
            raise ClusterStateUnavailable(self.state.address,
                                          f"worker {worker_id} cannot register", exc) from exc
        self.kv_events = KVEventPublisher(self.state, worker_id, self.lease.generation)
        self._publish_failed = False
        # Appends run on their own thread: a slow or absent Redis never stalls a step.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True,
                                           name=f"kv-events-{worker_id}")
        self._publisher.start()

    @property
    def generation(self) -> int:
        """This incarnation's generation number (>= 1)."""
        return self.lease.generation

    @property
    def state_reachable(self) -> bool:
        """The last lease renewal reached Redis."""
        return self.lease.state_reachable

    def publish_kv_events(self, events: Sequence) -> None:
        """Queue a step's KV events for the stream (called on the engine loop thread;
        returns at once). A failed append is logged once per outage; the readers see
        the sequence gap and drop this worker's entries, which it re-earns as it
        caches again."""
        if events:
            self._outbox.put(events)

    def _publish_loop(self) -> None:
        while (events := self._outbox.get()) is not None:
            try:
                self.kv_events.publish(events)
                self._publish_failed = False
            except Exception as exc:
                if not self._publish_failed:
                    logger.warning("publishing KV events failed: %s", exc)
                self._publish_failed = True

    def close(self, deregister: bool = True) -> None:
        self._outbox.put(None)
        self._publisher.join(5)
        self.lease.stop(deregister=deregister)
        self.state.close()


def start_worker_control(config: ControlConfig | None, worker_id: str, role: str, info: dict,
                         fence, loop) -> WorkerControl | None:
    """Register a worker in the cluster state and hook it up: lease loss fences it
    (``fence.fence(reason)`` / ``fence.unfence()``), and its engine loop's KV events
    go to its stream (``loop.kv_event_sink``). None (and nothing done) without a
    ``config``.

    Raises:
        ClusterStateUnavailable: Redis is unreachable (a ``redis.exceptions.ConnectionError``).
    """
    if config is None:
        return None
    if config.cluster_secret:
        from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV

        os.environ[CLUSTER_SECRET_ENV] = config.cluster_secret
    control = WorkerControl(config, worker_id, role, info, on_fenced=fence.fence,
                            on_unfenced=fence.unfence)
    loop.kv_event_sink = control.publish_kv_events
    return control
