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

import asyncio
import copy
import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.control.state import ClusterState, ttl_ms

logger = logging.getLogger(__name__)


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

    def write_batch(self, ops: Sequence[tuple]) -> list[BaseException | None]:
        """Apply writes in order: each op is ``(method, request_id, *args)`` with
        ``method`` one of ``begin``, ``assign``, ``append_tokens``, ``finish``. One
        failed op does not stop the others.

        Returns:
            per op, ``None`` or the exception it raised (``KeyError``: no such
            request; a connection error: the state store is unreachable).
        """
        results: list[BaseException | None] = []
        for method, rid, *args in ops:
            try:
                getattr(self, method)(rid, *args)
                results.append(None)
            except Exception as exc:       # returned, not raised: see the docstring
                results.append(exc)
        return results


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

    def write_batch(self, ops: Sequence[tuple]) -> list[BaseException | None]:
        """One round trip for the whole batch (a non-transactional pipeline of the
        scripts); see :meth:`RequestJournal.write_batch`.

        Raises:
            redis.exceptions.ConnectionError, TimeoutError: Redis is unreachable
                (then none of the batch is known to be written).
        """
        if not ops:
            return []
        pipe = self.state.redis.pipeline(transaction=False)
        for method, rid, *args in ops:
            keys = list(self._keys(rid))
            if method == "begin":
                router_id, record = args
                self._begin(keys=[*keys, self.state.key("journal_active")],
                            args=[self.ttl_ms, rid, router_id, json.dumps(record),
                                  self.state.key("journal_router", "")], client=pipe)
            elif method == "assign":
                worker_id, attempt = args
                self._assign(keys=keys, args=[self.ttl_ms, worker_id, attempt], client=pipe)
            elif method == "append_tokens":
                (token_ids,) = args
                if not token_ids:
                    continue
                self._append(keys=keys, args=[self.ttl_ms, *(int(t) for t in token_ids)],
                             client=pipe)
            elif method == "finish":
                self._finish(keys=[*keys, self.state.key("journal_active")],
                             args=[rid, self.state.key("journal_router", "")], client=pipe)
            else:
                raise ValueError(f"unknown journal write {method!r}")
        replies = iter(pipe.execute(raise_on_error=False))
        results: list[BaseException | None] = []
        for method, rid, *args in ops:
            if method == "append_tokens" and not args[0]:
                results.append(None)
                continue
            reply = next(replies)
            if isinstance(reply, Exception):
                results.append(reply)
            elif method in ("assign", "append_tokens") and not reply:
                results.append(KeyError(f"no journaled request {rid!r}"))
            else:
                results.append(None)
        return results

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


_SKIP = "skip"      # a queued write superseded by a rewrite of its whole entry


class JournalWriter:
    """Write-behind for a :class:`RequestJournal`, so that an asyncio event loop
    (the router's) never waits on the journal's round trips.

    :meth:`submit` only queues a write. One background task applies what is
    queued, as one :meth:`RequestJournal.write_batch` in a worker thread, then
    what was queued meanwhile, and so on: one batch in flight at a time, so a
    busy router makes one round trip per batch, not one per token, and appends
    of the same request queued between two batches merge into one. Writes of one
    request keep their order. :meth:`flush` waits until everything submitted
    before it is applied (a migration flushes before it checks the journal, so
    the journal is exact where it is read).

    A write that finds its entry gone (``KeyError``: the cluster state lost it,
    e.g. a Redis restart without persistence) has the whole entry written again
    from ``rewrite(request_id)``: ``(record, token_ids)`` of a request still
    running, or ``None``. A state store that is unreachable loses that batch's
    writes (the request goes on, a migration resumes from the router's own
    stream) and is logged once per outage, not per write.

    Args:
        journal: where the writes go.
        router_id: the owner written with a rewritten entry.
        rewrite: the current ``(record, token_ids)`` of a running request, else None.
    """

    def __init__(self, journal: RequestJournal, router_id: str,
                 rewrite: Callable[[str], tuple[dict, list[int]] | None]) -> None:
        self.journal, self.router_id, self._rewrite = journal, router_id, rewrite
        self._pending: list[list] = []
        self._last_append: dict[str, list] = {}     # request id -> its queued append op
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._submitted = 0                          # ops submitted / applied, counted
        self._applied = 0
        self._applied_cond: asyncio.Condition | None = None
        self._failing = False
        self.batches = 0                             # batches written (for tests/benchmarks)

    def submit(self, method: str, request_id: str, *args) -> None:
        """Queue one write (``begin``, ``assign``, ``append_tokens`` or ``finish``);
        returns at once. Must be called on the event loop's thread."""
        if method == "append_tokens":
            queued = self._last_append.get(request_id)
            if queued is not None:
                queued[2].extend(int(t) for t in args[0])
                return
            op = [method, request_id, [int(t) for t in args[0]]]
            self._last_append[request_id] = op
        else:
            self._last_append.pop(request_id, None)
            op = [method, request_id, *args]
        self._pending.append(op)
        self._submitted += 1
        self._ensure_task()
        self._wake.set()

    async def flush(self) -> None:
        """Wait until every write submitted so far is applied (or failed)."""
        target = self._submitted
        if self._applied >= target:
            return
        self._ensure_task()
        async with self._applied_cond:
            await self._applied_cond.wait_for(lambda: self._applied >= target)

    async def close(self) -> None:
        """Apply what is queued, then stop the background task."""
        if self._task is None:
            return
        await self.flush()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._wake = self._wake or asyncio.Event()
            self._applied_cond = self._applied_cond or asyncio.Condition()
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                ops, self._pending = self._pending, []
                self._last_append.clear()
                taken = len(ops)
                ops = [op for op in ops if op[0] != _SKIP]
                try:
                    results = await asyncio.to_thread(self.journal.write_batch, ops)
                except Exception as exc:
                    results = [exc] * len(ops)
                self.batches += 1
                try:
                    self._after(ops, results)
                except Exception:        # never leave flush() waiting on a dead task
                    logger.exception("request journal: handling a batch's results failed")
                self._applied += taken
                async with self._applied_cond:
                    self._applied_cond.notify_all()

    def _after(self, ops: list[list], results: list[BaseException | None]) -> None:
        lost: set[str] = set()
        failure = None
        for (method, rid, *_), res in zip(ops, results):
            if isinstance(res, KeyError) and method in ("assign", "append_tokens"):
                lost.add(rid)
            elif res is not None and failure is None:
                failure = res
        if failure is not None and not self._failing:
            logger.warning("request journal: writes failing (%s); requests go on unjournaled "
                           "until the cluster state is back", failure)
        elif failure is None and self._failing:
            logger.warning("request journal: writes succeed again")
        self._failing = failure is not None
        for rid in sorted(lost):
            current = self._rewrite(rid)
            if current is None:
                continue
            record, token_ids = current
            # The whole entry again: queued appends of it are in ``token_ids`` (they
            # stay queued as no-ops so that flush() still counts them).
            for op in self._pending:
                if op[0] == "append_tokens" and op[1] == rid:
                    op[0] = _SKIP
            self._last_append.pop(rid, None)
            self.submit("begin", rid, self.router_id, record)
            if token_ids:
                self.submit("append_tokens", rid, list(token_ids))
