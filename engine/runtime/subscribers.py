"""Who reads an engine loop's step outputs: one outbox per subscriber (router).

Several routers may poll one worker. Each request belongs to the router that
added it (``WorkerRequest.router_id``), and its deltas go only to that router's
outbox; every step's stats and KV cache events go to all of them. A router
that stops polling is taken for dead: after ``timeout_s`` seconds without a
poll its outbox is deleted and the loop aborts its requests, so no block stays
held for a client nobody streams to. A new subscriber starts with the latest
stats; KV cache events from before it joined are not replayed.

The default subscriber ``""`` is the single router of a deployment that names
none. It exists from the start (outputs published before its first poll wait
for it, as they always did), and silence never aborts its requests: a caller
that gives no router id has not promised to poll. Its outbox is deleted only
while it owns no request, so unread stats do not pile up where no one polls it.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from tandem.engine.runtime.outputs import AddResult, StepOutput

DEFAULT = ""


@dataclass
class _Outbox:
    last_seen: float                      # monotonic seconds of the last poll (or creation)
    num_polling: int = 0                  # polls waiting on it right now: never silent then
    steps: queue.Queue = field(default_factory=queue.Queue)


class Subscribers:
    """The outboxes of one engine loop and the owner of each request.

    :meth:`poll` runs on any thread; everything else on the loop thread.

    Args:
        timeout_s: seconds without a poll after which a subscriber is dropped.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"subscriber_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()      # guards _outboxes (poll creates them)
        self._outboxes: dict[str, _Outbox] = {DEFAULT: _Outbox(clock())}
        self._owners: dict[str, str] = {}  # request id -> subscriber; loop thread only
        self._last_stats = None            # what a new subscriber starts with

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._outboxes)

    def _outbox(self, name: str) -> _Outbox:
        """The outbox of ``name``, created (with the latest stats) if new; hold the lock."""
        box = self._outboxes.get(name)
        if box is None:
            box = self._outboxes[name] = _Outbox(self._clock())
            if self._last_stats is not None:
                box.steps.put(StepOutput((), self._last_stats))
        return box

    # -- any thread ------------------------------------------------------------------------
    def poll(self, name: str, timeout_s: float) -> list[StepOutput]:
        """``name``'s step outputs since its last poll; waits up to ``timeout_s`` seconds
        for the first. A first poll makes ``name`` a subscriber."""
        with self._lock:
            box = self._outbox(name)
            box.num_polling += 1
            box.last_seen = self._clock()
        try:
            try:
                out = [box.steps.get(True, timeout_s)]
            except queue.Empty:
                return []
            while True:
                try:
                    out.append(box.steps.get_nowait())
                except queue.Empty:
                    return out
        finally:
            with self._lock:
                box.num_polling -= 1
                box.last_seen = self._clock()

    def unread(self, name: str, steps: list[StepOutput]) -> None:
        """Put ``steps`` (what a :meth:`poll` of ``name`` returned and could not
        deliver) back at the front of its outbox, in order, for its next poll. No-op
        once ``name`` was dropped."""
        with self._lock:
            box = self._outboxes.get(name)
        if box is None or not steps:
            return
        q = box.steps
        with q.mutex:
            q.queue.extendleft(reversed(steps))
            q.not_empty.notify()

    # -- loop thread -----------------------------------------------------------------------
    def assign(self, request_ids: list[str], name: str) -> None:
        """``request_ids`` belong to subscriber ``name`` (made one if new)."""
        with self._lock:
            self._outbox(name)
        for rid in request_ids:
            self._owners[rid] = name

    def owner(self, request_id: str) -> str:
        return self._owners.get(request_id, DEFAULT)

    def owned(self, name: str) -> list[str]:
        """Ids of live or recently ended requests of ``name``."""
        return [rid for rid, owner in self._owners.items() if owner == name]

    def publish(self, step: StepOutput, request_ids: Sequence[str] | None = None) -> None:
        """Give every subscriber ``step``, each with only its own requests' deltas.

        Args:
            request_ids: the engine id of each delta's request, as :meth:`assign`
                was given it (a sample's own: ``id#i``); None: the deltas' own
                ``request_id``.
        """
        self._last_stats = step.stats
        by_owner: dict[str, list] = {}
        keys = request_ids if request_ids is not None else [d.request_id for d in step.deltas]
        for key, d in zip(keys, step.deltas):
            by_owner.setdefault(self.owner(key), []).append(d)
            if d.finish_reason is not None:
                self._owners.pop(key, None)
        with self._lock:
            boxes = list(self._outboxes.items())
        for name, box in boxes:
            mine = tuple(by_owner.get(name, ()))
            box.steps.put(step if len(mine) == len(step.deltas) else replace(step, deltas=mine))

    def answer(self, name: str, result: AddResult) -> None:
        """Put ``result`` (the answer to a request ``name`` sent on its output
        stream) in ``name``'s outbox, after what is there (made if new: the stream's
        first poll may not have come yet)."""
        with self._lock:
            box = self._outbox(name)
        box.steps.put(result)

    @property
    def num_owned(self) -> int:
        """Requests with a recorded owner (live ones, and aborted ones not yet pruned)."""
        return len(self._owners)

    def prune(self, live: Callable[[str], bool]) -> None:
        """Forget the owners of requests that ended without a final delta (aborted):
        those for which ``live(request_id)`` is False."""
        for rid in [rid for rid in self._owners if not live(rid)]:
            del self._owners[rid]

    def drop_silent(self) -> dict[str, list[str]]:
        """Delete the outboxes of subscribers silent for ``timeout_s`` seconds.

        Returns:
            dropped subscriber -> the ids of its requests (the caller aborts them);
            the default subscriber is dropped only when it owns none.
        """
        now = self._clock()
        owned_by_default = any(o == DEFAULT for o in self._owners.values())
        with self._lock:
            silent = [name for name, box in self._outboxes.items()
                      if box.num_polling == 0 and now - box.last_seen > self.timeout_s
                      and not (name == DEFAULT and owned_by_default)]
            for name in silent:
                del self._outboxes[name]
        dropped = {}
        for name in silent:
            dropped[name] = self.owned(name)
            for rid in dropped[name]:
                del self._owners[rid]
        return dropped
