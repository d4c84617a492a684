"""Swap to host memory in the KV cache manager, and the preemption policies.

Pure Python, exact block ids. Block size 4; ``P(n)`` is ``n`` distinct tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engine.kv.block_pool import NoFreeBlocksError
from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.kv.kv_swap import HostBlockPool
from tandem.engine.scheduling.preemption import (CostModelPolicy, PreemptionMode, RecomputePolicy,
                                      SwapPolicy, get_preemption_policy)
from tandem.engine.scheduling.request import Request
from tandem.engine.sampling.sampling_params import SamplingParams

BS = 4


def P(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def prefill(m: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    hits, num_computed = m.get_computed_blocks(rid, tokens)
    assert m.allocate_slots(rid, num_computed, len(tokens) - num_computed, hits)
    m.cache_blocks(rid, tokens, len(tokens))
    return m.get_block_ids(rid)


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return ({r: m.get_block_ids(r) for r in m.req_to_blocks},
            {r: list(h) for r, h in m.swap_manager.req_to_host_blocks.items()},
            {r: list(h) for r, h in m.req_to_block_hashes.items()},
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            sorted(m.swap_manager.host_pool._free), list(m._pending_copies), list(m.swap_manager.pending_swap_out),
            list(m.swap_manager.pending_swap_in), list(m.swap_manager.host_blocks_to_release))


# -- host block pool ----------------------------------------------------------------------

def test_host_pool_hands_out_ids_in_order_and_reuses_the_last_freed():
    h = HostBlockPool(4)
    assert h.allocate(3) == [0, 1, 2]
    assert (h.num_free_blocks, h.num_used_blocks) == (1, 3)
    h.free([1])
    assert h.allocate(2) == [1, 3]
    h.check_invariants()
    with pytest.raises(NoFreeBlocksError):
        h.allocate(1)
    assert h.num_free_blocks == 0


def test_host_pool_double_free_raises_and_changes_nothing():
    h = HostBlockPool(3)
    h.allocate(2)
    for bad in ([0, 0], [2], [0, 5]):
        with pytest.raises(ValueError):
            h.free(bad)
        assert (h.num_free_blocks, h.num_used_blocks) == (1, 2)
    h.check_invariants()
    with pytest.raises(ValueError):
        HostBlockPool(-1)
    assert HostBlockPool(0).allocate(0) == []


def test_host_pool_check_invariants_detects_a_lost_block():
    h = HostBlockPool(3)
    h._free.pop()
    with pytest.raises(AssertionError, match="missing"):
        h.check_invariants()


# -- swap out / swap in ---------------------------------------------------------------------

def test_swap_out_moves_the_table_to_host_and_frees_device_blocks():
    m = KVCacheManager(8, BS, num_host_blocks=6)
    assert prefill(m, "a", P(10)) == [0, 1, 2]       # blocks 0, 1 cached; 2 partial
    assert m.can_swap_out("a")
    assert m.swap_out("a")
    assert m.get_block_ids("a") == [] and m.get_host_block_ids("a") == [0, 1, 2]
    assert m.is_swapped("a") and m.num_blocks_of("a") == 0
    assert m.num_free_blocks == 8 and m.num_free_host_blocks == 3
    # Freed tail first, hashes kept: the cached blocks stay findable.
    assert [b.block_id for b in m.block_pool.free_block_queue] == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.block_pool.num_cached_blocks == 2
    assert m.take_pending_swaps() == ([(0, 0), (1, 1), (2, 2)], [])
    assert m.take_pending_swaps() == ([], [])
    m.check_invariants()
    with pytest.raises(ValueError, match="swapped out"):
        m.allocate_slots("a", 10, 1)
    with pytest.raises(KeyError):
        m.swap_out("a")


def test_swap_in_reuses_cached_blocks_and_copies_the_rest():
    m = KVCacheManager(8, BS, num_host_blocks=6)
    prefill(m, "a", P(10))
    m.swap_out("a")
    m.take_pending_swaps()
    # Blocks 0 and 1 are still cached (free): taken back by hash, no copy.
    assert m.num_blocks_to_swap_in("a") == 3
    assert m.swap_in("a")
    assert m.get_block_ids("a") == [0, 1, 3]
    assert m.take_pending_swaps() == ([], [(2, 3)])
    assert m.num_free_blocks == 5 and m.num_free_host_blocks == 6
    assert not m.is_swapped("a")
    m.check_invariants()
    # It continues where it stopped: token 11 goes into block 3, no copy-on-write.
    assert m.allocate_slots("a", 10, 1) and m.get_block_ids("a") == [0, 1, 3]
    assert m.take_pending_copies() == []


def test_swap_in_after_eviction_copies_every_block_and_recaches_them():
    m = KVCacheManager(6, BS, num_host_blocks=6)
    tokens = P(10)
    prefill(m, "a", tokens)
    hashes = list(m.req_to_block_hashes["a"])
    m.swap_out("a")
    m.take_pending_swaps()
    assert m.allocate_slots("x", 0, 24)          # takes all 6 blocks: a's hashes evicted
    assert m.block_pool.num_cached_blocks == 0
    assert m.swap_in("a") is False               # nothing free: nothing changes
    m.free("x")
    before = snapshot(m)
    assert m.num_blocks_to_swap_in("a") == 3
    assert m.swap_in("a")
    assert m.take_pending_swaps()[1] == list(zip([0, 1, 2], m.get_block_ids("a")))
    pool = m.block_pool
    # The two full blocks are findable again under their old hashes.
    assert [pool.get_cached_block(h).block_id for h in hashes] == m.get_block_ids("a")[:2]
    assert m.get_computed_blocks("b", tokens)[1] == 8
    assert before != snapshot(m)
    m.check_invariants()


def test_swap_in_of_a_block_shared_with_a_running_request_takes_no_free_block():
    m = KVCacheManager(8, BS, num_host_blocks=8)
    prefill(m, "a", P(10))
    hits, n = m.get_computed_blocks("b", P(8) + [1, 2])
    assert m.allocate_slots("b", n, 2, hits) and m.get_block_ids("b") == [0, 1, 3]
    assert m.num_shared_cached_prefix_blocks("a") == 2
    assert m.num_shared_cached_prefix_blocks("b") == 2
    assert m.swap_out("a")
    assert m.num_shared_cached_prefix_blocks("a") == 0   # swapped: holds no device blocks
    # Blocks 0 and 1 stay allocated to b; only a's block 2 was released.
    assert m.num_free_blocks == 5
    m.take_pending_swaps()
    # 0 and 1 are in use by b: shared, not taken from the free queue.
    assert m.num_blocks_to_swap_in("a") == 1
    assert m.swap_in("a") and m.get_block_ids("a") == [0, 1, 4]
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert m.take_pending_swaps() == ([], [(2, 4)])
    m.check_invariants()


def test_swap_out_fails_atomically_when_the_host_pool_is_short():
    m = KVCacheManager(8, BS, num_host_blocks=2)
    prefill(m, "a", P(10))
    assert not m.can_swap_out("a")
    before = snapshot(m)
    assert m.swap_out("a") is False
    assert snapshot(m) == before
    assert not m.can_swap_out("unknown")
    assert KVCacheManager(8, BS).can_swap_out("a") is False     # no host pool


def test_swap_in_fails_atomically_when_device_blocks_are_short():
    m = KVCacheManager(5, BS, num_host_blocks=5, enable_caching=False)
    prefill(m, "a", P(10))
    m.swap_out("a")
    m.take_pending_swaps()
    assert m.allocate_slots("x", 0, 12)      # 3 of 5 blocks
    assert m.num_blocks_to_swap_in("a") == 3
    before = snapshot(m)
    assert m.swap_in("a") is False
    assert snapshot(m) == before
    with pytest.raises(KeyError):
        m.swap_in("x")


def test_host_blocks_read_by_a_swap_in_are_not_reused_in_the_same_step():
    m = KVCacheManager(8, BS, num_host_blocks=3, enable_caching=False)
    prefill(m, "a", P(8))
    prefill(m, "b", P(8, start=200))
    assert m.swap_out("a") and m.get_host_block_ids("a") == [0, 1]
    m.take_pending_swaps()
    assert m.swap_in("a")
    # a's host blocks 0 and 1 are still to be read by this step's swap-in.
    assert m.num_free_host_blocks == 1 and m.swap_out("b") is False
    assert m.take_pending_swaps()[1] == [(0, 4), (1, 5)]
    assert m.num_free_host_blocks == 3 and m.swap_out("b")
    m.check_invariants()


def test_swap_out_refuses_blocks_written_by_a_pending_operation():
    m = KVCacheManager(8, BS, num_host_blocks=8)
    prefill(m, "a", P(6))
    m.fork("a", "b")
    assert m.allocate_slots("b", 6, 1)               # copy-on-write of block 1 queued
    assert m._pending_copies == [(1, 2)]
    before = snapshot(m)
    with pytest.raises(ValueError, match="queued"):
        m.swap_out("b")
    assert snapshot(m) == before
    assert m.swap_out("a")                           # a's blocks are not written this step
    m.check_invariants()


def test_free_drops_queued_operations_into_blocks_it_releases():
    m = KVCacheManager(8, BS, num_host_blocks=8, enable_caching=False)
    prefill(m, "a", P(6))
    m.fork("a", "b")
    assert m.allocate_slots("b", 6, 1) and m._pending_copies == [(1, 2)]
    prefill(m, "c", P(4, start=300))
    assert m.swap_out("c")
    m.take_pending_swaps()
    assert m.swap_in("c") and m.swap_manager.pending_swap_in == [(0, 4)]
    # b and c freed in the same step: their blocks may be handed out again now,
    # so the copy into block 2 and the swap-in into block 4 must not run.
    m.free("b")
    m.free("c")
    assert m.take_pending_copies() == []
    assert m.take_pending_swaps() == ([], [])
    m.check_invariants()


def test_a_copy_source_is_not_reused_before_the_copy_is_taken():
    m = KVCacheManager(4, BS, num_host_blocks=4, enable_caching=False)
    prefill(m, "x", P(4, start=300))               # block 0
    assert m.swap_out("x")
    m.take_pending_swaps()
    assert prefill(m, "a", P(6)) == [1, 2]         # block 2 holds 2 of 4 tokens
    m.fork("a", "b")
    assert m.allocate_slots("b", 6, 1) and m._pending_copies == [(2, 3)]
    # a leaves in the same step: block 2 is still to be read by the copy, so it
    # is not free, and x's swap-in cannot land in it (it would run before the copy).
    m.free("a")
    assert m.block_pool.blocks[2].ref_cnt == 1 and m.num_free_blocks == 1
    assert m.swap_in("x") and m.get_block_ids("x") == [0]
    m.check_invariants()
    assert m.take_pending_copies() == [(2, 3)]
    assert m.block_pool.blocks[2].ref_cnt == 0 and m.num_free_blocks == 1
    m.check_invariants()


def test_abort_of_a_swapped_request_frees_its_host_blocks_and_its_swap_out():
    m = KVCacheManager(8, BS, num_host_blocks=4)
    prefill(m, "a", P(10))
    m.swap_out("a")
    assert m.free("a") is True
    assert m.num_free_host_blocks == 4 and m.num_free_blocks == 8
    assert m.take_pending_swaps() == ([], [])   # its copies would write freed host blocks
    assert m.free("a") is False
    m.check_invariants()


def test_check_invariants_detects_a_host_block_no_table_holds():
    m = KVCacheManager(4, BS, num_host_blocks=4)
    prefill(m, "a", P(5))
    m.swap_out("a")
    m.swap_manager.host_pool.allocate(1)
    with pytest.raises(AssertionError, match="host tables hold 2 blocks"):
        m.check_invariants()


def test_swap_modules_import_no_torch():
    code = ("import sys, tandem.engine.kv.kv_swap, tandem.engine.kv.kv_cache_manager;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- preemption policies --------------------------------------------------------------------

def _request(rid: str, num_computed: int) -> Request:
    r = Request(rid, P(num_computed + 1), SamplingParams(max_tokens=4))
    r.num_computed_tokens = num_computed
    return r


def test_recompute_and_swap_policies():
    m = KVCacheManager(8, BS, num_host_blocks=3)
    prefill(m, "a", P(10))
    prefill(m, "b", P(13, start=200))
    a, b = _request("a", 10), _request("b", 13)
    assert RecomputePolicy().choose(a, m) is PreemptionMode.RECOMPUTE
    assert SwapPolicy().choose(a, m) is PreemptionMode.SWAP          # 3 blocks fit
    assert SwapPolicy().choose(b, m) is PreemptionMode.RECOMPUTE     # 4 blocks do not


def test_cost_model_compares_recompute_tokens_with_swapped_bytes():
    m = KVCacheManager(16, BS, num_host_blocks=16)
    prefill(m, "a", P(10))                                # 3 blocks, 10 tokens
    # 10 tokens at 10 tokens/s = 1 s; 6 blocks moved at 1000 bytes each, 10 kB/s = 0.6 s.
    policy = CostModelPolicy(1000, recompute_tokens_per_s=10, swap_bytes_per_s=10_000)
    a = _request("a", 10)
    assert policy.recompute_cost_s(a, m) == pytest.approx(1.0)
    assert policy.swap_cost_s(a, m) == pytest.approx(0.6)
    assert policy.choose(a, m) is PreemptionMode.SWAP
    slow_link = CostModelPolicy(1000, recompute_tokens_per_s=10, swap_bytes_per_s=5_000)
    assert slow_link.swap_cost_s(a, m) == pytest.approx(1.2)
    assert slow_link.choose(a, m) is PreemptionMode.RECOMPUTE
    # A fork shares a's two full cached blocks: for it (and for a) only 2 tokens
    # are lost by recompute, and the shared blocks need not come back in.
    m.fork("a", "c")
    assert m.num_shared_cached_prefix_blocks("c") == 2
    c = _request("c", 10)
    assert policy.recompute_cost_s(c, m) == pytest.approx(0.2)
    assert policy.swap_cost_s(c, m) == pytest.approx(0.4)
    assert policy.choose(c, m) is PreemptionMode.RECOMPUTE
    # Cheaper to swap, but no room on the host: recompute.
    full = KVCacheManager(16, BS, num_host_blocks=2)
    prefill(full, "a", P(10))
    assert policy.choose(a, full) is PreemptionMode.RECOMPUTE


def test_policy_registry_and_config_validation():
    assert SchedulerConfig().preemption_mode == "auto"
    for mode, cls in (("auto", CostModelPolicy), ("swap", SwapPolicy),
                      ("recompute", RecomputePolicy)):
        assert isinstance(get_preemption_policy(SchedulerConfig(preemption_mode=mode), 64), cls)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="evict")
    with pytest.raises(ValueError, match="swap_bytes_per_s"):
        SchedulerConfig(swap_bytes_per_s=0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        CacheConfig(num_host_blocks=-1)
    with pytest.raises(ValueError, match="swap_space_bytes"):
        CacheConfig(swap_space_bytes=-1)
