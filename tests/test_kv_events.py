"""KV cache events from a real KVCacheManager: exact stored / removed hashes, in order.

Block size 4; ``P(n, start)`` is ``n`` distinct tokens, so every block hash is
easy to name: ``h(tokens, i)`` is the chained hash of the first ``i + 1`` blocks.
"""

from __future__ import annotations

import subprocess
import sys

from tandem.engine.kv.block_pool import hash_block_tokens
from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def P(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def h(tokens: list[int], i: int) -> int:
    """Chained hash of block ``i`` of ``tokens``."""
    parent = None
    for j in range(i + 1):
        parent = hash_block_tokens(parent, tokens[j * BS:(j + 1) * BS])
    return parent


def prefill(m: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    hits, num_computed = m.get_computed_blocks(rid, tokens)
    assert m.allocate_slots(rid, num_computed, len(tokens) - num_computed, hits)
    m.cache_blocks(rid, tokens, len(tokens))
    return m.get_block_ids(rid)


def test_stored_on_cache_blocks_removed_on_eviction_by_reuse():
    m = KVCacheManager(num_blocks=5, block_size=BS, enable_kv_events=True)
    a, b, c = P(9, 100), P(5, 200), P(9, 300)
    assert m.take_kv_events() == []
    assert prefill(m, "a", a) == [0, 1, 2]
    # Two full blocks of 9 tokens; the partial third block is never hashed.
    assert m.take_kv_events() == [BlockStored((h(a, 0), h(a, 1)))]
    assert m.take_kv_events() == []

    # Freeing keeps the hashes (the blocks stay findable): no event.
    m.free("a")
    assert m.take_kv_events() == []
    assert [blk.block_id for blk in m.block_pool.free_block_queue] == [3, 4, 2, 1, 0]

    assert prefill(m, "b", b) == [3, 4]
    assert m.take_kv_events() == [BlockStored((h(b, 0),))]

    # c takes 2 (uncached), then 1 and 0: a's blocks are evicted tail first.
    assert prefill(m, "c", c) == [2, 1, 0]
    assert m.take_kv_events() == [BlockRemoved((h(a, 1), h(a, 0))),
                                  BlockStored((h(c, 0), h(c, 1)))]
    m.check_invariants()


def test_prefix_hit_and_a_duplicate_block_record_nothing():
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_kv_events=True)
    a = P(9)
    prefill(m, "a", a)
    m.take_kv_events()
    # Same prompt again: two blocks hit (touch), the third is fresh and partial.
    assert prefill(m, "b", a) == [0, 1, 3]
    assert m.take_kv_events() == []

    # Computed twice without a hit (the lookup ran before a was cached): the
    # second copy is not registered, so it records nothing.
    m2 = KVCacheManager(num_blocks=8, block_size=BS, enable_kv_events=True)
    assert m2.allocate_slots("x", 0, 9) and m2.allocate_slots("y", 0, 9)
    m2.cache_blocks("x", a, 9)
    m2.cache_blocks("y", a, 9)
    assert m2.take_kv_events() == [BlockStored((h(a, 0), h(a, 1)))]


def test_decode_steps_store_each_block_as_it_fills():
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_kv_events=True)
    tokens = P(6)
    prefill(m, "a", tokens)
    assert m.take_kv_events() == [BlockStored((h(tokens, 0),))]
    for t in (900, 901):          # decode: tokens 6 and 7 fill block 1
        tokens.append(t)
        assert m.allocate_slots("a", len(tokens) - 1, 1)
        m.cache_blocks("a", tokens, len(tokens))
    assert m.take_kv_events() == [BlockStored((h(tokens, 1),))]


def test_reset_prefix_cache_clears_and_supersedes_earlier_events():
    m = KVCacheManager(num_blocks=4, block_size=BS, enable_kv_events=True)
    prefill(m, "a", P(9))
    m.free("a")
    # Not taken before the reset: the earlier BlockStored is void and dropped.
    assert m.reset_prefix_cache() == 2
    assert m.take_kv_events() == [AllBlocksCleared()]
    b = P(5, 200)
    prefill(m, "b", b)
    # Block 3 is fresh; block 2 carried no hash: nothing is evicted.
    assert m.take_kv_events() == [BlockStored((h(b, 0),))]
    m.reset_prefix_cache()
    m.free("b")
    c = P(5, 300)
    prefill(m, "c", c)
    assert m.take_kv_events() == [AllBlocksCleared(), BlockStored((h(c, 0),))]


def test_events_off_by_default_record_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    assert m.block_pool.kv_events.enabled is False
    for i in range(20):          # store, evict, reset: the buffer stays empty
        prefill(m, f"r{i}", P(9, 100 + 10 * i))
        m.free(f"r{i}")
        if i % 5 == 0:
            m.reset_prefix_cache()
    assert len(m.block_pool.kv_events) == 0
    assert m.take_kv_events() == []


def test_caching_disabled_records_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False, enable_kv_events=True)
    prefill(m, "a", P(9))
    m.free("a")
    prefill(m, "b", P(9, 200))
    assert m.take_kv_events() == []


def test_swap_in_re_registers_an_evicted_block():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4, enable_kv_events=True)
    a = P(9)
    prefill(m, "a", a)
    m.take_kv_events()
    assert m.swap_out("a")
    m.take_pending_swaps()
    # Another request takes every device block: a's cached blocks are evicted.
    assert m.allocate_slots("x", 0, 16)
    assert m.take_kv_events() == [BlockRemoved((h(a, 1), h(a, 0)))]
    m.free("x")
    assert m.swap_in("a")
    assert m.take_kv_events() == []       # registered only once the copy is taken
    m.take_pending_swaps()
    assert m.take_kv_events() == [BlockStored((h(a, 0), h(a, 1)))]
    m.check_invariants()


def test_kv_events_import_no_torch():
    code = ("import sys, tandem.engine.kv.kv_events, tandem.engine.kv.block_pool;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
