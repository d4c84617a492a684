"""Routing policies on crafted stats, and prefix-aware routing fed by real KV cache events.

Block size 4; ``P(n)`` is ``n`` distinct tokens, so ``P(17)`` has 4 hittable
blocks and a worker that prefilled ``P(13)`` holds its first 3.
"""

from __future__ import annotations

import pytest

from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.runtime.outputs import WorkerStats
from tandem.router.prefix_index import prompt_block_hashes
from tandem.router.registry import InProcessRegistry, WorkerHandle
from tandem.router.routing import (
    ROUTING_POLICIES, LeastLoadedPolicy, PrefixAwarePolicy, make_routing_policy)

BS = 4


def P(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def D(worker_id: str, free: int = 100, running: int = 0, waiting: int = 0, usage: float = 0.0,
      role: str = "decode", block_size: int | None = BS) -> WorkerHandle:
    stats = WorkerStats(worker_id, role, num_running=running, num_waiting=waiting,
                        num_free_blocks=free, num_blocks=100, kv_cache_usage=usage)
    info = {} if block_size is None else {"block_size": block_size}
    return WorkerHandle(worker_id, role, actor=object(), info=info, stats=stats)


def Pf(worker_id: str, inflight: int = 0) -> WorkerHandle:
    return WorkerHandle(worker_id, "prefill", actor=object(), info={"block_size": BS},
                        inflight_prefill_tokens=inflight)


def cached(policy: PrefixAwarePolicy, worker_id: str, *prompts: list[int],
           block_size: int = BS) -> KVCacheManager:
    """Prefill ``prompts`` on a real KV cache manager and feed its events to ``policy``."""
    m = KVCacheManager(num_blocks=64, block_size=block_size, enable_kv_events=True)
    for i, tokens in enumerate(prompts):
        hits, n = m.get_computed_blocks(f"r{i}", tokens)
        assert m.allocate_slots(f"r{i}", n, len(tokens) - n, hits)
        m.cache_blocks(f"r{i}", tokens, len(tokens))
        m.free(f"r{i}")
    policy.on_kv_events(worker_id, m.take_kv_events())
    return m


# -- least_loaded ------------------------------------------------------------------------------

def test_least_loaded_decode_most_free_blocks_then_fewest_requests_then_id():
    pol = LeastLoadedPolicy()
    ws = [D("d0", free=10, running=1), D("d1", free=12, running=5, waiting=4),
          D("d2", free=12, running=3, waiting=5)]
    assert pol.pick_decode(ws, P(9)).worker_id == "d2"      # 12 free; 8 < 9 requests
    ws = [D("d1", free=12, running=8), D("d0", free=12, running=8)]
    assert pol.pick_decode(ws, P(9)).worker_id == "d0"      # full tie: smallest id
    # In-flight requests (every router's) come first; the stats break ties.
    assert pol.pick_decode(ws, P(9), {"d0": 2, "d1": 1}).worker_id == "d1"
    assert pol.pick_decode(ws, P(9), {"d0": 1, "d1": 1}).worker_id == "d0"


def test_least_loaded_decode_no_stats_sorts_as_zero_free_blocks():
    pol = LeastLoadedPolicy()
    fresh = WorkerHandle("d0", "decode", actor=object())
    assert pol.pick_decode([fresh, D("d1", free=1, running=50)], []).worker_id == "d1"
    assert pol.pick_decode([fresh, D("d1", free=0, running=1)], []).worker_id == "d0"


def test_least_loaded_prefill_fewest_inflight_tokens_then_id():
    pol = LeastLoadedPolicy()
    ws = [Pf("p0", 100), Pf("p2", 50), Pf("p1", 50)]
    assert pol.pick_prefill(ws, P(9)).worker_id == "p1"


def test_dead_workers_are_skipped_and_none_alive_raises():
    pol = LeastLoadedPolicy()
    best = D("d0", free=90)
    best.alive = False
    assert pol.pick_decode([best, D("d1", free=10)], []).worker_id == "d1"
    with pytest.raises(RuntimeError, match="no decode worker is alive"):
        pol.pick_decode([best], [])
    p = Pf("p0")
    p.alive = False
    with pytest.raises(RuntimeError, match="no prefill worker is alive"):
        pol.pick_prefill([p], [])
    with pytest.raises(RuntimeError, match="no prefill worker is alive"):
        PrefixAwarePolicy().pick_prefill([], [])


# -- the registry of policies ----------------------------------------------------------------

def test_make_routing_policy():
    assert list(ROUTING_POLICIES) == ["least_loaded", "prefix_aware"]
    assert isinstance(make_routing_policy("least_loaded"), LeastLoadedPolicy)
    pol = make_routing_policy("prefix_aware", max_kv_usage=0.5, max_extra_requests=2)
    assert isinstance(pol, PrefixAwarePolicy)
    assert (pol.max_kv_usage, pol.max_extra_requests) == (0.5, 2)
    with pytest.raises(ValueError, match=r"routing_policy: unknown 'random', expected one of "
                                         r"least_loaded, prefix_aware"):
        make_routing_policy("random")
    with pytest.raises(ValueError, match="max_kv_usage must be in"):
        make_routing_policy("prefix_aware", max_kv_usage=0.0)
    with pytest.raises(ValueError, match="max_extra_requests must be >= 0"):
        PrefixAwarePolicy(max_extra_requests=-1)


# -- prefix_aware: hashing -------------------------------------------------------------------

def test_prompt_block_hashes_are_the_engines():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = P(17)
    assert m.allocate_slots("a", 0, 17)
    m.cache_blocks("a", tokens, 17)
    assert m.req_to_block_hashes["a"] == prompt_block_hashes(tokens, BS)
    # The last prompt token is always computed: 16 tokens hit at most 3 blocks.
    assert prompt_block_hashes(tokens[:16], BS) == m.req_to_block_hashes["a"][:3]
    assert [b.block_hash for b in m.find_cached_prefix(tokens[:16])] == \
        prompt_block_hashes(tokens[:16], BS)
    assert prompt_block_hashes(tokens[:4], BS) == []
    assert prompt_block_hashes([], BS) == []
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        prompt_block_hashes(tokens, 0)


# -- prefix_aware: decode --------------------------------------------------------------------

def test_prefix_aware_decode_longest_prefix_wins_over_least_loaded():
    pol = PrefixAwarePolicy()
    cached(pol, "d0", P(13))          # 3 blocks of P(17)
    cached(pol, "d1", P(9))           # 2 blocks
    ws = [D("d0", free=40, running=2), D("d1", free=50, running=1), D("d2", free=60)]
    assert pol.cached_prefix_tokens(ws, P(17)) == {"d0": 12, "d1": 8, "d2": 0}
    assert pol.pick_decode(ws, P(17)).worker_id == "d0"
    # P(10) has 2 hittable blocks and both hold them: the tie goes to the least loaded.
    assert pol.pick_decode(ws, P(10)).worker_id == "d1"
    # Nobody holds a block: least-loaded.
    assert pol.pick_decode(ws, P(17, start=500)).worker_id == "d2"
    assert LeastLoadedPolicy().pick_decode(ws, P(17)).worker_id == "d2"


def test_prefix_aware_decode_falls_back_when_the_holder_is_overloaded():
    pol = PrefixAwarePolicy(max_kv_usage=0.9, max_extra_requests=8)
    cached(pol, "d0", P(13))
    cached(pol, "d1", P(9))
    least = D("d2", free=60, running=2, waiting=1)            # 3 requests
    # KV usage over the threshold: the next longest prefix wins.
    ws = [D("d0", free=5, usage=0.95), D("d1", free=50), least]
    assert pol.pick_decode(ws, P(17)).worker_id == "d1"
    ws = [D("d0", free=5, usage=0.9), D("d1", free=50), least]     # at the threshold: fine
    assert pol.pick_decode(ws, P(17)).worker_id == "d0"
    # In-flight requests: d0 holds 12 of 17 tokens, a credit of 8 * 12 / 17 = 5.6
    # requests; d1 holds 8 (3.8).
    ws = [D("d0", free=40), D("d1", free=40), least]
    assert pol.decode_candidates(ws, P(17)) == [
        (ws[0], pytest.approx(-8 * 12 / 17)), (ws[1], pytest.approx(-8 * 8 / 17)), (least, 0.0)]
    assert pol.pick_decode(ws, P(17), {"d0": 1}).worker_id == "d0"     # -4.6 < -3.8
    assert pol.pick_decode(ws, P(17), {"d0": 2}).worker_id == "d1"     # -3.6 > -3.8
    assert pol.pick_decode(ws, P(17), {"d0": 6, "d1": 4, "d2": 0}).worker_id == "d2"
    # A hit of every hittable block of a prompt (16 of P(17)'s 17 tokens) is worth
    # 8 * 16 / 17 = 7.5 requests: 7 more in flight still win, 8 do not.
    cached(pol, "d0", P(17))
    two = [D("d0", free=40), least]
    assert pol.pick_decode(two, P(17), {"d0": 7}).worker_id == "d0"
    assert pol.pick_decode(two, P(17), {"d0": 8}).worker_id == "d2"


def test_prefix_aware_decode_ignores_a_dead_worker_and_forgets_it_via_the_registry():
    pol = PrefixAwarePolicy()
    reg = InProcessRegistry([D("d0", free=40), D("d1", free=50), D("d2", free=60)])
    reg.add_worker_down_listener(pol.forget_worker)
    cached(pol, "d0", P(13))
    cached(pol, "d1", P(9))
    # A dead handle is skipped even while the index still lists its blocks.
    dead = D("d0", free=40)
    dead.alive = False
    assert pol.pick_decode([dead, D("d1", free=50), D("d2", free=60)], P(17)).worker_id == "d1"
    assert pol.pick_decode(reg.alive("decode"), P(17)).worker_id == "d0"
    reg.mark_dead("d0")
    assert pol.index.hashes_of("d0") == frozenset()
    # Handed a dead worker anyway, the policy skips it.
    assert pol.pick_decode(reg.workers("decode"), P(17)).worker_id == "d1"
    # Replaced (restarted with an empty cache): its entries go at once.
    assert len(pol.index.hashes_of("d1")) == 2
    reg.add(D("d1", free=50))
    assert pol.index.hashes_of("d1") == frozenset()
    assert pol.pick_decode(reg.alive("decode"), P(17)).worker_id == "d2"


def test_prefix_aware_hashes_at_each_workers_block_size():
    pol = PrefixAwarePolicy()
    cached(pol, "d0", P(13), block_size=2)       # 6 blocks of 2 tokens
    cached(pol, "d1", P(13))                     # 3 blocks of 4 tokens
    ws = [D("d0", block_size=2), D("d1"), D("d2", block_size=None)]
    assert pol.cached_prefix_tokens(ws, P(17)) == {"d0": 12, "d1": 12, "d2": 0}
    assert pol.cached_prefix_tokens(ws, P(12)) == {"d0": 10, "d1": 8, "d2": 0}
    assert pol.pick_decode(ws, P(12)).worker_id == "d0"


# -- prefix_aware: prefill -------------------------------------------------------------------

def test_prefix_aware_prefill_queued_plus_uncached_tokens():
    pol = PrefixAwarePolicy()
    cached(pol, "p0", P(9))                       # 8 tokens of P(17) cached
    prompt = P(17)
    # Cost: in-flight tokens + prompt tokens to compute.
    assert pol.pick_prefill([Pf("p0", 0), Pf("p1", 0)], prompt).worker_id == "p0"   # 9 < 17
    assert pol.pick_prefill([Pf("p0", 9), Pf("p1", 0)], prompt).worker_id == "p1"   # 18 > 17
    # 17 == 17: the longer prefix wins the tie.
    assert pol.pick_prefill([Pf("p0", 8), Pf("p1", 0)], prompt).worker_id == "p0"
    # No hits anywhere: exactly least-loaded.
    ws = [Pf("p0", 100), Pf("p2", 50), Pf("p1", 50)]
    assert pol.pick_prefill(ws, P(17, start=500)).worker_id == "p1"
    dead = Pf("p0", 0)
    dead.alive = False
    assert pol.pick_prefill([dead, Pf("p1", 30)], prompt).worker_id == "p1"


@pytest.mark.parametrize("prefill_tokens,decode_tokens,local", [
    (0, 0, False),          # an idle prefill worker takes it
    (511, 0, False),        # below the limit
    (512, 0, True),         # the limit reached, the decode worker has less of its own
    (2048, 1024, True),
    (2048, 2048, False),    # as much in flight on the decode worker: the prefill queue is
    (1024, 3072, False)])   # no longer the longer one
def test_conditional_disaggregation_weighs_both_workers_prompt_queues(
        prefill_tokens, decode_tokens, local):
    from tandem.engine.sampling.sampling_params import SamplingParams
    from tandem.router.cluster import Cluster
    from tandem.router.orchestrator import Orchestrator
    from tandem.router.validation import ValidatedRequest

    registry = InProcessRegistry()
    prefill, decode = D("prefill-0", role="prefill"), D("decode-0")
    registry.add(prefill)
    registry.add(decode)
    prefill.inflight_prefill_tokens, decode.inflight_prefill_tokens = prefill_tokens, decode_tokens
    v = ValidatedRequest("r", tuple(P(256)), SamplingParams(max_tokens=4), 0, False)
    cluster = Cluster(registry, LeastLoadedPolicy(), router_id="router-a")
    conditional = Orchestrator(cluster, tokenizer=None, max_prefill_queue_tokens=512)
    assert conditional._pick_prefill(v, decode) is (None if local else prefill)
    # Without the limit every prompt goes to the prefill worker; with one, n > 1 and
    # prompt logprobs stay on the decode worker as before.
    assert Orchestrator(cluster, tokenizer=None)._pick_prefill(v, decode) is prefill
    for params in (SamplingParams(max_tokens=4, n=2), SamplingParams(max_tokens=4, prompt_logprobs=1)):
        v2 = ValidatedRequest("r", tuple(P(256)), params, 0, False)
        assert conditional._pick_prefill(v2, decode) is None
    with pytest.raises(ValueError, match="max_prefill_queue_tokens"):
        Orchestrator(cluster, tokenizer=None, max_prefill_queue_tokens=0)


@pytest.mark.parametrize("running,waiting,others,own_prompts,stats,local", [
    (0, 0, 0, 0, True, True),       # idle: prefilled where it will be decoded
    (0, 0, 0, 0, False, True),      # no step output yet: nothing to step either
    (1, 0, 1, 1, True, True),       # a burst: the only other one is a prompt it prefills
    (0, 0, 1, 0, True, False),      # another request of this router is (or will be) decoded
    (1, 0, 2, 1, True, False),      # a prompt of its own, and a request to decode
    (1, 0, 0, 0, True, False),      # a decode batch (another router's) would wait behind it
    (0, 1, 0, 0, True, False),      # one waits (for its KV cache, or to be scheduled)
    (2, 0, 1, 1, True, False)])     # its own prompt, and another router's request
def test_prefer_local_prefill_only_while_the_decode_worker_has_no_decode_batch(
        running, waiting, others, own_prompts, stats, local):
    from tandem.engine.sampling.sampling_params import SamplingParams
    from tandem.router.cluster import Cluster
    from tandem.router.orchestrator import Orchestrator
    from tandem.router.validation import ValidatedRequest

    registry = InProcessRegistry()
    prefill, decode = D("prefill-0", role="prefill"), D("decode-0", running=running,
                                                         waiting=waiting)
    if not stats:
        decode.stats = None
    registry.add(prefill)
    registry.add(decode)
    decode.inflight_local_prefills = own_prompts
    decode.inflight_prefill_tokens = 256 * own_prompts
    cluster = Cluster(registry, LeastLoadedPolicy(), router_id="router-a")
    for i in range(others):
        cluster.register(f"other-{i}", decode)
    cluster.register("rid", decode)           # the request being routed: not counted
    v = ValidatedRequest("r", tuple(P(256)), SamplingParams(max_tokens=4), 0, False)
    when_idle = Orchestrator(cluster, tokenizer=None, prefer_local_prefill=True)
    assert when_idle._pick_prefill(v, decode, "rid") is (None if local else prefill)
    # Off (the default), or with only the queue rule, an idle decode worker gets no prompt.
    assert Orchestrator(cluster, tokenizer=None)._pick_prefill(v, decode, "rid") is prefill
    queue_rule = Orchestrator(cluster, tokenizer=None, max_prefill_queue_tokens=512)
    assert queue_rule._pick_prefill(v, decode, "rid") is prefill
    # The request's own registration counts when its id is not given.
    if not own_prompts:
        assert when_idle._pick_prefill(v, decode) is prefill


@pytest.mark.parametrize("waiting_kv,own_prompts,queued,running,local", [
    (1, 0, 256, 0, True),      # one prompt sent away, nothing to decode: the next one stays
    (1, 1, 256, 0, False),     # as many tokens on both: the prefill worker's turn
    (2, 1, 512, 0, True),      # the prefill worker's queue the longer: the decode worker's
    (1, 0, 0, 0, True),        # its KV is on the way, the prefill worker idle again
    (1, 0, 256, 1, False),     # beside a decode batch no prompt stays
    (0, 1, 256, 0, False)])    # another router's prompt on the prefill worker, as many here
def test_prefer_local_prefill_shares_a_burst_with_a_busy_prefill_worker(
        waiting_kv, own_prompts, queued, running, local):
    """Requests waiting for their KV cache from the prefill worker are no decode batch:
    while the decode worker has none, a prompt goes to whichever of the two workers has
    fewer prompt tokens in flight (the prefill worker idle: the decode worker)."""
    from tandem.engine.sampling.sampling_params import SamplingParams
    from tandem.router.cluster import Cluster
    from tandem.router.orchestrator import Orchestrator
    from tandem.router.validation import ValidatedRequest

    registry = InProcessRegistry()
    prefill = D("prefill-0", role="prefill")
    decode = D("decode-0", running=running, waiting=waiting_kv + own_prompts)
    registry.add(prefill)
    registry.add(decode)
    prefill.inflight_prefill_tokens = queued
    decode.inflight_remote_prefills = waiting_kv
    decode.inflight_local_prefills = own_prompts
    decode.inflight_prefill_tokens = 256 * own_prompts
    cluster = Cluster(registry, LeastLoadedPolicy(), router_id="router-a")
    for i in range(waiting_kv + own_prompts + running):
        cluster.register(f"other-{i}", decode)
    cluster.register("rid", decode)
    v = ValidatedRequest("r", tuple(P(256)), SamplingParams(max_tokens=4), 0, False)
    orch = Orchestrator(cluster, tokenizer=None, prefer_local_prefill=True)
    assert orch._pick_prefill(v, decode, "rid") is (None if local else prefill)
    assert Orchestrator(cluster, tokenizer=None)._pick_prefill(v, decode, "rid") is prefill


@pytest.mark.parametrize("cached_tokens,local", [
    (64, True),         # all of it: nothing to compute but its last token
    (60, True),         # all but one block (4 tokens)
    (56, False),        # two blocks to compute: a prefill worker's job while it decodes
    (0, False)])
def test_prefer_local_prefill_keeps_a_prompt_the_busy_decode_worker_holds(cached_tokens, local):
    from tandem.engine.sampling.sampling_params import SamplingParams
    from tandem.router.cluster import Cluster
    from tandem.router.orchestrator import Orchestrator
    from tandem.router.validation import ValidatedRequest

    prompt = P(64)
    for policy in (PrefixAwarePolicy(), LeastLoadedPolicy()):
        registry = InProcessRegistry()
        prefill, decode = D("prefill-0", role="prefill"), D("decode-0", running=3)
        registry.add(prefill)
        registry.add(decode)
        if cached_tokens and isinstance(policy, PrefixAwarePolicy):
            # Real KV events of a decode worker that computed that much of the prompt.
            cached(policy, "decode-0", prompt[:cached_tokens] + [7])
        cluster = Cluster(registry, policy, router_id="router-a")
        cluster.register("busy", decode)         # a decode batch: the idle half says no
        cluster.register("rid", decode)
        v = ValidatedRequest("r", tuple(prompt), SamplingParams(max_tokens=4), 0, False)
        orch = Orchestrator(cluster, tokenizer=None, prefer_local_prefill=True)
        expected = local and isinstance(policy, PrefixAwarePolicy)    # no index, no hits
        assert orch._pick_prefill(v, decode, "rid") is (None if expected else prefill)
        assert Orchestrator(cluster, tokenizer=None)._pick_prefill(v, decode, "rid") is prefill
