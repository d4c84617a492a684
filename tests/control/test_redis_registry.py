"""The router's view of the cluster state (:class:`RedisRegistry`) on a real redis-server:
new workers appear, restarted ones replace their handle, a lapsed or suspected lease
marks a worker dead, and a flushed Redis purges nobody."""

from __future__ import annotations

import asyncio

from tandem.control.state import ClusterState
from tandem.router.redis_registry import RedisRegistry

INFO = {"block_size": 16}


class Actor:
    def __init__(self, name: str):
        self.name = name


def _registry(state: ClusterState, **kw) -> tuple[RedisRegistry, list[str], list[str]]:
    reg = RedisRegistry(state, lambda rec: Actor(rec.actor_name), **kw)
    up, down = [], []
    reg.add_worker_up_listener(lambda h: up.append(f"{h.worker_id}@{h.generation}"))
    reg.add_worker_down_listener(down.append)
    return reg, up, down


def test_new_restarted_and_lapsed_workers(state):
    reg, up, down = _registry(state)
    g_d = state.register_worker("decode-0", "decode", "a-d0", INFO)
    g_p = state.register_worker("prefill-0", "prefill", "a-p0", INFO)
    asyncio.run(reg.refresh())
    assert [(w.worker_id, w.generation, w.actor.name, w.alive) for w in reg.workers()] == [
        ("decode-0", g_d, "a-d0", True), ("prefill-0", g_p, "a-p0", True)]
    assert reg.healthy
    assert reg.get("decode-0").block_size == 16
    # A restart registers a newer generation: the handle is replaced (down, then up).
    g2 = state.register_worker("decode-0", "decode", "a-d0-2", INFO)
    asyncio.run(reg.refresh())
    assert reg.get("decode-0").generation == g2 > g_d
    assert reg.get("decode-0").actor.name == "a-d0-2"
    assert down == ["decode-0"] and up[-1] == f"decode-0@{g2}"
    # The prefill worker's lease goes (suspected by another router): dead here too,
    # but the decode side still serves.
    assert state.mark_suspect("prefill-0", g_p)
    asyncio.run(reg.refresh())
    assert not reg.get("prefill-0").alive and down == ["decode-0", "prefill-0"]
    assert not reg.healthy and reg.can_serve


def test_mark_dead_deletes_the_lease_for_every_router(state):
    a, _, _ = _registry(state)
    b, _, _ = _registry(state)
    g = state.register_worker("decode-0", "decode", "a", INFO)
    state.register_worker("decode-1", "decode", "b", INFO)

    async def run():
        await a.refresh()
        await b.refresh()
        assert a.mark_dead("decode-0")
        for _ in range(100):           # the lease is deleted in the background
            if not next(r for r in state.workers() if r.worker_id == "decode-0").alive:
                break
            await asyncio.sleep(0.01)
        await b.refresh()
    asyncio.run(run())
    assert not b.get("decode-0").alive and b.get("decode-1").alive
    assert not next(r for r in state.workers() if r.worker_id == "decode-0").alive
    assert state.generation("decode-0") == g


def test_a_flushed_redis_purges_nobody_until_the_grace_ends(state):
    reg, _, down = _registry(state, flush_grace_s=0.3)
    for i in range(2):
        state.register_worker(f"decode-{i}", "decode", f"a{i}", INFO)
    asyncio.run(reg.refresh())
    state.redis.flushall()                    # Redis restarted empty
    asyncio.run(reg.refresh())
    assert all(w.alive for w in reg.workers()) and down == []
    # One worker re-asserts under its generation (as its lease keeper does within a
    # renewal): the others keep the grace to do the same.
    assert state.renew_lease("decode-0", reg.get("decode-0").generation, 10.0,
                             {"role": "decode", "actor_name": "a0", "info": INFO}) == "reasserted"
    asyncio.run(reg.refresh())
    assert all(w.alive for w in reg.workers()) and down == []

    async def after_grace(r):
        await asyncio.sleep(0.4)
        await r.refresh()
    asyncio.run(after_grace(reg))          # decode-1 never came back
    assert reg.get("decode-0").alive and not reg.get("decode-1").alive
    assert down == ["decode-1"]
    # Silence from everybody for longer than the grace: they are dead.
    reg2, _, down2 = _registry(state, flush_grace_s=0.3)
    asyncio.run(reg2.refresh())
    state.redis.flushall()
    asyncio.run(reg2.refresh())
    assert down2 == []

    asyncio.run(after_grace(reg2))
    assert down2 == ["decode-0"] and not reg2.get("decode-0").alive


def test_a_worker_reasserting_before_the_first_look_after_a_restart_purges_nobody(state):
    """Workers renew at different moments: one may have re-asserted its record before a
    router first reads the emptied state. The changed epoch still gives the others
    their grace (with every lease gone no longer the only sign)."""
    reg, _, down = _registry(state, flush_grace_s=0.3)
    for i in range(3):
        state.register_worker(f"decode-{i}", "decode", f"a{i}", INFO)
    asyncio.run(reg.refresh())
    state.redis.flushall()
    assert state.renew_lease("decode-0", reg.get("decode-0").generation, 10.0,
                             {"role": "decode", "actor_name": "a0", "info": INFO}) == "reasserted"
    asyncio.run(reg.refresh())
    assert all(w.alive for w in reg.workers()) and down == []
    state.renew_lease("decode-1", reg.get("decode-1").generation, 10.0,
                      {"role": "decode", "actor_name": "a1", "info": INFO})

    async def after_grace(r):
        await asyncio.sleep(0.4)
        await r.refresh()
    asyncio.run(after_grace(reg))
    assert down == ["decode-2"]                 # the one that never came back
    assert [w.worker_id for w in reg.workers() if w.alive] == ["decode-0", "decode-1"]
