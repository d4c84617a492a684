"""What the routers observe, written to the cluster state for the planner.

Every router has a :class:`LoadReporter`; it buffers its requests' arrivals and
completions and, about once a second, writes them and the latest load of every
worker it follows::

    {ns}:planner:requests    stream   one entry per arrival (kind=arrival, isl) and
                                      per finished request (kind=finish, isl, osl,
                                      ttft_s, itl_s, prefill, decode, ok)
    {ns}:planner:workers     hash     worker_id -> JSON of its latest load
                                      (role, queued_prefill_tokens, kv_cache_usage,
                                      num_running, num_waiting)

Stream entry ids come from the Redis clock, so the planner cuts intervals from
entries written by routers on different hosts on one time line. The stream is
capped (``MAXLEN ~``) at :data:`STREAM_MAXLEN` entries; the hash keeps one entry
per worker id and the planner reads only the ids the registry lists as alive.

:class:`LoadReader` is the planner's side: the entries since the last read, and
the worker loads.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass

from tandem.control.state import ClusterState

STREAM_MAXLEN = 50_000
"""Entries the request stream keeps (approximately; older ones are trimmed)."""


@dataclass(frozen=True)
class RequestSample:
    """One finished request as a router saw it.

    Attributes:
        isl, osl: prompt (input) and output lengths, in tokens.
        ttft_s: time to first token in seconds (None if no token came).
        itl_s: mean inter-token latency in seconds ((e2e - ttft) / (osl - 1));
            None for fewer than two tokens.
        prefill, decode: the workers that ran it ("" for none: colocated prefill).
        ok: it finished by stop or length (not aborted, not failed).
    """

    isl: int
    osl: int
    ttft_s: float | None
    itl_s: float | None
    prefill: str
    decode: str
    ok: bool


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's latest load, as a router last saw it (from its step stats).

    Attributes:
        role: ``prefill``, ``decode`` or ``colocated``.
        queued_prefill_tokens: prompt tokens waiting or being prefilled (tokens).
        kv_cache_usage: fraction of its KV blocks in use, 0..1.
        num_running, num_waiting: requests running / waiting in its scheduler.
    """

    role: str
    queued_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0


def _opt(value: str) -> float | None:
    return None if value == "" else float(value)


class LoadReporter:
    """A router's buffer of observations, flushed to the cluster state.

    :meth:`arrival` and :meth:`finished` may be called from any thread; call
    :meth:`flush` periodically (it does the Redis I/O).

    Args:
        state: the cluster state connection.
        router_id: written with each entry (for operators reading the stream).
    """

    def __init__(self, state: ClusterState, router_id: str) -> None:
        self.state = state
        self.router_id = router_id
        self.stream = state.key("planner", "requests")
        self.workers_key = state.key("planner", "workers")
        self._lock = threading.Lock()
        self._entries: list[dict] = []

    def arrival(self, isl: int) -> None:
        """A request of ``isl`` prompt tokens was admitted."""
        with self._lock:
            self._entries.append({"kind": "arrival", "isl": int(isl)})

    def finished(self, sample: RequestSample) -> None:
        """A request is over (every exit path, once)."""
        entry = {"kind": "finish", **{k: ("" if v is None else v) for k, v in asdict(sample).items()}}
        entry["ok"] = int(sample.ok)
        with self._lock:
            self._entries.append(entry)

    def flush(self, loads: dict[str, WorkerLoad]) -> int:
        """Write the buffered entries and ``loads`` (worker id -> load) in one pipeline.

        Returns:
            The number of request entries written.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable
            (the entries are kept for the next flush, up to :data:`STREAM_MAXLEN`).
        """
        with self._lock:
            entries, self._entries = self._entries, []
        if not entries and not loads:
            return 0
        pipe = self.state.redis.pipeline(transaction=False)
        for e in entries:
            pipe.xadd(self.stream, {**e, "router": self.router_id}, maxlen=STREAM_MAXLEN,
                      approximate=True)
        if loads:
            pipe.hset(self.workers_key, mapping={wid: json.dumps(asdict(load))
                                                 for wid, load in loads.items()})
        try:
            pipe.execute()
        except Exception:
            with self._lock:
                self._entries = (entries + self._entries)[-STREAM_MAXLEN:]
            raise
        return len(entries)


@dataclass
class Observations:
    """The stream entries read in one go: arrivals and finished requests.

    Attributes:
        arrivals: prompt lengths of the requests that arrived (tokens).
        finished: the requests that finished.
        first_ms, last_ms: Redis-clock milliseconds of the first and last entry
            (None when nothing was read).
    """

    arrivals: list[int]
    finished: list[RequestSample]
    first_ms: int | None = None
    last_ms: int | None = None


class LoadReader:
    """The planner's reader of what the routers wrote (see the module docstring).

    Args:
        state: the cluster state connection.
        start: read entries after this stream id; ``"$"`` (default) = only entries
            written after the first :meth:`read`.
    """

    def __init__(self, state: ClusterState, start: str = "$") -> None:
        self.state = state
        self.stream = state.key("planner", "requests")
        self.workers_key = state.key("planner", "workers")
        self.last_id = start

    def read(self, count: int = 10_000) -> Observations:
        """Every entry since the last read (at most ``count`` per call).

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        r = self.state.redis
        if self.last_id == "$":       # the stream's current end: start from there
            info = r.xrevrange(self.stream, count=1)
            self.last_id = info[0][0] if info else "0-0"
            return Observations([], [])
        rows = r.xrange(self.stream, min=f"({self.last_id}", count=count)
        obs = Observations([], [])
        for entry_id, f in rows:
            ms = int(entry_id.split("-", 1)[0])
            obs.first_ms = ms if obs.first_ms is None else obs.first_ms
            obs.last_ms = ms
            if f.get("kind") == "arrival":
                obs.arrivals.append(int(f["isl"]))
            elif f.get("kind") == "finish":
                obs.finished.append(RequestSample(
                    isl=int(f["isl"]), osl=int(f["osl"]), ttft_s=_opt(f["ttft_s"]),
                    itl_s=_opt(f["itl_s"]), prefill=f["prefill"], decode=f["decode"],
                    ok=f["ok"] == "1"))
        if rows:
            self.last_id = rows[-1][0]
        return obs

    def worker_loads(self, worker_ids) -> dict[str, WorkerLoad]:
        """The latest load of each of ``worker_ids`` that a router reported.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        ids = list(worker_ids)
        if not ids:
            return {}
        values = self.state.redis.hmget(self.workers_key, ids)
        return {wid: WorkerLoad(**json.loads(v)) for wid, v in zip(ids, values) if v is not None}

    def forget_workers(self, worker_ids) -> None:
        """Drop the reported loads of removed workers.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        ids = list(worker_ids)
        if ids:
            self.state.redis.hdel(self.workers_key, *ids)
