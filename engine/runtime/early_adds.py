"""Requests a router sends on a worker's output stream, matched with the Ray call it
makes for one when the stream broke before the answer came
(:mod:`~tandem.engine.runtime.output_stream`), so that each is run once: a decode
worker's adds (``add_request``), a prefill worker's prefills (``prefill``).
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import Future
from typing import Callable

from tandem.engine.runtime.outputs import AddResult, WorkerRequest

EARLY_ADD_TTL_S = 60.0
"""Seconds :class:`EarlyAdds` keeps unclaimed work or a call's mark."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (it crosses to the router in an
    :class:`AddResult`), else a ``RuntimeError`` with its type and first line."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))
        return exc
    except Exception:
        first = (str(exc).splitlines() or [""])[0]
        return RuntimeError(f"{type(exc).__name__}: {first}")


class EarlyAdds:
    """Requests a router wrote on its output stream
    (:mod:`~tandem.engine.runtime.output_stream`), matched with the call
    (``add_request``, ``prefill``) the router makes for one when the stream broke
    before its answer came, so that the request is run once, by whichever of the
    two comes first.

    A frame starts the work (:meth:`from_stream`: an add queued on the engine loop,
    a prefill on the actor's event loop); a later call returns that work's result
    (:meth:`claim`). A call that comes first does the work itself and leaves a mark
    that drops the frame if it still comes. Work no call claims (the usual case:
    the answer came on the stream) and marks no frame matches (one lost with the
    connection) are forgotten ``ttl_s`` seconds after they were made (work not
    before it is done). Thread-safe: frames come on a stream's reader thread, calls
    on the actor's event loop.

    Attributes:
        num_from_stream: requests a frame started (for tests and invariants).
    """

    def __init__(self, ttl_s: float = EARLY_ADD_TTL_S):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        # key -> (when, the add a frame started; None: the call's mark)
        self._entries: dict[tuple, tuple[float, Future | None]] = {}
        self._next_sweep = 0.0
        self.num_from_stream = 0

    @staticmethod
    def _key(request: WorkerRequest) -> tuple:
        return (request.router_id, *AddResult.key_of(request))

    def _forget_old(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.ttl_s)
        for key in [k for k, (t, add) in self._entries.items()
                    if now - t > self.ttl_s and (add is None or add.done())]:
            del self._entries[key]

    def from_stream(self, request: WorkerRequest, start: Callable[[], Future]) -> bool:
        """A frame's request: ``start()`` (which queues its work and returns the
        future of its result) unless its call came first or a frame for it already
        did; whether it started."""
        now = time.monotonic()
        with self._lock:
            self._forget_old(now)
            key = self._key(request)
            entry = self._entries.get(key)
            if entry is not None:
                if entry[1] is None:              # its call came first and added it
                    del self._entries[key]
                return False
            self._entries[key] = (now, start())
            self.num_from_stream += 1
            return True

    def claim(self, request: WorkerRequest) -> Future | None:
        """The call of a request its router sent ahead: the work its frame started
        (then forgotten here), or None after leaving the mark that drops the frame
        (the call does the work itself)."""
        now = time.monotonic()
        with self._lock:
            self._forget_old(now)
            key = self._key(request)
            entry = self._entries.pop(key, None)
            if entry is not None and entry[1] is not None:
                return entry[1]
            self._entries[key] = (now, None)
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
