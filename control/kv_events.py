"""KV cache events on Redis streams: workers publish, routers replay.

Each worker appends its :mod:`tandem.engine.kv.kv_events` to its own stream
``{ns}:kv_events:{worker_id}``, one entry per non-empty batch::

    seq         1, 2, 3, ... per publisher (a new incarnation starts at 1 again)
    generation  the publishing incarnation's generation
    events      JSON list: {"type": "stored" | "removed", "block_hashes": [int, ...]}
                           or {"type": "cleared"}

A router's prefix index for a worker is only right if it replayed every event
since the worker's cache was empty. :class:`KVEventReader` checks that with
``(generation, seq)``: whenever it cannot prove continuity (a gap, a new
generation, a stream trimmed before it first read it, a stream that started over)
it calls ``on_reset(worker_id)`` first, and the router drops what it knew about
that worker before applying what follows. A reset only makes the index forget
hashes the worker still holds (fewer cache hits), never claim ones it lost.

Block hashes are 128-bit unsigned ints; JSON carries them as exact integers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from tandem.control.state import ClusterState
from tandem.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_TAGS = {BlockStored: "stored", BlockRemoved: "removed"}


def encode_events(events: Sequence[KVEvent]) -> str:
    """The JSON text of ``events`` (a list of type-tagged objects), in order.

    Raises:
        TypeError: an element is not a KV event, or a block hash is not an int.
    """
    out = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            out.append({"type": "cleared"})
        elif type(ev) in _TAGS:
            hashes = list(ev.block_hashes)
            if not all(type(h) is int for h in hashes):
                raise TypeError(f"block hashes must be ints, got {hashes!r}")
            out.append({"type": _TAGS[type(ev)], "block_hashes": hashes})
        else:
            raise TypeError(f"not a KV event: {ev!r}")
    return json.dumps(out, separators=(",", ":"))


def decode_events(text: str) -> list[KVEvent]:
    """The events :func:`encode_events` wrote, equal to the originals.

    Raises:
        ValueError: malformed JSON or an unknown event type.
    """
    events: list[KVEvent] = []
    for obj in json.loads(text):
        kind = obj.get("type")
        if kind == "cleared":
            events.append(AllBlocksCleared())
        elif kind == "stored":
            events.append(BlockStored(tuple(int(h) for h in obj["block_hashes"])))
        elif kind == "removed":
            events.append(BlockRemoved(tuple(int(h) for h in obj["block_hashes"])))
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
    return events


def stream_key(state: ClusterState, worker_id: str) -> str:
    """The stream holding ``worker_id``'s KV events."""
    return state.key("kv_events", worker_id)


class KVEventPublisher:
    """Appends a worker's KV events to the stream ``{ns}:kv_events:{worker_id}``.

    Each entry is ``{seq, generation, events}`` (XADD, ``MAXLEN ~ maxlen``); seq
    starts at 1 per publisher and increases by 1 per non-empty publish. A publish
    that raised still used its seq: its events may be lost, and the gap makes
    readers reset rather than miss them silently.

    Not thread-safe: publish from one thread (the worker's engine loop).

    Args:
        state: the cluster state connection.
        worker_id: the publishing worker.
        generation: its current generation (from its lease).
        maxlen: entries kept per stream, approximately; a reader further behind
            than that resets.
    """

    def __init__(self, state: ClusterState, worker_id: str, generation: int, maxlen: int = 10000) -> None:
        self.state = state
        self.worker_id = worker_id
        self.generation = generation
        self.maxlen = maxlen
        self.key = stream_key(state, worker_id)
        self._seq = 0

    @property
    def last_seq(self) -> int:
        """The seq of the latest publish (0 before the first)."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> int | None:
        """Append one entry holding ``events``.

        Returns:
            The entry's seq; ``None`` (and nothing written) for no events.

        Raises:
            TypeError: as :func:`encode_events`.
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable
                (the seq is used up all the same).
        """
        if not events:
            return None
        payload = encode_events(events)
        self._seq += 1
        self.state.redis.xadd(self.key, {"seq": self._seq, "generation": self.generation,
                                         "events": payload},
                              maxlen=self.maxlen, approximate=True)
        return self._seq

    def reset(self, generation: int) -> None:
        """Start over as incarnation ``generation`` (after re-registering): seq back to 1."""
        self.generation = generation
        self._seq = 0


@dataclass
class _Cursor:
    """Where the reader is in one worker's stream."""

    last_id: str = "0"                  # stream entry id of the last entry read
    generation: int | None = None       # of the last entry applied; None: nothing known
    seq: int = 0


class KVEventReader:
    """Reads the KV event streams of many workers, checking continuity per worker.

    One XREAD per :meth:`read` covers every worker. Per worker it tracks the
    ``(generation, seq)`` of the last entry applied, and calls
    ``on_reset(worker_id)`` before applying an entry that does not follow it:

    * a new generation (the worker restarted; its cache is empty);
    * a sequence gap (entries trimmed away or lost in a failed publish);
    * a first entry with ``seq != 1`` while nothing was known (trimmed stream);
    * ``seq <=`` the last one seen (the stream started over, e.g. Redis restarted).

    Then ``on_events(worker_id, events)`` is called once per entry, in stream
    order. Callbacks run on the calling thread. Not thread-safe.

    Args:
        state: the cluster state connection.
        on_events: ``(worker_id, list of KV events)``.
        on_reset: ``(worker_id)``: forget what is known of the worker's cache.
    """

    def __init__(self, state: ClusterState, on_events: Callable[[str, list], None],
                 on_reset: Callable[[str], None]) -> None:
        self.state = state
        self.on_events = on_events
        self.on_reset = on_reset
        self._cursors: dict[str, _Cursor] = {}

    def read(self, worker_ids: Sequence[str], block_ms: int = 500, count: int = 1000) -> int:
        """Apply the entries of these workers' streams that arrived since the last read.

        Waits up to ``block_ms`` for the first entry when none is there. A worker
        read for the first time (or after :meth:`forget`) is read from the
        start of its stream. No workers: sleeps ``block_ms`` and returns 0.

        Args:
            block_ms: longest wait, in milliseconds; 0 does not wait. Must be
                below the connection's socket timeout.
            count: most entries read per stream in this call.

        Returns:
            The number of entries applied; 0 when none came within ``block_ms``.

        Raises:
            ValueError: ``block_ms`` negative or not below the socket timeout.
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        if block_ms < 0 or block_ms >= self.state.socket_timeout_s * 1000:
            raise ValueError(f"block_ms must be in [0, {self.state.socket_timeout_s * 1000:.0f}), "
                             f"got {block_ms}")
        if not worker_ids:
            time.sleep(block_ms / 1000)       # the same pacing for a caller's read loop
            return 0
        cursors = {wid: self._cursors.setdefault(wid, _Cursor()) for wid in worker_ids}
        streams = {stream_key(self.state, wid): cursors[wid].last_id for wid in cursors}
        by_key = {stream_key(self.state, wid): wid for wid in cursors}
        replies = self.state.redis.xread(streams, count=count, block=block_ms or None)
        applied = 0
        for key, entries in replies or []:
            wid = by_key[key]
            cur = cursors[wid]
            for entry_id, fields in entries:
                cur.last_id = entry_id
                seq, generation = int(fields["seq"]), int(fields["generation"])
                events = decode_events(fields["events"])
                if not self._follows(cur, generation, seq):
                    self.on_reset(wid)
                cur.generation, cur.seq = generation, seq
                self.on_events(wid, events)
                applied += 1
        return applied

    @staticmethod
    def _follows(cur: _Cursor, generation: int, seq: int) -> bool:
        if cur.generation is None:
            return seq == 1
        return generation == cur.generation and seq == cur.seq + 1

    def forget(self, worker_id: str) -> None:
        """Stop tracking a worker (it left); reading it again starts from its stream's start."""
        self._cursors.pop(worker_id, None)
