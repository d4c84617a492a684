"""Sliding-window KV in the KV cache manager: blocks that every layer's window has
passed are released and replaced by the null block, with exact block ids.

Block size 4, window 6 throughout: a query at position ``p`` reads keys
``p - 5 .. p``, so a step whose first query is at ``c`` needs the blocks from
``(c - 5) // 4`` on.
"""

from __future__ import annotations

import pytest

from tandem.engine.kv.block_pool import BlockPool
from tandem.engine.kv.kv_cache_manager import KVCacheManager, kv_sliding_window
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket

BS, WINDOW = 4, 6


def P(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def manager(num_blocks: int = 10, num_host_blocks: int = 0) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=True, num_host_blocks=num_host_blocks,
                          sliding_window=WINDOW)


def step(m: KVCacheManager, rid: str, tokens: list[int], num_computed: int, num_new: int) -> None:
    """Allocate, 'compute' and cache one step of ``rid``."""
    assert m.allocate_slots(rid, num_computed, num_new)
    m.cache_blocks(rid, tokens, num_computed + num_new)
    m.check_invariants()


def test_the_window_of_every_layer_decides():
    assert kv_sliding_window([16, 16]) == 16
    assert kv_sliding_window([8, 16]) == 16
    assert kv_sliding_window([16, None]) is None        # Gemma 2/3: a global layer
    assert kv_sliding_window(()) is None                  # no layer has a window


def test_null_block_is_reserved_and_outside_every_count():
    m = manager()
    pool = m.block_pool
    assert pool.null_block is pool.blocks[0] and m.null_block is pool.null_block
    assert (m.num_blocks, m.num_usable_blocks, m.num_free_blocks) == (10, 9, 9)
    assert m.usage == 0.0
    assert [b.block_id for b in pool.get_new_blocks(9)] == list(range(1, 10))
    assert m.usage == 1.0
    with pytest.raises(ValueError, match="only written, in-use blocks"):
        pool.cache_block(pool.null_block, 1)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, reserve_null_block=True)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(4, BS, sliding_window=0)
    assert KVCacheManager(4, BS).block_pool.null_block is None


def test_blocks_before_the_window_are_released_at_the_exact_boundary():
    m = manager()
    tokens = P(20)
    step(m, "a", tokens, 0, 13)                    # prefill: first query at 0
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    # Decode at 13 reads 8..13: blocks 0 and 1 (tokens 0..7) are released.
    step(m, "a", tokens, 13, 1)
    assert m.get_block_ids("a") == [0, 0, 3, 4]
    assert (m.num_held_blocks("a"), m.num_skipped_blocks("a"), m.num_blocks_of("a")) == (2, 2, 4)
    # Released tail first, after the never-used blocks; still findable by hash.
    assert [b.block_id for b in m.block_pool.free_block_queue] == [5, 6, 7, 8, 9, 2, 1]
    assert m.block_pool.blocks[1].block_hash == m.req_to_block_hashes["a"][0]
    # Decode at 16 reads 11..16: block 2 (8..11) stays; a new block for 16.
    step(m, "a", tokens, 14, 1)
    step(m, "a", tokens, 15, 1)
    step(m, "a", tokens, 16, 1)
    assert m.get_block_ids("a") == [0, 0, 3, 4, 5]
    # Decode at 17 reads 12..17: block 2 goes.
    step(m, "a", tokens, 17, 1)
    assert m.get_block_ids("a") == [0, 0, 0, 4, 5]
    assert m.num_held_blocks("a") == 2 <= m.max_blocks_per_step(1) == 3
    assert m.free("a") and m.num_free_blocks == m.num_usable_blocks == 9
    m.check_invariants()


def test_chunked_prefill_keeps_the_window_before_its_chunk():
    m = manager()
    tokens = P(24)
    step(m, "a", tokens, 0, 8)
    step(m, "a", tokens, 8, 8)          # chunk at 8 reads from 3: nothing released
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    step(m, "a", tokens, 16, 8)         # chunk at 16 reads from 11: blocks 0, 1 go
    assert m.get_block_ids("a") == [0, 0, 3, 4, 5, 6]
    assert m.num_held_blocks("a") == 4 and m.max_blocks_per_step(8) == 5   # the bound


def test_a_shared_prefix_block_stays_with_its_other_holder():
    m = manager()
    tokens = P(20)
    step(m, "a", tokens, 0, 13)
    hits, n = m.get_computed_blocks("b", tokens[:13])
    assert [b.block_id for b in hits] == [1, 2, 3] and n == 12
    # b's first query is at 12 (reads 7..12): hit 0 is not taken, hits 1 and 2 are.
    assert m.allocate_slots("b", n, 1, hits)
    assert m.get_block_ids("b") == [0, 2, 3, 5]
    m.check_invariants()
    step(m, "a", tokens, 13, 1)         # a releases blocks 1 and 2; b still holds 2
    assert m.block_pool.blocks[2].ref_cnt == 1 and m.block_pool.blocks[1].ref_cnt == 0
    assert m.num_free_blocks == 9 - 4
    m.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing_and_counts_released_blocks():
    m = manager(num_blocks=6)                          # 5 usable
    tokens = P(20)
    step(m, "a", tokens, 0, 16)
    assert m.num_free_blocks == 1
    step(m, "other", P(4, 500), 0, 4)
    assert m.num_free_blocks == 0
    # Decode at 16 needs a fifth block; it releases blocks 0 and 1 first.
    assert m.num_new_blocks_needed("a", 16, 1) == 0
    step(m, "a", tokens, 16, 1)
    assert m.get_block_ids("a") == [0, 0, 3, 4, 2]
    # 17..28 needs 3 more blocks: one free, one released (tokens 8..11): too few.
    before = m.get_block_ids("a")
    assert m.num_new_blocks_needed("a", 17, 12) == 2 and m.num_free_blocks == 1
    assert not m.allocate_slots("a", 17, 12)
    assert m.get_block_ids("a") == before and m.num_skipped_blocks("a") == 2
    m.check_invariants()
    assert m.allocate_slots("a", 17, 8)               # 17..24: 2 more, 1 free + 1 released
    assert m.get_block_ids("a") == [0, 0, 0, 4, 2, 1, 3]   # the released block last
    m.check_invariants()
    assert m.allocate_slots("a", 17, 8)               # 17..24: 2 more, 1 free + 1 released
    assert m.get_block_ids("a") == [0, 0, 0, 4, 2, 1, 3]   # the released block last
    m.check_invariants()


def test_swap_moves_only_the_held_blocks():
    m = manager(num_host_blocks=8)
    tokens = P(20)
    step(m, "a", tokens, 0, 13)
    step(m, "a", tokens, 13, 1)
    assert m.can_swap_out("a") and m.swap_out("a")
    assert m.get_host_block_ids("a") == [0, 1]
    out, _ = m.take_pending_swaps()
    assert out == [(3, 0), (4, 1)]
    # Block 3 (tokens 8..11) is found by hash, the open block 4 is copied back.
    assert m.num_blocks_to_swap_in("a") == 2
    assert m.swap_in("a")
    ids = m.get_block_ids("a")
    assert ids[:3] == [0, 0, 3] and m.num_skipped_blocks("a") == 2
    assert m.take_pending_swaps() == ([], [(1, ids[3])])
    m.check_invariants()


def test_swap_in_then_release_drops_the_swap_in_of_a_released_block():
    """A request swapped out with its table at decode 13 resumes at 17: the block
    swapped back for tokens 8..11 falls out of the window in the same step."""
    m = manager(num_host_blocks=8)
    tokens = P(20)
    step(m, "a", tokens, 0, 13)
    step(m, "a", tokens, 13, 1)
    for c in (14, 15, 16):
        step(m, "a", tokens, c, 1)
    m.swap_out("a")
    m.take_pending_swaps()
    m.reset_prefix_cache()                            # nothing reused: every block copied
    assert m.swap_in("a")
    assert m.allocate_slots("a", 17, 1)
    ids = m.get_block_ids("a")
    assert ids[:3] == [0, 0, 0] and m.num_held_blocks("a") == 2
    _, swap_in = m.take_pending_swaps()
    assert [d for _, d in swap_in] == ids[3:]         # the released block's copy is dropped
    m.check_invariants()


def test_remote_reservation_holds_only_what_the_first_decode_reads():
    m = manager()
    # 13 prompt tokens arrive from another engine; the first decode is at 13.
    assert m.allocate_slots("r", 0, 13, first_query_position=13)
    assert m.get_block_ids("r") == [0, 0, 1, 2] and m.num_skipped_blocks("r") == 2
    layout = KVLayout(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=8,
                      dtype="float32")
    ticket = KVTransferTicket("r", 0, tuple(m.get_block_ids("r")),
                              m.num_skipped_blocks("r") * BS, 13, layout)
    assert ticket.sent_dst_block_ids == (1, 2) and ticket.num_sent_blocks == 2
    m.cache_blocks("r", P(14), 14)                    # after the first decode
    assert m.block_pool.blocks[1].block_hash == m.req_to_block_hashes["r"][2]
    with pytest.raises(ValueError, match="first_query_position"):
        m.allocate_slots("s", 0, 4, first_query_position=5)
    m.check_invariants()


def test_fork_shares_the_window():
    m = manager()
    tokens = P(20)
    step(m, "a", tokens, 0, 13)
    step(m, "a", tokens, 13, 1)
    m.fork("a", "b")
    assert m.get_block_ids("b") == [0, 0, 3, 4] and m.num_skipped_blocks("b") == 2
    m.check_invariants()
    assert m.free("a") and m.free("b") and m.num_free_blocks == 9
    m.check_invariants()
