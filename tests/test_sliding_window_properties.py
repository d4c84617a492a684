"""The random allocate / append / fork / free / cache sequences of
tests/test_block_properties.py on a KV cache manager with a sliding window of 3
tokens (block size 2): blocks before the window are released to the null block,
and what is still read stays each request's own KV.

Per request the expected null slots are ``(s - 3 + 1) // 2`` for the latest step's
first written position ``s`` (its ``num_computed_tokens``, or the prefix hit), at
least 0. After every step:

* its block table has ``ceil(num_computed / 2)`` slots, the first of them null;
* the positions its next query can read (``num_computed - 2`` on) hold its own
  prefixes, and every cached block holds what its hash says;
* the null block is never written, and ``free == usable - distinct held blocks``.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis.stateful import initialize, invariant

from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tests.test_block_properties import BLOCK_SIZE, NUM_BLOCKS, KVCacheMachine, _settings, st

WINDOW = 3


def _skipped(first_query_position: int) -> int:
    return max(0, first_query_position - WINDOW + 1) // BLOCK_SIZE


class WindowedKVCacheMachine(KVCacheMachine):
    enable_caching = True

    @initialize()
    def setup(self):
        super().setup()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_caching,
                                sliding_window=WINDOW)
        self.skipped: dict[str, int] = {}

    def _schedule(self, rid: str, num_new: int, hits=()) -> bool:
        start = self.num_computed[rid]
        ok = super()._schedule(rid, num_new, hits)
        if ok and _skipped(start) > self.skipped.get(rid, 0):
            event("blocks released")
            self.skipped[rid] = _skipped(start)
        return ok

    def _forked(self, parent: str, child: str) -> None:
        self.skipped[child] = self.skipped.get(parent, 0)

    @invariant()
    def accounting(self):
        self.m.check_invariants()
        pool = self.m.block_pool
        assert set(self.m.req_to_blocks) == set(self.tokens)
        held = set()
        for rid, n in self.num_computed.items():
            table = self.m.get_block_ids(rid)
            skipped = self.skipped.get(rid, 0)
            assert len(table) == -(-n // BLOCK_SIZE), (rid, table, n)
            assert self.m.num_skipped_blocks(rid) == skipped, (rid, table, n)
            assert table[:skipped] == [0] * skipped and 0 not in table[skipped:], (rid, table)
            held.update(table[skipped:])
        assert pool.num_free_blocks == NUM_BLOCKS - 1 - len(held)
        assert self.memory[0] == [None] * BLOCK_SIZE, "the null block was written"

    @invariant()
    def every_request_sees_its_own_kv(self):
        for rid, n in self.num_computed.items():
            table = self.m.get_block_ids(rid)
            toks = self.tokens[rid]
            for pos in range(self.skipped.get(rid, 0) * BLOCK_SIZE, n):
                slot = self.memory[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert slot == tuple(toks[:pos + 1]), (rid, pos, slot)


TestWindowedKVCacheMachine = WindowedKVCacheMachine.TestCase
TestWindowedKVCacheMachine.settings = _settings
