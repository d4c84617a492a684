"""Select-and-reserve, in process and in Redis: exact picks, expiry, refresh, and two
routers reserving concurrently without herding."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.control.reservations import InProcessReservations, RedisReservations
from tandem.control.state import ClusterState

W = ["w0", "w1", "w2", "w3"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["in_process", "redis"])
def res(request):
    if request.param == "in_process":
        return InProcessReservations()
    return RedisReservations(request.getfixturevalue("state"))


def equal(workers=W) -> list[tuple[str, float]]:
    return [(w, 0.0) for w in workers]


def test_picks_the_smallest_inflight_plus_cost_first_on_ties(res):
    assert res.reserve("decode", equal(), "r0") == "w0"
    assert res.reserve("decode", equal(), "r1") == "w1"          # w0 has one now
    assert res.reserve("decode", [("w0", 0.0), ("w1", 0.0), ("w2", 5.0)], "r2") == "w0"  # tie 1 == 1: first
    # w0: 2, w1: 1, w2: 0. Costs shift the pick: 2 + 0 > 1 + 0.5 < 0 + 1.6
    assert res.reserve("decode", [("w0", 0.0), ("w1", 0.5), ("w2", 1.6)], "r3") == "w1"
    assert res.reserve("decode", [("w2", 2.0), ("w1", 0.0)], "r4") == "w2"   # 0 + 2 == 2 + 0: first
    assert res.inflight("decode", W) == {"w0": 2, "w1": 2, "w2": 1, "w3": 0}
    assert res.reserve("decode", [("w3", -1.0), ("w0", 0.0)], "r5") == "w3"


def test_pools_are_counted_apart(res):
    res.reserve("prefill", equal(["w0"]), "r0")
    assert res.inflight("decode", ["w0"]) == {"w0": 0}
    assert res.inflight("prefill", ["w0"]) == {"w0": 1}


def test_release_and_drop_worker(res):
    for i in range(4):
        res.reserve("decode", equal(["w0", "w1"]), f"r{i}")
    res.release("decode", "w0", "r0")
    res.release("decode", "w0", "r0")           # twice: a no-op
    res.release("decode", "w1", "nobody")
    assert res.inflight("decode", ["w0", "w1"]) == {"w0": 1, "w1": 2}
    res.drop_worker("decode", "w1")
    assert res.inflight("decode", ["w0", "w1"]) == {"w0": 1, "w1": 0}


def test_reserving_the_same_request_again_on_its_worker_counts_once(res):
    assert res.reserve("decode", equal(["w0"]), "r0") == "w0"
    assert res.reserve("decode", equal(["w0"]), "r0") == "w0"
    assert res.inflight("decode", ["w0"]) == {"w0": 1}


def test_bad_arguments(res):
    with pytest.raises(ValueError, match="no candidates"):
        res.reserve("decode", [], "r0")
    with pytest.raises(ValueError, match="finite"):
        res.reserve("decode", [("w0", float("inf"))], "r0")
    with pytest.raises(ValueError, match="ttl_s"):
        res.reserve("decode", equal(), "r0", ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        res.refresh("decode", [("w0", "r0")], ttl_s=-1)


def test_in_process_expiry_and_refresh_exact():
    clock = FakeClock()
    res = InProcessReservations(clock)
    res.reserve("decode", equal(["w0"]), "a", ttl_s=10)
    res.reserve("decode", equal(["w0"]), "b", ttl_s=10)
    clock.now += 5
    res.refresh("decode", [("w0", "a")], ttl_s=10)                     # a -> 1015
    clock.now += 5                                                     # b expired at 1010
    assert res.inflight("decode", ["w0"]) == {"w0": 1}
    assert res.reserve("decode", equal(["w0", "w1"]), "c", ttl_s=10) == "w1"
    clock.now += 5                                                     # a expired at 1015
    assert res.inflight("decode", ["w0", "w1"]) == {"w0": 0, "w1": 1}
    assert res.reserve("decode", equal(["w1", "w0"]), "d") == "w0"
    res.refresh("decode", [("w0", "lost")], ttl_s=10)                  # missing: re-created
    assert res.inflight("decode", ["w0"]) == {"w0": 2}


def test_redis_expiry_and_refresh_by_the_redis_clock(state):
    res = RedisReservations(state)
    res.reserve("decode", equal(["w0"]), "a", ttl_s=0.4)
    res.reserve("decode", equal(["w0"]), "b", ttl_s=0.4)
    res.refresh("decode", [("w0", "a")], ttl_s=5.0)
    time.sleep(0.5)
    assert res.inflight("decode", ["w0"]) == {"w0": 1}                # b expired
    # Ordered by expiry; b is not counted, but only a reserve drops it.
    assert state.redis.zrange(state.key("inflight", "decode", "w0"), 0, -1) == ["b", "a"]
    assert res.reserve("decode", equal(["w0", "w1"]), "c") == "w1"    # 1 + 0 > 0 + 0
    assert state.redis.zrange(state.key("inflight", "decode", "w0"), 0, -1) == ["a"]   # dropped
    key = state.key("inflight", "decode", "w0")
    assert 4000 < state.redis.pttl(key) <= 5000          # the set lives as long as its latest member


def test_redis_refresh_recreates_what_a_flush_lost(state):
    """After a flush, the routers' in-flight requests are counted again at their next
    refresh, instead of being invisible to select-and-reserve until they end."""
    res = RedisReservations(state)
    for rid in ("a", "b"):
        res.reserve("decode", equal(["w0"]), rid, ttl_s=5.0)
    res.reserve("decode", equal(["w1"]), "c", ttl_s=5.0)
    state.redis.flushdb()
    assert res.inflight("decode", ["w0", "w1"]) == {"w0": 0, "w1": 0}
    res.refresh("decode", [("w0", "a"), ("w0", "b"), ("w1", "c")], ttl_s=5.0)
    assert res.inflight("decode", ["w0", "w1"]) == {"w0": 2, "w1": 1}
    assert 4000 < state.redis.pttl(state.key("inflight", "decode", "w0")) <= 5000
    assert res.reserve("decode", equal(["w0", "w1"]), "d") == "w1"


def test_an_abandoned_redis_set_expires_with_its_members(state):
    res = RedisReservations(state)
    res.reserve("decode", equal(["w0"]), "a", ttl_s=0.2)
    time.sleep(0.35)
    assert state.redis.exists(state.key("inflight", "decode", "w0")) == 0


@pytest.mark.parametrize("kind", ["in_process", "redis"])
def test_two_routers_reserving_at_once_do_not_herd(kind, redis_server, state):
    n, workers = 200, W
    if kind == "in_process":
        shared = InProcessReservations()
        routers = [shared, shared]
    else:
        clients = [ClusterState(redis_server.url) for _ in range(2)]      # two connections
        routers = [RedisReservations(c) for c in clients]
    picks: list[list[tuple[str, str]]] = [[], []]
    start = threading.Barrier(2)

    def route(i: int) -> None:
        start.wait()
        for j in range(n // 2):
            rid = f"router{i}-{j}"
            picks[i].append((routers[i].reserve("decode", equal(workers), rid), rid))

    threads = [threading.Thread(target=route, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = routers[0].inflight("decode", workers)
    assert sum(counts.values()) == n
    assert max(counts.values()) - min(counts.values()) <= 1
    assert {w: sum(1 for p in picks[0] + picks[1] if p[0] == w) for w in workers} == counts
    for i in range(2):
        for wid, rid in picks[i]:
            routers[i].release("decode", wid, rid)
    assert routers[1].inflight("decode", workers) == {w: 0 for w in workers}
    if kind == "redis":
        for c in clients:
            c.close()
