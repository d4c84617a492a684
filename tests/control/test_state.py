"""ClusterState: key schema, registration generations, the renewal script's three answers,
drop, suspicion and liveness."""

from __future__ import annotations

import time

import pytest
import redis

from tandem.control.redis_server import EmbeddedRedis
from tandem.control.state import ClusterState, WorkerRecord

REC = {"role": "decode", "actor_name": "tandem-decode-0", "info": {"block_size": 16, "num_blocks": 64}}


def register(state: ClusterState, wid: str = "decode-0", ttl_s: float = 10.0) -> int:
    return state.register_worker(wid, REC["role"], REC["actor_name"], REC["info"], ttl_s)


def test_keys_live_under_the_namespace(redis_server):
    s = ClusterState(redis_server.url, namespace="c1")
    assert s.key("lease", "decode-0") == "c1:lease:decode-0"
    s.redis.flushall()
    s.register_worker("decode-0", "decode", "a", {})
    assert sorted(s.redis.keys("*")) == ["c1:gen:decode-0", "c1:lease:decode-0",
                                         "c1:worker:decode-0", "c1:workers"]
    assert ClusterState(redis_server.url, namespace="c2").workers() == []
    s.close()


def test_ping_is_false_when_unreachable(state):
    assert state.ping()
    free = EmbeddedRedis()            # picks a free port, never started
    down = ClusterState(free.url, socket_timeout_s=0.5)
    assert down.ping() is False
    with pytest.raises(redis.exceptions.ConnectionError):
        down.generation("decode-0")


def test_register_takes_increasing_generations_and_stores_the_record(state):
    assert register(state) == 1
    assert register(state) == 2
    assert register(state, "prefill-0") == 1
    assert state.generation("decode-0") == 2
    assert state.generation("nobody") is None
    assert state.workers() == [
        WorkerRecord("decode-0", "decode", 2, "tandem-decode-0", REC["info"], True),
        WorkerRecord("prefill-0", "decode", 1, "tandem-decode-0", REC["info"], True)]
    assert state.redis.get(state.key("lease", "decode-0")) == "2"
    assert 9000 < state.redis.pttl(state.key("lease", "decode-0")) <= 10000


def test_renew_moves_the_expiry_of_the_current_generation(state):
    gen = register(state, ttl_s=0.3)
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "renewed"
    assert state.redis.pttl(state.key("lease", "decode-0")) > 4000
    time.sleep(0.4)
    assert state.workers()[0].alive


def test_a_lease_lapses_by_the_redis_clock(state):
    register(state, ttl_s=0.15)
    time.sleep(0.3)
    [w] = state.workers()
    assert not w.alive and w.generation == 1


def test_renew_of_an_older_generation_is_fenced_and_changes_nothing(state):
    old = register(state)
    new = register(state)
    before = state.redis.pttl(state.key("lease", "decode-0"))
    assert state.renew_lease("decode-0", old, 60.0, {**REC, "info": {"stale": True}}) == "fenced"
    assert state.redis.get(state.key("lease", "decode-0")) == str(new)
    assert state.redis.pttl(state.key("lease", "decode-0")) <= before
    assert state.workers()[0].info == REC["info"]


def test_renew_with_a_newer_counter_but_no_lease_is_fenced(state):
    old = register(state, ttl_s=0.1)
    register(state, ttl_s=0.1)
    time.sleep(0.2)                  # both leases lapsed; the counter says 2
    assert state.renew_lease("decode-0", old, 5.0, REC) == "fenced"
    assert not state.workers()[0].alive


def test_renew_of_a_lease_holding_another_value_is_fenced(state):
    gen = register(state)
    state.redis.set(state.key("lease", "decode-0"), "7")
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "fenced"


def test_renew_after_a_flush_reasserts_counter_record_and_lease(state):
    register(state)
    gen = register(state)
    state.redis.flushall()
    assert state.workers() == []
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "reasserted"
    assert state.generation("decode-0") == gen
    assert state.workers() == [WorkerRecord("decode-0", "decode", gen, "tandem-decode-0",
                                            REC["info"], True)]
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "renewed"
    assert register(state) == gen + 1


def test_a_replacement_registered_after_a_flush_still_outranks_its_predecessor(state):
    register(state)
    old = register(state)                                    # generation 2
    state.redis.flushall()                                   # the counter is gone
    assert state.register_worker("decode-0", "decode", "b", {}, min_generation=old + 1) == old + 1
    assert state.renew_lease("decode-0", old, 5.0, REC) == "fenced"   # the predecessor
    assert register(state) == old + 2                        # counting goes on from there
    # A floor below the counter changes nothing.
    assert state.register_worker("decode-0", "decode", "b", {}, min_generation=1) == old + 3


def test_the_epoch_lasts_as_long_as_the_data(state, redis_server):
    first = state.epoch()
    assert len(first) == 32 and state.epoch() == first
    other = ClusterState(redis_server.url)
    assert other.epoch() == first                            # every reader sees the same token
    state.redis.flushall()
    second = other.epoch()
    assert second != first and state.epoch() == second
    other.close()


def test_renew_after_the_lease_lapsed_unreplaced_reasserts(state):
    gen = register(state, ttl_s=0.1)
    time.sleep(0.2)
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "reasserted"
    assert state.workers()[0].alive


def test_renew_restores_a_lost_record(state):
    gen = register(state)
    state.redis.delete(state.key("worker", "decode-0"), state.key("workers"))
    assert state.renew_lease("decode-0", gen, 5.0, REC) == "renewed"
    assert [w.worker_id for w in state.workers()] == ["decode-0"]


def test_drop_only_the_matching_generation_and_fence_it(state):
    old = register(state)
    new = register(state)
    assert state.drop_worker("decode-0", old) is False
    assert len(state.workers()) == 1
    assert state.drop_worker("decode-0", new) is True
    assert state.workers() == []
    assert state.renew_lease("decode-0", new, 5.0, REC) == "fenced"    # no coming back
    assert register(state) > new


def test_mark_suspect_flips_liveness_at_once_for_the_named_generation(state):
    old = register(state)
    new = register(state)
    assert state.mark_suspect("decode-0", old) is False
    assert state.workers()[0].alive
    assert state.mark_suspect("decode-0", new) is True
    assert not state.workers()[0].alive
    assert state.mark_suspect("decode-0", new) is False
    # A worker that was alive after all comes back at its next renewal.
    assert state.renew_lease("decode-0", new, 5.0, REC) == "reasserted"
    assert state.workers()[0].alive


def test_workers_are_ordered_by_id(state):
    for wid in ["decode-1", "prefill-0", "decode-0"]:
        register(state, wid)
    assert [w.worker_id for w in state.workers()] == ["decode-0", "decode-1", "prefill-0"]


def test_renew_raises_when_redis_is_down(private_redis):
    server = private_redis()
    s = ClusterState(server.url, socket_timeout_s=0.5)
    gen = register(s)
    server.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        s.renew_lease("decode-0", gen, 5.0, REC)
    s.close()


def test_bad_ttl_is_rejected(state):
    with pytest.raises(ValueError, match="ttl_s"):
        register(state, ttl_s=0)
