"""Block pool: block hashes, the free block queue, ref counts, prefix cache, LRU eviction."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from tandem.engine.kv.block_pool import (
    Block,
    BlockPool,
    FreeBlockQueue,
    NoFreeBlocksError,
    hash_block_tokens,
)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue)


# -- block hash ----------------------------------------------------------------


def test_hash_follows_documented_encoding():
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    expected = hashlib.blake2b(
        b"\x00" + b"\x00" + struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    assert parent == int.from_bytes(expected, "little")
    child = hash_block_tokens(parent, [5, 6, 7, 8], extra=-3)
    expected = hashlib.blake2b(
        b"\x01" + parent.to_bytes(16, "little")
        + b"\x01" + (-3).to_bytes(16, "little", signed=True)
        + struct.pack("<4q", 5, 6, 7, 8), digest_size=16).digest()
    assert child == int.from_bytes(expected, "little")


def test_hash_is_pinned_and_same_in_another_process():
    # A changed encoding would silently stop cross-worker prefix matching.
    assert hash_block_tokens(None, [1, 2, 3, 4]) == 0xf37a167bb9fda987f09561bd758576a1
    code = ("from tandem.engine.kv.block_pool import hash_block_tokens as h;"
            "a = h(None, [1, 2, 3, 4]); print(h(a, [5, 6, 7, 8]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    assert int(out.stdout) == hash_block_tokens(parent, [5, 6, 7, 8])
    assert int(out.stdout) == 0x44af7deab09c81180701b8e0dfef339e


def test_hash_depends_on_parent_tokens_order_and_extra():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(0, [1, 2, 3, 4]) != base  # no parent != parent 0
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [2, 1, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], extra=0) != base
    assert hash_block_tokens(None, (1, 2, 3, 4)) == base  # any int sequence
    assert 0 <= base < 2**128


def test_hash_rejects_out_of_range_ids():
    with pytest.raises(OverflowError, match="int64"):
        hash_block_tokens(None, [2**63])
    with pytest.raises(OverflowError):
        hash_block_tokens(2**128, [1])


# -- free block queue ----------------------------------------------------------


def test_free_block_queue_popleft_append_remove():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert ids(q) == [1, 3] and len(q) == 2
    q.append(blocks[0])
    assert ids(q) == [1, 3, 0]
    assert q.popleft() is blocks[1]
    assert ids(q) == [3, 0]
    assert blocks[1] not in q and blocks[3] in q and blocks[0] in q
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_free_block_queue_errors():
    a, b = Block(0), Block(1)
    q = FreeBlockQueue([a])
    with pytest.raises(ValueError, match="already"):
        q.append(a)
    with pytest.raises(ValueError, match="not in"):
        q.remove(b)
    assert q.popleft() is a
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0 and list(q) == []


# -- allocation and free -------------------------------------------------------


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (7, 3, 0)
    assert pool.usage == pytest.approx(0.3)
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.get_new_blocks(0) == []
    pool.check_invariants()


def test_free_appends_to_tail_in_given_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 2, 1, 0]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    # Next allocation takes the least recently freed first.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
    pool.check_invariants()


def test_shared_block_is_freed_only_at_ref_count_zero():
    pool = BlockPool(4)
    [b] = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3 and b not in pool.free_block_queue
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 4 and queue_ids(pool) == [1, 2, 3, 0]
    pool.check_invariants()


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1 and queue_ids(pool) == [3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a])
    pool.check_invariants()


# -- prefix cache --------------------------------------------------------------


def test_cached_block_survives_free_and_is_hit_from_the_middle_of_the_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [7, 7, 7, 7])
    assert pool.cache_block(blocks[1], h)
    assert blocks[1].block_hash == h and pool.num_cached_blocks == 1
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.num_cached_blocks == 1 and pool.num_free_cached_blocks == 1
    hit = pool.get_cached_block(h)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [3, 4, 5, 2, 0]
    assert pool.num_free_cached_blocks == 0 and pool.num_cached_blocks == 1
    assert pool.get_cached_block(h + 1) is None
    pool.check_invariants()


def test_lru_eviction_order_of_cached_free_blocks():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i] * 4) for i in range(3)]
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks(reversed(blocks))  # tail block 2 is least recently freed
    assert queue_ids(pool) == [3, 4, 2, 1, 0]
    # Uncached free blocks 3 and 4 go first, then cached block 2 is evicted.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
    assert blocks[2].block_hash is None and pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.num_cached_blocks == 2 and pool.num_free_cached_blocks == 2
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(hashes[1]) is None and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_touching_a_hit_moves_it_out_of_eviction_order():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks(blocks)
    assert queue_ids(pool) == [0, 1, 2]
    pool.touch([blocks[0]])
    pool.free_blocks([blocks[0]])  # re-freed: now most recently used
    assert queue_ids(pool) == [1, 2, 0]
    assert ids(pool.get_new_blocks(1)) == [1]
    pool.check_invariants()


def test_cache_block_rules():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h) is True
    assert pool.cache_block(a, h) is False  # already registered
    assert pool.cache_block(b, h) is False  # another block holds h: b stays uncached
    assert b.block_hash is None and pool.get_cached_block(h) is a
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, h + 1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="free"):
        pool.cache_block(b, h + 1)
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


def test_touching_a_free_uncached_block_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="stale"):
        pool.touch([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0 and queue_ids(pool) == [2, 1]
    pool.check_invariants()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    [a] = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    assert pool.cache_block(a, h) is False
    assert pool.get_cached_block(h) is None and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_reset_prefix_cache_drops_every_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 11)
    pool.cache_block(b, 22)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() == 2
    assert (a.block_hash, b.block_hash, pool.num_cached_blocks) == (None, None, 0)
    assert pool.get_cached_block(11) is None and pool.get_cached_block(22) is None
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.check_invariants()


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError):
        BlockPool(0)


# -- the invariant check can fail ----------------------------------------------


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: setattr(p.blocks[0], "ref_cnt", 1), "in the free block queue but in use"),
    (lambda p: p.free_block_queue.remove(p.blocks[1]), "ref_cnt 0 but is not free"),
    (lambda p: setattr(p.blocks[2], "block_hash", 5), "carries a hash"),
    (lambda p: p.cached_block_hash_to_block.__setitem__(9, p.blocks[3]), "carries another"),
    (lambda p: setattr(p.blocks[3], "ref_cnt", -1), "negative ref count"),
])
def test_check_invariants_detects_corruption(corrupt, message):
    pool = BlockPool(4)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()
