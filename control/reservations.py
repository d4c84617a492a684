"""Select-and-reserve: the routers' shared count of in-flight requests per worker.

Several routers that each read the load and then pick the least loaded worker
all pick the same one between two load reports (the herd). Here the pick and
the reservation are one atomic step over state every router shares: each
reservation immediately counts against the worker for the next pick, whichever
router makes it.

A reservation is ``request_id`` on ``(pool, worker_id)``, with an expiry: a
router that dies without releasing leaks its reservations for at most ``ttl_s``
seconds. A long request is kept reserved by :meth:`Reservations.refresh`. Pools
keep unrelated counts apart (``prefill`` and ``decode`` reservations of one
colocated worker, say).

:class:`InProcessReservations` serves one router (and tests);
:class:`RedisReservations` is shared by every router of the cluster.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Callable

from tandem.control.state import ClusterState, ttl_ms


class Reservations(ABC):
    """In-flight requests per worker, shared by every router.

    The pick and the reservation are one atomic step: no other reservation can
    come between reading the counts and recording the new one.
    """

    @abstractmethod
    def reserve(self, pool: str, candidates: Sequence[tuple[str, float]], request_id: str,
                ttl_s: float = 60.0) -> str:
        """Pick a worker for ``request_id`` and reserve it there, atomically.

        Expired reservations of the candidates are dropped first. The pick is the
        candidate with the smallest ``inflight(worker) + cost``, the first in
        ``candidates`` order on ties. Reserving a request already reserved on
        the picked worker only moves its expiry.

        Args:
            candidates: ``(worker_id, cost)`` in tie-break order; cost is in
                units of in-flight requests (e.g. a prefix-cache miss penalty).
            ttl_s: the reservation expires this many seconds from now.

        Returns:
            The picked ``worker_id``.

        Raises:
            ValueError: ``candidates`` is empty, a cost is not finite, or ``ttl_s``
                is not positive.
        """

    @abstractmethod
    def release(self, pool: str, worker_id: str, request_id: str) -> None:
        """Remove the reservation (request finished or failed); a no-op if it is not there."""

    @abstractmethod
    def refresh(self, pool: str, entries: Sequence[tuple[str, str]], ttl_s: float = 60.0) -> None:
        """Keep ``(worker_id, request_id)`` reserved: expiry pushed to ``ttl_s`` from now,
        re-created when missing. A router refreshes only its requests still in flight,
        so a missing one was lost with the state (Redis flushed or restarted) or
        expired while the router could not reach it, and is counted again from here.
        (A router that released one while its refresh ran releases it again.)

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """

    @abstractmethod
    def inflight(self, pool: str, worker_ids: Sequence[str]) -> dict[str, int]:
        """Unexpired reservations per worker (0 for a worker without any)."""

    @abstractmethod
    def drop_worker(self, pool: str, worker_id: str) -> None:
        """Forget every reservation on the worker (it died or left)."""


def _check(candidates: Sequence[tuple[str, float]], ttl_s: float) -> None:
    if not candidates:
        raise ValueError("reserve: no candidates")
    bad = [(w, c) for w, c in candidates if not math.isfinite(c)]
    if bad:
        raise ValueError(f"reserve: costs must be finite, got {bad}")
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")


class InProcessReservations(Reservations):
    """:class:`Reservations` in a dict, for one router; thread-safe.

    Args:
        clock: the time source, in seconds (the monotonic clock; tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], dict[str, float]] = {}   # (pool, worker) -> {request: expiry}

    def _live(self, pool: str, worker_id: str, now: float) -> dict[str, float]:
        entries = self._entries.setdefault((pool, worker_id), {})
        for rid in [r for r, exp in entries.items() if exp <= now]:
            del entries[rid]
        return entries

    def reserve(self, pool: str, candidates: Sequence[tuple[str, float]], request_id: str,
                ttl_s: float = 60.0) -> str:
        _check(candidates, ttl_s)
        with self._lock:
            now = self._clock()
            best, best_score = None, 0.0
            for worker_id, cost in candidates:
                score = len(self._live(pool, worker_id, now)) + cost
                if best is None or score < best_score:
                    best, best_score = worker_id, score
            self._entries[(pool, best)][request_id] = now + ttl_s
            return best

    def release(self, pool: str, worker_id: str, request_id: str) -> None:
        with self._lock:
            self._entries.get((pool, worker_id), {}).pop(request_id, None)

    def refresh(self, pool: str, entries: Sequence[tuple[str, str]], ttl_s: float = 60.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        with self._lock:
            now = self._clock()
            for worker_id, request_id in entries:
                self._live(pool, worker_id, now)[request_id] = now + ttl_s

    def inflight(self, pool: str, worker_ids: Sequence[str]) -> dict[str, int]:
        with self._lock:
            now = self._clock()
            return {wid: len(self._live(pool, wid, now)) for wid in worker_ids}

    def drop_worker(self, pool: str, worker_id: str) -> None:
        with self._lock:
            self._entries.pop((pool, worker_id), None)


# Shared by the scripts: the Redis clock in ms, and a key's own expiry kept at least as
# late as its latest member's (an abandoned set disappears; a live one never early).
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function extend(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
"""

# KEYS: one set per candidate. ARGV: request_id, ttl_ms, cost per candidate.
_RESERVE = _PRELUDE + """
local ttl = tonumber(ARGV[2])
local best, best_score = 0, 0
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local score = redis.call('ZCARD', key) + tonumber(ARGV[2 + i])
  if best == 0 or score < best_score then best, best_score = i, score end
end
redis.call('ZADD', KEYS[best], now + ttl, ARGV[1])
extend(KEYS[best], ttl)
return best - 1
"""

# KEYS: the set of each entry. ARGV: ttl_ms, request_id per entry.
_REFRESH = _PRELUDE + """
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + ttl, ARGV[1 + i])
  extend(key, ttl)
end
return 0
"""

# KEYS: one set per worker. Read-only.
_INFLIGHT = _PRELUDE + """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('ZCOUNT', key, '(' .. now, '+inf') end
return out
"""


class RedisReservations(Reservations):
    """:class:`Reservations` in Redis, shared by every router; expiry by the Redis clock.

    One sorted set per ``(pool, worker)``, ``{ns}:inflight:{pool}:{worker_id}``:
    member ``request_id``, score its expiry in Redis-clock milliseconds. The set
    itself expires with its latest member. :meth:`reserve` is one Lua script.

    Every method raises ``redis.exceptions.ConnectionError`` / ``TimeoutError``
    when Redis is unreachable.

    Args:
        state: the cluster state connection.
    """

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._reserve = state.redis.register_script(_RESERVE)
        self._refresh = state.redis.register_script(_REFRESH)
        self._inflight = state.redis.register_script(_INFLIGHT)

    def _key(self, pool: str, worker_id: str) -> str:
        return self.state.key("inflight", pool, worker_id)

    def reserve(self, pool: str, candidates: Sequence[tuple[str, float]], request_id: str,
                ttl_s: float = 60.0) -> str:
        _check(candidates, ttl_s)
        index = self._reserve(keys=[self._key(pool, wid) for wid, _ in candidates],
                              args=[request_id, ttl_ms(ttl_s), *(repr(float(c)) for _, c in candidates)])
        return candidates[int(index)][0]

    def release(self, pool: str, worker_id: str, request_id: str) -> None:
        self.state.redis.zrem(self._key(pool, worker_id), request_id)

    def refresh(self, pool: str, entries: Sequence[tuple[str, str]], ttl_s: float = 60.0) -> None:
        ms = ttl_ms(ttl_s)
        if entries:
            self._refresh(keys=[self._key(pool, wid) for wid, _ in entries],
                          args=[ms, *(rid for _, rid in entries)])

    def inflight(self, pool: str, worker_ids: Sequence[str]) -> dict[str, int]:
        if not worker_ids:
            return {}
        counts = self._inflight(keys=[self._key(pool, wid) for wid in worker_ids])
        return {wid: int(n) for wid, n in zip(worker_ids, counts)}

    def drop_worker(self, pool: str, worker_id: str) -> None:
        self.state.redis.delete(self._key(pool, worker_id))
