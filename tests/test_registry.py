"""WorkerRegistry (in-process): membership, roles, liveness, health and worker-down callbacks."""

from __future__ import annotations

import pytest

from tandem.engine.runtime.outputs import WorkerStats
from tandem.router.registry import InProcessRegistry, WorkerHandle


def W(worker_id: str, role: str, **kw) -> WorkerHandle:
    return WorkerHandle(worker_id, role, actor=object(), **kw)


def test_add_get_and_roles_in_order():
    reg = InProcessRegistry([W("prefill-0", "prefill"), W("decode-0", "decode"),
                             W("colo-0", "colocated"), W("decode-1", "decode")])
    assert [w.worker_id for w in reg.workers()] == ["prefill-0", "decode-0", "colo-0", "decode-1"]
    # The decode side is decode and colocated workers.
    assert [w.worker_id for w in reg.workers("decode")] == ["decode-0", "colo-0", "decode-1"]
    assert [w.worker_id for w in reg.workers("prefill")] == ["prefill-0"]
    assert reg.get("colo-0").role == "colocated"
    with pytest.raises(KeyError, match="unknown worker 'nope'"):
        reg.get("nope")
    with pytest.raises(ValueError, match="role: unknown 'colocated', expected one of"):
        reg.workers("colocated")
    with pytest.raises(ValueError, match="role: unknown 'router'"):
        reg.add(W("r", "router"))
    assert [w.worker_id for w in reg.workers()] == ["prefill-0", "decode-0", "colo-0", "decode-1"]


def test_block_size_comes_from_info():
    assert W("d", "decode", info={"block_size": 16}).block_size == 16
    assert W("d", "decode").block_size is None


def test_colocated_cluster_health():
    reg = InProcessRegistry()
    health = []
    reg.add_health_listener(health.append)
    assert not reg.healthy and not reg.disaggregated
    reg.add(W("colo-0", "colocated"))
    assert reg.healthy and not reg.disaggregated
    assert reg.mark_dead("colo-0") is True
    assert reg.mark_dead("colo-0") is False     # already dead: no second callback
    assert not reg.healthy
    assert health == [True, False]
    with pytest.raises(KeyError):
        reg.mark_dead("colo-9")


def test_disaggregated_health_follows_what_can_be_served():
    """``healthy`` says whether every pool has a live worker (not degraded); health
    listeners hear ``can_serve``, which a lost prefill pool does not change (the
    decode workers prefill for themselves)."""
    reg = InProcessRegistry()
    health, down = [], []
    reg.add_health_listener(health.append)
    reg.add_worker_down_listener(down.append)
    reg.add(W("prefill-0", "prefill"))
    assert not reg.healthy                       # no decode worker yet
    reg.add(W("decode-0", "decode"))
    assert reg.healthy and reg.disaggregated
    reg.mark_dead("prefill-0")
    # A dead prefill worker stays registered: the cluster is still disaggregated.
    assert reg.disaggregated and not reg.healthy
    assert [w.worker_id for w in reg.alive("prefill")] == []
    assert [w.worker_id for w in reg.workers("prefill")] == ["prefill-0"]
    new = W("prefill-0", "prefill")
    old = reg.add(new)
    assert old is not None and old is not new and not old.alive
    assert reg.get("prefill-0") is new and reg.healthy
    # Replacement keeps the worker's place.
    assert [w.worker_id for w in reg.workers()] == ["prefill-0", "decode-0"]
    assert health == [True]                      # serving from the first decode worker on
    reg.mark_dead("decode-0")
    assert health == [True, False] and not reg.can_serve
    # Dead, then replaced: both end what the router knew of that worker.
    assert down == ["prefill-0", "prefill-0", "decode-0"]


def test_remove():
    reg = InProcessRegistry([W("decode-0", "decode"), W("decode-1", "decode")])
    health, down = [], []
    reg.add_health_listener(health.append)
    reg.add_worker_down_listener(down.append)
    assert reg.remove("decode-9") is None
    assert reg.remove("decode-0").worker_id == "decode-0"
    assert reg.healthy and health == [] and down == ["decode-0"]
    reg.remove("decode-1")
    assert not reg.healthy and health == [False] and down == ["decode-0", "decode-1"]
    assert reg.workers() == []


def test_stats():
    reg = InProcessRegistry([W("decode-0", "decode")])
    assert reg.stats("decode-0") is None
    s = WorkerStats("decode-0", "decode", num_running=3, num_free_blocks=7)
    reg.update_stats("decode-0", s)
    assert reg.stats("decode-0") is s and reg.get("decode-0").stats is s
    with pytest.raises(KeyError):
        reg.update_stats("decode-1", s)
