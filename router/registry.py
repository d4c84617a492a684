"""The cluster's workers as the router sees them: who is there, who is alive, their load.

:class:`WorkerRegistry` is the interface the router's request path and routing
policy read from; :class:`InProcessRegistry` is today's implementation, a dict
of :class:`WorkerHandle` in the router process. A registry shared by several
routers (in Redis, with leases) implements the same interface by keeping a local
view that it refreshes in the background, so that routing a request never waits
on a round trip. Workers are identified by ``worker_id`` only; a handle's
``actor`` is opaque to the registry (a Ray actor handle today).

Roles: ``prefill`` workers only prefill; ``decode`` workers decode requests
prefilled elsewhere; ``colocated`` workers do both. The *decode side* of the
cluster is its decode and colocated workers: every request runs its decode steps
on one of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Callable

from tandem.engine.runtime.outputs import WorkerStats
from tandem.router.worker_client import WorkerClient

ROLES = ("prefill", "decode", "colocated")
DECODE_ROLES = ("decode", "colocated")


@dataclass
class WorkerHandle:
    """One worker as the router sees it.

    Attributes:
        worker_id: e.g. ``decode-0``; role: ``prefill``, ``decode`` or ``colocated``.
        actor: the Ray actor handle (or any object with the same async methods).
        info: the worker's model and cache facts (``block_size``, ``num_blocks``,
            ``kv_layout``, ...), as its ``info()`` returned them.
        stats: the latest :class:`WorkerStats` it reported.
        inflight_prefill_tokens: prompt tokens sent to it to prefill whose first token
            is not back yet: a prefill worker's queue; a decode worker's own
            prefills, where the router prefilled locally (``max_prefill_queue_tokens``).
        inflight_local_prefills: a decode worker's own prefills among them: this
            router's requests on it whose prompt it computes, first token not back.
        inflight_remote_prefills: this router's requests on a decode worker whose
            prompt a prefill worker computes, first token not back: they wait for
            their KV cache, no decode step of theirs yet.
        alive: False once a call to it failed because it is gone.
        generation: its incarnation number in the cluster state (0 without one):
            a restarted worker has a larger one; KV transfers carry it (fencing).
        draining: being taken out of service (scale-down): routers send it no new
            requests while another worker of its pool can take them.
        last_output_at: ``time.monotonic()`` when this router last received its
            step outputs (every engine step publishes one): a busy worker's
            progress; ``None`` before the first.
        last_step_s: how long its latest engine step took (seconds; 0 before one).
    """

    worker_id: str
    role: str
    actor: Any
    info: dict = field(default_factory=dict)
    stats: WorkerStats | None = None
    inflight_prefill_tokens: int = 0
    inflight_local_prefills: int = 0
    inflight_remote_prefills: int = 0
    alive: bool = True
    generation: int = 0
    draining: bool = False
    last_output_at: float | None = None
    last_step_s: float = 0.0

    @property
    def client(self) -> WorkerClient:
        """Typed calls to this worker (:class:`~tandem.router.worker_client.WorkerClient`)."""
        return WorkerClient(self.worker_id, self.actor)

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block (from ``info``); ``None`` if the worker did not say."""
        return self.info.get("block_size")


class WorkerRegistry(ABC):
    """The set of workers, their liveness and latest stats; notifies on changes.

    Listeners (:meth:`add_health_listener`, :meth:`add_worker_down_listener`)
    are called synchronously from the mutating call, after the change. The
    registry starts unable to serve (no worker), and a health listener is called
    only when :attr:`can_serve` changes.
    """

    def __init__(self) -> None:
        self._health_listeners: list[Callable[[bool], None]] = []
        self._down_listeners: list[Callable[[str], None]] = []
        self._up_listeners: list[Callable[[WorkerHandle], None]] = []
        self._last_healthy = False

    # -- membership (implementations) ---------------------------------------------------------
    @abstractmethod
    def add(self, worker: WorkerHandle) -> WorkerHandle | None:
        """Put ``worker`` in service; it replaces a registered worker with the same id.

        A replaced worker counts as down (its cache and requests are gone with
        it): worker-down listeners are called with its id, then worker-up
        listeners with ``worker``.

        Returns:
            The replaced handle, or ``None`` for a new id.

        Raises:
            ValueError: ``worker.role`` is not one of :data:`ROLES`.
        """

    @abstractmethod
    def remove(self, worker_id: str) -> WorkerHandle | None:
        """Take a worker out of the registry (scale-down). Worker-down listeners are called.

        Returns:
            The removed handle, or ``None`` for an unknown id.
        """

    @abstractmethod
    def get(self, worker_id: str) -> WorkerHandle:
        """The registered worker with this id, alive or not.

        Raises:
            KeyError: no such worker.
        """

    @abstractmethod
    def workers(self, role: str | None = None) -> list[WorkerHandle]:
        """Registered workers, alive or not, in the order they were first added.

        Args:
            role: ``None`` for all; ``"prefill"``; or ``"decode"`` for the decode
                side (decode and colocated workers).

        Raises:
            ValueError: another role.
        """

    @abstractmethod
    def mark_dead(self, worker_id: str) -> bool:
        """Record that a worker is gone (a call to it failed). It stays registered
        until replaced or removed. Worker-down listeners are called.

        Returns:
            ``True`` if it was alive; ``False`` if already dead (no-op).

        Raises:
            KeyError: no such worker.
        """

    @abstractmethod
    def update_stats(self, worker_id: str, stats: WorkerStats) -> None:
        """Store the worker's latest stats (from its step output or a stats poll).

        Raises:
            KeyError: no such worker.
        """

    # -- derived views ------------------------------------------------------------------------
    def alive(self, role: str | None = None) -> list[WorkerHandle]:
        """:meth:`workers` that are alive (same ``role`` meaning and errors)."""
        return [w for w in self.workers(role) if w.alive]

    def stats(self, worker_id: str) -> WorkerStats | None:
        """The worker's latest stats; ``None`` before its first report.

        Raises:
            KeyError: no such worker.
        """
        return self.get(worker_id).stats

    @property
    def disaggregated(self) -> bool:
        """A prefill worker is registered (alive or not): prompts go to prefill workers."""
        return bool(self.workers("prefill"))

    @property
    def healthy(self) -> bool:
        """Every pool has a live worker: a decode-side worker is alive and, when
        disaggregated, a prefill worker too (not degraded)."""
        if not self.alive("decode"):
            return False
        return not self.disaggregated or bool(self.alive("prefill"))

    @property
    def can_serve(self) -> bool:
        """Requests can run: a decode-side worker is alive. With the prefill pool
        empty the decode workers prefill for themselves (degraded, not refused)."""
        return bool(self.alive("decode"))

    # -- listeners ----------------------------------------------------------------------------
    def add_health_listener(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(serving)`` whenever :attr:`can_serve` changes: health says
        NOT_SERVING only when requests cannot be served (no decode-side worker);
        an empty prefill pool degrades, it does not refuse."""
        self._health_listeners.append(callback)

    def add_worker_down_listener(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(worker_id)`` when a worker dies, is replaced or removed
        (e.g. to drop its entries from a prefix index)."""
        self._down_listeners.append(callback)

    def add_worker_up_listener(self, callback: Callable[[WorkerHandle], None]) -> None:
        """Call ``callback(handle)`` when a worker is put in service (added or replacing
        one), e.g. to start polling its outputs."""
        self._up_listeners.append(callback)

    def _worker_up(self, worker: WorkerHandle) -> None:
        for cb in self._up_listeners:
            cb(worker)

    def _worker_down(self, worker_id: str) -> None:
        for cb in self._down_listeners:
            cb(worker_id)

    def _check_health(self) -> None:
        healthy = self.can_serve
        if healthy != self._last_healthy:
            self._last_healthy = healthy
            for cb in self._health_listeners:
                cb(healthy)


def _check_role(role: str | None, allowed: tuple[str, ...]) -> None:
    if role not in allowed:
        raise ValueError(f"role: unknown {role!r}, expected one of {', '.join(map(str, allowed))}")


class InProcessRegistry(WorkerRegistry):
    """Workers held as :class:`WorkerHandle` objects in this process.

    Not thread-safe: use it from the router's event loop.

    Args:
        workers: initial workers, added in order (listeners added later are not
            called for them; read :attr:`healthy` after adding listeners).
    """

    def __init__(self, workers: Iterable[WorkerHandle] = ()) -> None:
        super().__init__()
        self._workers: dict[str, WorkerHandle] = {}
        for w in workers:
            self.add(w)

    def add(self, worker: WorkerHandle) -> WorkerHandle | None:
        _check_role(worker.role, ROLES)
        old = self._workers.get(worker.worker_id)
        # Assigning to an existing key keeps its place: replacement keeps the order.
        self._workers[worker.worker_id] = worker
        if old is not None:
            self._worker_down(old.worker_id)
        self._worker_up(worker)
        self._check_health()
        return old

    def remove(self, worker_id: str) -> WorkerHandle | None:
        old = self._workers.pop(worker_id, None)
        if old is not None:
            self._worker_down(worker_id)
            self._check_health()
        return old

    def get(self, worker_id: str) -> WorkerHandle:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def workers(self, role: str | None = None) -> list[WorkerHandle]:
        _check_role(role, (None, "prefill", "decode"))
        if role is None:
            return list(self._workers.values())
        roles = DECODE_ROLES if role == "decode" else ("prefill",)
        return [w for w in self._workers.values() if w.role in roles]

    def mark_dead(self, worker_id: str) -> bool:
        w = self.get(worker_id)
        if not w.alive:
            return False
        w.alive = False
        self._worker_down(worker_id)
        self._check_health()
        return True

    def update_stats(self, worker_id: str, stats: WorkerStats) -> None:
        self.get(worker_id).stats = stats
