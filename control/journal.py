"""The request journal: enough of each running request to restart it elsewhere.

When a worker dies mid-request, the router that owns the request re-submits it
to another worker as the prompt plus the tokens already streamed to the client,
so the client sees one uninterrupted stream. When a router dies, another one
can find its requests (:meth:`RequestJournal.active`) and do the same. The
journal holds, per request: the owning router, the request's parameters
(``record``: prompt ids, sampling parameters, priority, ... as JSON-able data),
the tokens generated so far, and the worker and attempt it runs on now.

Lifecycle: :meth:`~RequestJournal.begin` when the request is admitted,
:meth:`~RequestJournal.assign` at each (re)placement, :meth:`~RequestJournal.append_tokens`
as tokens stream, :meth:`~RequestJournal.finish` when it ends, however it ends.
"""

from __future__ import annotations

import copy
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.control.state import ClusterState, ttl_ms


@dataclass
class JournalEntry:
    """One journaled request.

    Attributes:
        request_id: the request; router_id: the router that owns it.
        record: its parameters, as given to :meth:`RequestJournal.begin`.
        token_ids: the tokens generated so far, in order.
        worker_id: the worker it runs on now; ``None`` before the first assignment.
        attempt: the placement number: 0 before the first assignment, then as assigned.
    """

    request_id: str
    router_id: str
    record: dict
    token_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None
    attempt: int = 0


class RequestJournal(ABC):
    """Running requests with their parameters and generated tokens; see the module docstring."""

    @abstractmethod
    def begin(self, request_id: str, router_id: str, record: dict) -> None:
        """Journal a new request owned by ``router_id``; an existing entry of that id starts over.

        Args:
            record: JSON-able parameters (prompt ids, sampling parameters dict, priority, ...).

        Raises:
            TypeError: ``record`` is not JSON-able (Redis journal).
        """

    @abstractmethod
    def assign(self, request_id: str, worker_id: str, attempt: int) -> None:
        """Record that the request now runs on ``worker_id``, as placement ``attempt``.

        Raises:
            KeyError: no such request (never begun, finished, or expired).
        """

    @abstractmethod
    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Add generated tokens, in order. No tokens: a no-op.

        Raises:
            KeyError: no such request (never begun, finished, or expired).
        """

    @abstractmethod
    def load(self, request_id: str) -> JournalEntry | None:
        """The request's entry (a copy); ``None`` for an unknown request."""

    @abstractmethod
    def finish(self, request_id: str) -> None:
        """Remove the request (it ended); a no-op for an unknown request."""

    @abstractmethod
    def active(self, router_id: str | None = None) -> list[str]:
        """Ids of journaled requests, of one router or of all (``None``), sorted."""


class InProcessJournal(RequestJournal):
    """:class:`RequestJournal` in a dict, for one router; thread-safe. Entries never expire."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, JournalEntry] = {}

    def _get(self, request_id: str) -> JournalEntry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise KeyError(f"no journaled request {request_id!r}") from None

    def begin(self, request_id: str, router_id: str, record: dict) -> None:
        with self._lock:
            self._entries[request_id] = JournalEntry(request_id, router_id, copy.deepcopy(record))

    def assign(self, request_id: str, worker_id: str, attempt: int) -> None:
        with self._lock:
            entry = self._get(request_id)
            entry.worker_id, entry.attempt = worker_id, attempt

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        with self._lock:
            self._get(request_id).token_ids.extend(int(t) for t in token_ids)

    def load(self, request_id: str) -> JournalEntry | None:
        with self._lock:
            entry = self._entries.get(request_id)
            return None if entry is None else copy.deepcopy(entry)

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def active(self, router_id: str | None = None) -> list[str]:
        with self._lock:
            return sorted(rid for rid, e in self._entries.items()
                          if router_id is None or e.router_id == router_id)


# KEYS: entry hash, tokens list, active index. ARGV: ttl_ms, request_id, router_id,
# record, the router index key prefix.
_BEGIN = """
local old = redis.call('HGET', KEYS[1], 'router_id')
if old and old ~= ARGV[3] then redis.call('SREM', ARGV[5] .. old, ARGV[2]) end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'router_id', ARGV[3], 'record', ARGV[4], 'attempt', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', ARGV[5] .. ARGV[3], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
"""

# KEYS: entry hash, tokens list, active index. ARGV: request_id, the router index key prefix.
_FINISH = """
local router = redis.call('HGET', KEYS[1], 'router_id')
if router then redis.call('SREM', ARGV[2] .. router, ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
"""

# KEYS: entry hash, tokens list. ARGV: ttl_ms, worker_id, attempt.
_ASSIGN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'worker_id', ARGV[2], 'attempt', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: entry hash, tokens list. ARGV: ttl_ms, token ids... (pushed in chunks: unpack()
# is bounded by the Lua stack).
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""


class RedisJournal(RequestJournal):
    """:class:`RequestJournal` in Redis, readable by every router.

    Keys per request: ``{ns}:journal:{request_id}`` (hash: router_id, record as
    JSON, worker_id, attempt) and ``{ns}:journal:{request_id}:tokens`` (list).
    Both expire ``ttl_s`` after the request's last write, so a request whose
    router vanished does not stay forever. ``{ns}:journal_router:{router_id}``
    and ``{ns}:journal_active`` index the ids; ids whose entry expired are pruned
    from them by :meth:`active`. Each write is one script (atomic, one round
    trip); :meth:`load` is one MULTI pipeline.

    Every method raises ``redis.exceptions.ConnectionError`` / ``TimeoutError``
    when Redis is unreachable.

    Args:
        state: the cluster state connection.
        ttl_s: entry lifetime after its last write, in seconds.

    Raises:
        ValueError: ``ttl_s`` is not positive.
    """

    def __init__(self, state: ClusterState, ttl_s: float = 3600.0) -> None:
        self.state = state
        self.ttl_ms = ttl_ms(ttl_s)
        self._begin = state.redis.register_script(_BEGIN)
        self._finish = state.redis.register_script(_FINISH)
        self._assign = state.redis.register_script(_ASSIGN)
        self._append = state.redis.register_script(_APPEND)

    def _keys(self, request_id: str) -> tuple[str, str]:
        entry = self.state.key("journal", request_id)
        return entry, entry + ":tokens"

    def _router_key(self, router_id: str) -> str:
        return self.state.key("journal_router", router_id)

    def begin(self, request_id: str, router_id: str, record: dict) -> None:
        self._begin(keys=[*self._keys(request_id), self.state.key("journal_active")],
                    args=[self.ttl_ms, request_id, router_id, json.dumps(record),
                          self.state.key("journal_router", "")])

    def assign(self, request_id: str, worker_id: str, attempt: int) -> None:
        if not self._assign(keys=list(self._keys(request_id)), args=[self.ttl_ms, worker_id, attempt]):
            raise KeyError(f"no journaled request {request_id!r}")

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        if not self._append(keys=list(self._keys(request_id)),
                            args=[self.ttl_ms, *(int(t) for t in token_ids)]):
            raise KeyError(f"no journaled request {request_id!r}")

    def load(self, request_id: str) -> JournalEntry | None:
        entry, tokens = self._keys(request_id)
        pipe = self.state.redis.pipeline(transaction=True)
        pipe.hgetall(entry)
        pipe.lrange(tokens, 0, -1)
        fields, token_ids = pipe.execute()
        if not fields:
            return None
        return JournalEntry(request_id=request_id, router_id=fields["router_id"],
                            record=json.loads(fields["record"]),
                            token_ids=[int(t) for t in token_ids],
                            worker_id=fields.get("worker_id"), attempt=int(fields["attempt"]))

    def finish(self, request_id: str) -> None:
        self._finish(keys=[*self._keys(request_id), self.state.key("journal_active")],
                     args=[request_id, self.state.key("journal_router", "")])

    def active(self, router_id: str | None = None) -> list[str]:
        index = self.state.key("journal_active") if router_id is None else self._router_key(router_id)
        ids = sorted(self.state.redis.smembers(index))
        if not ids:
            return []
        pipe = self.state.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.exists(self._keys(rid)[0])
        present = pipe.execute()
        gone = [rid for rid, p in zip(ids, present) if not p]
        if gone:
            self.state.redis.srem(index, *gone)
        return [rid for rid, p in zip(ids, present) if p]
