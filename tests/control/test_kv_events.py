"""KV events on Redis streams: exact JSON round trip, publisher seqs, and the reader's
resets on every break of continuity."""

from __future__ import annotations

import time

import pytest
import redis

from tandem.control.kv_events import (KVEventPublisher, KVEventReader, decode_events,
                                      encode_events, stream_key)
from tandem.control.state import ClusterState
from tandem.engine.kv.block_pool import hash_block_tokens
from tandem.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

H1 = hash_block_tokens(None, [1, 2, 3, 4])
H2 = hash_block_tokens(H1, [5, 6, 7, 8])
BIG = 2**128 - 1


class Log:
    """What the reader called, in order: ("events", wid, events) and ("reset", wid)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_events(self, wid: str, events: list) -> None:
        self.calls.append(("events", wid, events))

    def on_reset(self, wid: str) -> None:
        self.calls.append(("reset", wid))

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def reader(state: ClusterState, log: Log) -> KVEventReader:
    return KVEventReader(state, log.on_events, log.on_reset)


def test_json_round_trip_is_exact():
    events = [BlockStored((H1, H2, 0, BIG)), BlockRemoved((H1,)), AllBlocksCleared(), BlockStored(())]
    back = decode_events(encode_events(events))
    assert back == events
    assert all(type(h) is int for h in back[0].block_hashes) and back[0].block_hashes[3] == BIG


def test_encoding_rejects_what_is_not_an_event():
    with pytest.raises(TypeError):
        encode_events(["stored"])
    with pytest.raises(TypeError):
        encode_events([BlockStored((1.5,))])
    with pytest.raises(ValueError, match="unknown KV event type"):
        decode_events('[{"type": "moved"}]')


def test_publisher_numbers_non_empty_batches_from_one(state):
    pub = KVEventPublisher(state, "decode-0", generation=3)
    assert pub.publish([]) is None
    assert pub.publish([BlockStored((H1,))]) == 1
    assert pub.publish([BlockRemoved((H1,)), AllBlocksCleared()]) == 2
    entries = state.redis.xrange(stream_key(state, "decode-0"))
    assert [(f["seq"], f["generation"]) for _, f in entries] == [("1", "3"), ("2", "3")]
    assert decode_events(entries[1][1]["events"]) == [BlockRemoved((H1,)), AllBlocksCleared()]
    pub.reset(4)
    assert pub.publish([AllBlocksCleared()]) == 1


def test_reader_applies_many_workers_in_order_with_one_read(state):
    a, b = KVEventPublisher(state, "decode-0", 1), KVEventPublisher(state, "decode-1", 1)
    a.publish([BlockStored((H1,))])
    b.publish([BlockStored((H2,))])
    a.publish([BlockRemoved((H1,))])
    log = Log()
    r = reader(state, log)
    assert r.read(["decode-0", "decode-1"], block_ms=0) == 3
    calls = log.take()
    assert [c for c in calls if c[1] == "decode-0"] == [("events", "decode-0", [BlockStored((H1,))]),
                                                        ("events", "decode-0", [BlockRemoved((H1,))])]
    assert [c for c in calls if c[1] == "decode-1"] == [("events", "decode-1", [BlockStored((H2,))])]
    assert r.read(["decode-0", "decode-1"], block_ms=0) == 0
    a.publish([AllBlocksCleared()])
    assert r.read(["decode-0", "decode-1"], block_ms=0) == 1
    assert log.take() == [("events", "decode-0", [AllBlocksCleared()])]


def test_read_blocks_then_returns_zero(state):
    r = reader(state, Log())
    t0 = time.monotonic()
    assert r.read(["decode-0"], block_ms=200) == 0
    assert 0.15 < time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert r.read([], block_ms=100) == 0
    assert time.monotonic() - t0 >= 0.09
    with pytest.raises(ValueError, match="block_ms"):
        r.read(["decode-0"], block_ms=state.socket_timeout_s * 1000)


def test_read_count_bounds_one_call(state):
    pub = KVEventPublisher(state, "decode-0", 1)
    for i in range(5):
        pub.publish([BlockStored((i,))])
    log = Log()
    r = reader(state, log)
    assert r.read(["decode-0"], block_ms=0, count=2) == 2
    assert r.read(["decode-0"], block_ms=0, count=10) == 3
    assert [c[2] for c in log.take()] == [[BlockStored((i,))] for i in range(5)]


def test_a_new_generation_resets_before_its_first_entry(state):
    log = Log()
    r = reader(state, log)
    pub = KVEventPublisher(state, "decode-0", 1)
    pub.publish([BlockStored((H1,))])
    r.read(["decode-0"], block_ms=0)
    pub.reset(2)
    pub.publish([BlockStored((H2,))])
    r.read(["decode-0"], block_ms=0)
    assert log.take() == [("events", "decode-0", [BlockStored((H1,))]), ("reset", "decode-0"),
                          ("events", "decode-0", [BlockStored((H2,))])]


def test_a_sequence_gap_resets(state):
    log = Log()
    r = reader(state, log)
    pub = KVEventPublisher(state, "decode-0", 1)
    pub.publish([BlockStored((1,))])
    r.read(["decode-0"], block_ms=0)
    pub._seq += 1                     # a publish that failed: seq 2 was used, never written
    pub.publish([BlockStored((3,))])
    r.read(["decode-0"], block_ms=0)
    assert [c[0] for c in log.take()] == ["events", "reset", "events"]


def test_a_failed_publish_uses_up_its_seq(private_redis):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    pub = KVEventPublisher(state, "decode-0", 1)
    assert pub.publish([BlockStored((1,))]) == 1
    server.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        pub.publish([BlockStored((2,))])
    server.restart()
    assert pub.publish([BlockStored((3,))]) == 3
    state.close()


def test_a_trimmed_stream_read_for_the_first_time_resets(state):
    pub = KVEventPublisher(state, "decode-0", 1)
    for i in range(4):
        pub.publish([BlockStored((i,))])
    state.redis.xtrim(stream_key(state, "decode-0"), maxlen=2, approximate=False)
    log = Log()
    assert reader(state, log).read(["decode-0"], block_ms=0) == 2
    assert log.take() == [("reset", "decode-0"), ("events", "decode-0", [BlockStored((2,))]),
                          ("events", "decode-0", [BlockStored((3,))])]


def test_a_stream_that_starts_over_resets(state):
    log = Log()
    r = reader(state, log)
    pub = KVEventPublisher(state, "decode-0", 1)
    pub.publish([BlockStored((1,))])
    pub.publish([BlockStored((2,))])
    r.read(["decode-0"], block_ms=0)
    state.redis.delete(stream_key(state, "decode-0"))        # as a Redis restart would
    # Entry ids are the Redis clock's milliseconds: a stream recreated within the same
    # millisecond could take an id at or below the reader's cursor, which no restart
    # (seconds long) does.
    time.sleep(0.005)
    KVEventPublisher(state, "decode-0", 1).publish([BlockStored((9,))])   # seq 1, same generation
    assert r.read(["decode-0"], block_ms=0) == 1
    assert log.take()[2:] == [("reset", "decode-0"), ("events", "decode-0", [BlockStored((9,))])]


def test_forget_reads_the_worker_from_the_start_again(state):
    KVEventPublisher(state, "decode-0", 1).publish([BlockStored((1,))])
    log = Log()
    r = reader(state, log)
    r.read(["decode-0"], block_ms=0)
    r.forget("decode-0")
    assert r.read(["decode-0"], block_ms=0) == 1
    assert [c[0] for c in log.take()] == ["events", "events"]


def test_publisher_trims_to_about_maxlen(state):
    pub = KVEventPublisher(state, "decode-0", 1, maxlen=10)
    for i in range(500):
        pub.publish([BlockStored((i,))])
    assert state.redis.xlen(stream_key(state, "decode-0")) < 250
