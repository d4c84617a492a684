"""KV cache manager: block tables, prefix hits, LRU, copy-on-write, atomic allocation.

Block size 4 throughout; prompts are written so that their blocks are easy to
count: ``P(n)`` is ``n`` distinct tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engine.kv.kv_cache_manager import KVCacheManager

BS = 4


def P(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def prefill(m: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Look up, allocate, 'compute' and cache a whole prompt; returns the block ids."""
    hits, num_computed = m.get_computed_blocks(rid, tokens)
    assert m.allocate_slots(rid, num_computed, len(tokens) - num_computed, hits)
    m.cache_blocks(rid, tokens, len(tokens))
    return m.get_block_ids(rid)


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (
        {rid: m.get_block_ids(rid) for rid in m.req_to_blocks},
        {rid: list(h) for rid, h in m.req_to_block_hashes.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        dict(pool.cached_block_hash_to_block),
        list(m._pending_copies),
    )


def test_allocate_free_exact_ids_and_counts():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    assert m.allocate_slots("a", 0, 10)
    assert m.get_block_ids("a") == [0, 1, 2] and m.num_blocks_of("a") == 3
    assert m.num_free_blocks == 7 and m.usage == pytest.approx(0.3)
    # Decode: token 11 fits in block 2; token 13 needs block 3.
    assert m.allocate_slots("a", 10, 1) and m.get_block_ids("a") == [0, 1, 2]
    assert m.allocate_slots("a", 11, 2) and m.get_block_ids("a") == [0, 1, 2, 3]
    assert m.allocate_slots("b", 0, 4) and m.get_block_ids("b") == [4]
    assert m.num_free_blocks == 5
    m.check_invariants()
    assert m.free("a") is True
    assert m.num_free_blocks == 9 and m.get_block_ids("a") == [] and m.num_blocks_of("a") == 0
    # Freed tail first: queue is 5..9, then 3, 2, 1, 0.
    assert [b.block_id for b in m.block_pool.free_block_queue] == [5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert m.free("a") is False and m.free("never") is False
    m.check_invariants()


def test_cache_blocks_registers_only_full_computed_blocks():
    m = KVCacheManager(10, BS)
    tokens = P(10)
    assert m.allocate_slots("a", 0, 10)
    m.cache_blocks("a", tokens, 6)  # block 0 full and computed; block 1 half computed
    assert m.block_pool.num_cached_blocks == 1
    assert m.block_pool.blocks[0].block_hash is not None
    assert m.block_pool.blocks[1].block_hash is None
    m.cache_blocks("a", tokens, 10)
    m.cache_blocks("a", tokens, 10)  # idempotent
    assert m.block_pool.num_cached_blocks == 2 and m.block_pool.blocks[2].block_hash is None
    assert len(m.req_to_block_hashes["a"]) == 2
    m.check_invariants()


def test_second_request_reuses_the_same_prefix_blocks():
    m = KVCacheManager(10, BS)
    assert prefill(m, "a", P(10)) == [0, 1, 2]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10, 0)
    tokens_b = P(8) + [7, 7, 7]
    hits, n = m.get_computed_blocks("b", tokens_b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (21, 8)
    assert m.allocate_slots("b", n, len(tokens_b) - n, hits)
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert m.num_free_blocks == 6 and m.block_pool.num_cached_blocks == 2
    m.cache_blocks("b", tokens_b, len(tokens_b))
    assert m.block_pool.num_cached_blocks == 2  # blocks 0, 1 were already cached
    m.check_invariants()
    m.free("a")
    m.free("b")
    # Both free, both still cached: a third request hits them from the free queue.
    assert m.num_free_blocks == 10 and m.block_pool.num_free_cached_blocks == 2
    hits, n = m.get_computed_blocks("c", P(9))
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert m.allocate_slots("c", n, 1, hits)
    assert m.get_block_ids("c") == [0, 1, 4] and m.num_free_blocks == 7
    m.check_invariants()


def test_last_prompt_token_is_always_computed():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(12))
    assert m.block_pool.num_cached_blocks == 3
    # Same 12 tokens: the third block holds the last token, so it is not a hit.
    hits, n = m.get_computed_blocks("b", P(12))
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert m.allocate_slots("b", n, 4, hits)
    assert m.get_block_ids("b") == [0, 1, 3]  # block 2 is not reused
    assert m.get_computed_blocks("c", P(4)) == ([], 0)
    assert m.get_computed_blocks("c", P(5))[1] == 4
    assert m.get_computed_blocks("c", []) == ([], 0)
    m.check_invariants()


def test_prefix_match_stops_at_first_differing_block():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(12))
    tokens = P(4) + [0, 0, 0, 0] + P(4, start=108) + [1]  # block 1 differs
    hits, n = m.get_computed_blocks("b", tokens)
    assert [h.block_id for h in hits] == [0] and n == 4


def test_lru_evicts_tail_blocks_of_a_freed_sequence_first():
    m = KVCacheManager(6, BS)
    assert prefill(m, "a", P(13)) == [0, 1, 2, 3]  # blocks 0..2 cached, 3 partial
    m.free("a")
    assert [b.block_id for b in m.block_pool.free_block_queue] == [4, 5, 3, 2, 1, 0]
    # Three fresh blocks: uncached 4, 5, then the partial block 3 (no hash).
    assert m.allocate_slots("x", 0, 12) and m.get_block_ids("x") == [4, 5, 3]
    assert m.block_pool.num_cached_blocks == 3
    # One more: cached block 2 (a's tail) is evicted first; 0 and 1 stay hits.
    assert m.allocate_slots("x", 12, 1) and m.get_block_ids("x") == [4, 5, 3, 2]
    assert m.block_pool.num_cached_blocks == 2
    hits, n = m.get_computed_blocks("b", P(13))
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    m.check_invariants()


def test_freed_before_cache_blocks_is_never_a_hit():
    m = KVCacheManager(10, BS)
    tokens = P(9)
    assert m.allocate_slots("a", 0, 9)
    m.free("a")  # cancelled mid-step: blocks maybe partly written, never cached
    assert m.block_pool.num_cached_blocks == 0
    assert m.get_computed_blocks("b", tokens) == ([], 0)
    m.cache_blocks("a", tokens, 9)  # a late call for a freed request is a no-op
    assert m.block_pool.num_cached_blocks == 0
    m.check_invariants()


def test_fork_then_append_copies_the_shared_partial_block():
    m = KVCacheManager(10, BS)
    tokens = P(6)
    assert prefill(m, "a", tokens) == [0, 1]  # block 1 holds 2 of 4 tokens
    m.fork("a", "b")
    assert m.get_block_ids("b") == [0, 1]
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert m.num_free_blocks == 8
    m.check_invariants()
    # b writes token 6 into shared block 1: copy-on-write into block 2.
    assert m.allocate_slots("b", 6, 1)
    assert m.get_block_ids("b") == [0, 2] and m.get_block_ids("a") == [0, 1]
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    m.check_invariants()
    # a now holds block 1 alone: it writes in place, no copy.
    assert m.allocate_slots("a", 6, 1)
    assert m.get_block_ids("a") == [0, 1] and m.take_pending_copies() == []
    assert m.num_free_blocks == 7
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 10 and m.usage == 0.0
    m.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(8))
    m.fork("a", "b")
    assert m.allocate_slots("b", 8, 1)
    assert m.get_block_ids("b") == [0, 1, 2] and m.take_pending_copies() == []
    m.check_invariants()


def test_write_into_a_cached_block_goes_to_a_fresh_block():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(9))
    hits, n = m.get_computed_blocks("b", P(9))
    assert n == 8
    # Recomputing token 4 onward would overwrite cached block 1 in place.
    assert m.allocate_slots("b", 4, 5, hits)
    assert m.get_block_ids("b") == [0, 3, 4] and m.take_pending_copies() == []
    assert m.block_pool.blocks[1].ref_cnt == 1  # still a's, still cached
    assert m.block_pool.blocks[1].block_hash is not None
    m.check_invariants()


def test_allocate_fails_atomically_when_short_of_blocks():
    m = KVCacheManager(5, BS)
    prefill(m, "a", P(9))  # 3 blocks
    m.fork("a", "b")
    before = snapshot(m)
    # b: 3 more blocks plus a copy of shared block 2 = 4 > 2 free.
    assert m.allocate_slots("b", 9, 12) is False
    assert snapshot(m) == before
    assert m.allocate_slots("c", 0, 9) is False and "c" not in m.req_to_blocks
    assert snapshot(m) == before
    m.check_invariants()


def test_hit_blocks_taken_in_the_same_call_do_not_count_as_free():
    m = KVCacheManager(4, BS)
    prefill(m, "a", P(9))  # blocks 0, 1 cached, 2 partial
    m.free("a")
    assert m.num_free_blocks == 4 and m.block_pool.num_free_cached_blocks == 2
    tokens = P(8) + [9] * 9  # 17 tokens: 5 blocks, 2 of them hits
    hits, n = m.get_computed_blocks("b", tokens)
    assert [h.block_id for h in hits] == [0, 1]
    before = snapshot(m)
    # 3 fresh blocks needed; 4 free, but 2 of those are the hits themselves.
    assert m.allocate_slots("b", n, len(tokens) - n, hits) is False
    assert snapshot(m) == before
    tokens = P(8) + [9] * 7  # 15 tokens: 4 blocks, 2 fresh
    hits, n = m.get_computed_blocks("b", tokens)
    assert m.allocate_slots("b", n, len(tokens) - n, hits)
    assert m.get_block_ids("b") == [0, 1, 3, 2] and m.num_free_blocks == 0
    m.check_invariants()


def test_same_prompt_computed_twice_is_cached_once():
    m = KVCacheManager(10, BS)
    tokens = P(9)
    assert m.allocate_slots("a", 0, 9) and m.allocate_slots("b", 0, 9)
    m.cache_blocks("a", tokens, 9)
    m.cache_blocks("b", tokens, 9)
    assert m.block_pool.num_cached_blocks == 2
    assert [m.block_pool.blocks[i].block_hash is None for i in range(6)] == \
        [False, False, True, True, True, True]
    m.check_invariants()
    m.free("b")
    hits, _ = m.get_computed_blocks("c", tokens)
    assert [h.block_id for h in hits] == [0, 1]


def test_caching_disabled():
    m = KVCacheManager(10, BS, enable_caching=False)
    prefill(m, "a", P(9))
    m.free("a")
    assert m.get_computed_blocks("b", P(9)) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)
    assert m.block_pool.num_cached_blocks == 0
    m.check_invariants()


def test_reset_prefix_cache():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(9))
    assert m.reset_prefix_cache() == 2
    assert m.get_computed_blocks("b", P(9)) == ([], 0)
    m.cache_blocks("a", P(9), 9)  # already hashed for a: not re-registered
    assert m.block_pool.num_cached_blocks == 0
    m.check_invariants()


def test_argument_errors_change_nothing():
    m = KVCacheManager(10, BS)
    prefill(m, "a", P(9))
    hits, n = m.get_computed_blocks("b", P(9))
    before = snapshot(m)
    with pytest.raises(ValueError, match=">= 0"):
        m.allocate_slots("b", -1, 1)
    with pytest.raises(ValueError, match="first allocation"):
        m.allocate_slots("a", 9, 1, hits)
    with pytest.raises(ValueError, match="do not fit"):
        m.allocate_slots("a", 13, 1)
    with pytest.raises(ValueError, match="do not fit"):
        m.allocate_slots("b", 9, 1, hits)
    with pytest.raises(ValueError, match="token ids"):
        m.cache_blocks("a", P(9), 10)
    with pytest.raises(KeyError):
        m.fork("nobody", "c")
    with pytest.raises(ValueError, match="already holds"):
        m.fork("a", "a")
    assert snapshot(m) == before
    m.reset_prefix_cache()
    with pytest.raises(ValueError, match="evicted"):
        m.allocate_slots("b", n, 1, hits)
    with pytest.raises(ValueError):
        KVCacheManager(10, 0)
    m.check_invariants()


def test_check_invariants_detects_a_reference_no_table_holds():
    m = KVCacheManager(4, BS)
    prefill(m, "a", P(5))
    m.block_pool.touch([m.block_pool.blocks[0]])
    with pytest.raises(AssertionError, match="references"):
        m.check_invariants()


def test_imports_no_torch():
    code = ("import sys, tandem.engine.kv.kv_cache_manager;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefix_cache_component_works_on_a_bare_block_pool():
    """PrefixCache needs only the pool's hash index and the table it is handed."""
    from tandem.engine.kv.block_pool import BlockPool
    from tandem.engine.kv.prefix_cache import PrefixCache

    pool = BlockPool(4)
    pc = PrefixCache(pool, 2, enable_caching=True)
    table = pool.get_new_blocks(2)
    hashes: list = []
    pc.cache_full_blocks(table, hashes, [1, 2, 3, 4, 5], 4)
    assert len(hashes) == 2 and [b.block_id for b in table] == [0, 1]
    assert pc.find_cached_prefix([1, 2, 3, 4, 5]) == table
    assert pc.lookup([1, 2, 9]) == ([table[0]], 2)
    assert (pc.num_queried_tokens, pc.num_hit_tokens) == (3, 2)
    assert pc.find_blocks(hashes) == {0: table[0], 1: table[1]}
    assert pool.num_free_blocks == 2                 # lookups take no references
    assert pc.reset() == 2 and pc.find_cached_prefix([1, 2, 3, 4, 5]) == []
