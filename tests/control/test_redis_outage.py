"""Redis as a supervised part, on real redis-server processes: a supervised
:class:`EmbeddedRedis` comes back after ``kill -9`` (same port, new pid, empty); a
lease keeper that does not fence on an unreachable Redis serves through an outage
and re-asserts after it; a router's :class:`RedisRegistry` keeps its view while
Redis is unreachable and gives every worker the grace to renew once it is back;
errors name the cluster state, not a worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from tandem.control.lease import LeaseKeeper
from tandem.control.state import ClusterState, ClusterStateUnavailable
from tandem.control.worker_control import ControlConfig, WorkerControl
from tandem.router.redis_registry import RedisRegistry

INFO = {"block_size": 16}
TTL, INTERVAL = 1.0, 0.2


def wait_for(cond, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    return cond()


# -- the embedded server's supervision -------------------------------------------------------
def test_a_supervised_server_killed_with_sigkill_comes_back_on_the_same_port(private_redis):
    server = private_redis()
    seen = []
    server.supervise(on_restart=seen.append, interval_s=0.05)
    port, old_pid = server.port, server.pid
    client = redis.Redis.from_url(server.url)
    client.set("k", "v")
    t0 = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    assert wait_for(lambda: seen, 10), "no restart"
    took = time.monotonic() - t0
    [rec] = seen
    assert server.restarts == [rec]
    assert (rec.old_pid, rec.new_pid, rec.exit_code, rec.attempts) == (old_pid, server.pid, -9, 1)
    assert server.pid != old_pid and server.port == port and server.running
    assert client.get("k") is None                    # empty, like a Redis that lost its memory
    assert redis.Redis(port=port).info("server")["process_id"] == server.pid
    print(f"\nsupervised redis-server back {took:.2f} s after kill -9 ({rec.down_s:.2f} s "
          "from noticing)")
    # An explicit restart keeps the supervision; the next crash is restarted too.
    server.restart()
    os.kill(server.pid, signal.SIGKILL)
    assert wait_for(lambda: len(seen) == 2, 10)
    assert server.running and server.port == port
    # Stopped on purpose: no restart, and the supervision ends.
    server.stop()
    time.sleep(0.3)
    assert not server.running and not server.supervised and len(seen) == 2
    client.close()


def test_supervising_a_stopped_server_is_refused(private_redis):
    server = private_redis()
    server.stop()
    with pytest.raises(RuntimeError, match="start it before supervising it"):
        server.supervise()


# -- the worker's lease through an outage ----------------------------------------------------
def test_a_keeper_that_does_not_fence_serves_through_an_outage_and_reasserts(private_redis):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    fenced: list[str] = []
    k = LeaseKeeper(state, "decode-0", "decode", "a", INFO, ttl_s=TTL, interval_s=INTERVAL,
                    on_fenced=fenced.append, fence_when_unreachable=False).start()
    server.stop()
    assert wait_for(lambda: not k.state_reachable, 3 * INTERVAL + 1)
    time.sleep(TTL + 3 * INTERVAL)                      # well past the lease TTL
    assert not k.fenced and fenced == [] and k.fence_reason is None
    assert k.state_error.startswith(
        f"cluster state (Redis) unreachable at 127.0.0.1:{server.port}/0: ")
    server.restart()                                    # same port, empty
    assert wait_for(lambda: [(w.worker_id, w.generation, w.alive) for w in state.workers()]
                    == [("decode-0", k.generation, True)], 5 * INTERVAL + 1)
    assert k.state_reachable and k.state_error is None and not k.fenced
    # A newer incarnation (registered after the outage) still fences it for good.
    assert state.register_worker("decode-0", "decode", "b", INFO, TTL) == k.generation + 1
    assert wait_for(lambda: k.fenced and fenced, 5 * INTERVAL)     # flag, then callback
    assert len(fenced) == 1 and f"generation is {k.generation + 1}" in fenced[0]
    k.stop()
    state.close()


def test_the_fence_on_an_unreachable_redis_names_the_cluster_state(private_redis):
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    fenced: list[str] = []
    k = LeaseKeeper(state, "decode-0", "decode", "a", INFO, ttl_s=TTL, interval_s=INTERVAL,
                    on_fenced=fenced.append).start()      # fence_when_unreachable (default)
    server.stop()
    assert wait_for(lambda: fenced, TTL + 4 * INTERVAL + 1)
    assert fenced[0].startswith(f"cluster state (Redis) unreachable at 127.0.0.1:{server.port}/0: "
                                "no lease renewal succeeded for 1.0 s")
    k.stop()
    state.close()


def test_a_worker_that_cannot_register_names_redis(private_redis):
    server = private_redis()
    url = server.url
    server.stop()
    cfg = ControlConfig(url, actor_name="a")
    assert cfg.fence_when_unreachable is False            # what `tandem serve` workers use
    with pytest.raises(ClusterStateUnavailable) as err:
        WorkerControl(cfg, "decode-0", "decode", INFO, on_fenced=lambda r: None,
                      on_unfenced=lambda: None)
    assert str(err.value).startswith(f"cluster state (Redis) unreachable at "
                                     f"127.0.0.1:{server.port}/0: worker decode-0 cannot register (")
    assert isinstance(err.value, redis.exceptions.ConnectionError)


# -- the router's view through an outage -----------------------------------------------------
def test_the_registry_keeps_its_view_while_redis_is_unreachable_then_grants_grace(private_redis):
    """SIGSTOP the server: every command times out (unreachable), and the leases (0.5 s)
    expire meanwhile by Redis's own clock while the data survives, as with an external
    Redis that was cut off. Nobody is marked dead during the outage; once it is back,
    a worker that renews in time stays, one that stays silent past the grace goes."""
    server = private_redis()
    state = ClusterState(server.url, socket_timeout_s=0.3)
    reg = RedisRegistry(state, lambda rec: rec.actor_name, flush_grace_s=1.0)
    down: list[str] = []
    reg.add_worker_down_listener(down.append)
    gens = {f"decode-{i}": state.register_worker(f"decode-{i}", "decode", f"a{i}", INFO, 0.5)
            for i in range(2)}
    asyncio.run(reg.refresh())
    assert reg.state_reachable and [w.alive for w in reg.workers()] == [True, True]
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(redis.exceptions.RedisError):
            asyncio.run(reg.refresh())
        assert not reg.state_reachable
        assert reg.state_error.startswith(
            f"cluster state (Redis) unreachable at 127.0.0.1:{server.port}/0")
        time.sleep(0.8)                                   # past the leases' TTL
        with pytest.raises(redis.exceptions.RedisError):
            asyncio.run(reg.refresh())
        assert [w.alive for w in reg.workers()] == [True, True] and down == []
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert wait_for(lambda: state.ping(), 5)
    assert not any(r.alive for r in state.workers())      # both leases lapsed in Redis
    # decode-0 renews first (reasserted: its lease had lapsed, nobody replaced it).
    assert state.renew_lease("decode-0", gens["decode-0"], 10.0,
                             {"role": "decode", "actor_name": "a0", "info": INFO}) == "reasserted"
    asyncio.run(reg.refresh())
    assert reg.state_reachable and reg.state_error is None
    assert [w.alive for w in reg.workers()] == [True, True] and down == []

    async def after_grace():
        await asyncio.sleep(1.1)
        await reg.refresh()
    asyncio.run(after_grace())
    assert down == ["decode-1"]
    assert reg.get("decode-0").alive and not reg.get("decode-1").alive
    state.close()
