"""LeaseKeeper: keeps the lease alive, fences itself when replaced or cut off, and
heals the cluster state after a Redis restart. ttl 1.0 s, interval 0.2 s."""

from __future__ import annotations

import threading
import time

from tandem.control.lease import LeaseKeeper
from tandem.control.state import ClusterState

TTL, INTERVAL = 1.0, 0.2
INFO = {"block_size": 16}


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class Events:
    """Records the keeper's callbacks."""

    def __init__(self) -> None:
        self.fenced: list[str] = []
        self.unfenced = 0
        self.lock = threading.Lock()

    def on_fenced(self, reason: str) -> None:
        with self.lock:
            self.fenced.append(reason)

    def on_unfenced(self) -> None:
        with self.lock:
            self.unfenced += 1


def keeper(state: ClusterState, events: Events | None = None, wid: str = "decode-0") -> LeaseKeeper:
    events = events or Events()
    return LeaseKeeper(state, wid, "decode", f"actor-{wid}", INFO, ttl_s=TTL, interval_s=INTERVAL,
                       on_fenced=events.on_fenced, on_unfenced=events.on_unfenced)


def test_renewal_keeps_the_lease_alive_past_the_ttl_and_stop_drops_it(state):
    k = keeper(state).start()
    assert k.generation == 1
    time.sleep(2.5 * TTL)
    [w] = state.workers()
    assert w.alive and w.generation == 1 and w.actor_name == "actor-decode-0"
    assert not k.fenced and k.fence_reason is None
    k.stop()
    assert state.workers() == []


def test_stop_without_deregister_lets_the_lease_lapse(state):
    k = keeper(state).start()
    k.stop(deregister=False)
    assert wait_for(lambda: not state.workers()[0].alive, 2 * TTL)


def test_a_second_registration_fences_the_first_keeper_for_good(state):
    events = Events()
    first = keeper(state, events).start()
    second = keeper(state).start()
    assert second.generation == 2
    # The flag is set before the callback runs (outside the keeper's lock): wait for both.
    assert wait_for(lambda: first.fenced and events.fenced, 3 * INTERVAL)
    assert len(events.fenced) == 1
    assert "generation 1" in events.fenced[0] and "generation is 2" in events.fenced[0]
    assert first.fence_reason == events.fenced[0]
    first.stop()                      # a fenced keeper must not drop its successor
    [w] = state.workers()
    assert w.alive and w.generation == 2
    assert not second.fenced
    second.stop()


def test_after_a_redis_restart_the_keeper_reasserts_within_a_few_intervals(private_redis, caplog):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.5)
    events = Events()
    k = keeper(state, events).start()
    keeper(state, wid="decode-1").start().stop(deregister=False)    # gen 1 of another id
    keeper(state, wid="decode-1").start().stop(deregister=False)    # gen 2
    assert {w.worker_id for w in state.workers()} == {"decode-0", "decode-1"}
    server.restart()                  # empty: decode-1's lapsed record is gone for good
    # One of the next renewal ticks after the restart (the bound leaves slack for a busy
    # machine: the first tick may spend its time reconnecting). The keeper may already
    # have reasserted before this first look, so only the end state is checked.
    assert wait_for(lambda: [w.worker_id for w in state.workers()] == ["decode-0"], 5 * INTERVAL)
    assert any("decode-0' reasserted its lease (generation 1)" in r.getMessage()
               for r in caplog.records)
    [w] = state.workers()
    assert (w.generation, w.alive, w.info) == (k.generation, True, INFO)
    assert not k.fenced and events.fenced == []
    assert state.register_worker("decode-0", "decode", "x", {}) == k.generation + 1
    assert wait_for(lambda: k.fenced, 3 * INTERVAL)
    k.stop()
    state.close()


def test_redis_gone_longer_than_the_ttl_fences_until_it_is_back(private_redis):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    events = Events()
    k = keeper(state, events).start()
    server.stop()
    t0 = time.monotonic()
    assert wait_for(lambda: k.fenced, TTL + 2 * INTERVAL)
    assert time.monotonic() - t0 < TTL + 2 * INTERVAL
    assert wait_for(lambda: len(events.fenced) == 1, 2 * INTERVAL + 0.5)
    assert "no lease renewal succeeded for 1.0 s" in events.fenced[0]
    server.restart()                  # same port, empty
    assert wait_for(lambda: not k.fenced, 3 * INTERVAL)
    # The keeper lifts the fence, then calls on_unfenced: wait for the call too.
    assert wait_for(lambda: events.unfenced == 1, 2 * INTERVAL)
    assert events.unfenced == 1
    [w] = state.workers()
    assert w.alive and w.generation == k.generation
    k.stop()
    state.close()


def test_a_short_outage_does_not_fence(private_redis):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    events = Events()
    k = keeper(state, events).start()
    server.stop()
    time.sleep(TTL / 10)
    server.restart()                  # the outage, restart included, stays well under the TTL
    time.sleep(3 * INTERVAL)
    assert not k.fenced and events.fenced == [] and events.unfenced == 0
    assert state.workers()[0].alive
    k.stop()
    state.close()
