"""Random allocate / append / fork / free / cache sequences against a model of the KV cache.

The model is what the memory would hold: the KV written at position ``p`` of a
sequence depends on all of ``tokens[:p + 1]``, so each simulated slot stores
that tuple. After every step:

* every request's first ``num_computed`` slots (through its block table) hold
  exactly its own prefixes: prefix hits, copy-on-write copies and writes never
  hand a request someone else's or stale KV;
* every cached block holds a full block whose chained hash is its block hash;
* ``free == total - distinct blocks in block tables``, and each block table
  is exactly ``ceil(num_computed / block_size)`` blocks;
* ``check_invariants()`` passes.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.engine.kv.block_pool import hash_block_tokens
from tandem.engine.kv.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# A tiny vocabulary and short prompts make shared prefixes (hits) frequent.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)
GARBAGE = ("garbage",)


def chain_hash(prefix: tuple[int, ...]) -> int:
    parent = None
    for i in range(0, len(prefix), BLOCK_SIZE):
        parent = hash_block_tokens(parent, prefix[i:i + BLOCK_SIZE])
    return parent


class KVCacheMachine(RuleBasedStateMachine):
    enable_caching = True

    @initialize()
    def setup(self):
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_caching)
        # block id -> per-slot content: tuple(tokens[:pos + 1]) or None (unwritten)
        self.memory = {i: [None] * BLOCK_SIZE for i in range(NUM_BLOCKS)}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot(self):
        pool = self.m.block_pool
        return ({r: self.m.get_block_ids(r) for r in self.m.req_to_blocks},
                [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in pool.free_block_queue], list(self.m._pending_copies))

    def _forget_fresh_blocks(self, rid: str, old_table: list[int], hits) -> None:
        # A fresh block's previous content must never be read or cached.
        kept = set(old_table) | {b.block_id for b in hits}
        for block_id in self.m.get_block_ids(rid):
            if block_id not in kept:
                self.memory[block_id] = [None] * BLOCK_SIZE

    def _run_copies(self):
        for src, dst in self.m.take_pending_copies():
            event("copy-on-write copy")
            self.memory[dst] = list(self.memory[src])

    def _write(self, rid: str, start: int, end: int, garbage: bool = False):
        table = self.m.get_block_ids(rid)
        toks = self.tokens[rid]
        for pos in range(start, end):
            slot = GARBAGE if garbage else tuple(toks[:pos + 1])
            self.memory[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = slot

    def _schedule(self, rid: str, num_new: int, hits=()) -> bool:
        """allocate_slots + forward + cache_blocks, or check that a failure changed nothing."""
        before = self._snapshot()
        start = self.num_computed[rid]
        if hits:
            event("prefix hit")
        if not self.m.allocate_slots(rid, start, num_new, hits):
            event("allocation failed")
            assert self._snapshot() == before
            return False
        self._forget_fresh_blocks(rid, before[0].get(rid, []), hits)
        self._run_copies()
        self._write(rid, start, start + num_new)
        self.num_computed[rid] = start + num_new
        self.m.cache_blocks(rid, self.tokens[rid], start + num_new)
        return True

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(prompt=tokens_st, data=st.data())
    def add_request(self, prompt, data):
        rid = self._new_id()
        hits, num_hit = self.m.get_computed_blocks(rid, prompt)
        assert num_hit == len(hits) * BLOCK_SIZE < len(prompt)
        self.tokens[rid], self.num_computed[rid] = list(prompt), num_hit
        # Chunked prefill: the first chunk may be shorter than the rest of the prompt.
        chunk = data.draw(st.integers(1, len(prompt) - num_hit))
        if not self._schedule(rid, chunk, hits):
            assert self.m.get_block_ids(rid) == []
            del self.tokens[rid], self.num_computed[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), suffix=tokens_st)
    def add_request_sharing_a_prefix(self, data, suffix):
        other = self.tokens[self._pick(data)]
        self.add_request(other[:data.draw(st.integers(0, len(other)))] + suffix, data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def step(self, data, token):
        """Next prefill chunk, or one decode token."""
        rid = self._pick(data)
        remaining = len(self.tokens[rid]) - self.num_computed[rid]
        if remaining == 0:
            self.tokens[rid].append(token)
            remaining = 1
        self._schedule(rid, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        child = self._new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.num_computed[child] = self.num_computed[parent]
        self._forked(parent, child)

    def _forked(self, parent: str, child: str) -> None:
        """What a subclass tracks per request, copied to a fork."""

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = self._pick(data)
        assert self.m.free(rid) is True
        assert self.m.free(rid) is False
        del self.tokens[rid], self.num_computed[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def cancel_mid_step(self, data, token):
        """Allocate, write part of the step, then free without cache_blocks."""
        rid = self._pick(data)
        self.tokens[rid].append(token)
        start = self.num_computed[rid]
        num_new = len(self.tokens[rid]) - start
        old_table = self.m.get_block_ids(rid)
        if self.m.allocate_slots(rid, start, num_new):
            self._forget_fresh_blocks(rid, old_table, ())
            self._run_copies()
            self._write(rid, start, start + data.draw(st.integers(0, num_new)), garbage=True)
        assert self.m.free(rid)
        del self.tokens[rid], self.num_computed[rid]

    @rule()
    def reset_prefix_cache(self):
        self.m.reset_prefix_cache()
        assert self.m.block_pool.num_cached_blocks == 0

    @invariant()
    def accounting(self):
        self.m.check_invariants()
        pool = self.m.block_pool
        assert set(self.m.req_to_blocks) == set(self.tokens)
        in_tables = set()
        for rid, n in self.num_computed.items():
            table = self.m.get_block_ids(rid)
            assert len(table) == -(-n // BLOCK_SIZE), (rid, table, n)
            in_tables.update(table)
        assert pool.num_free_blocks == NUM_BLOCKS - len(in_tables)
        assert self.m.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        if not self.enable_caching:
            assert pool.num_cached_blocks == 0

    @invariant()
    def every_request_sees_its_own_kv(self):
        for rid, n in self.num_computed.items():
            table = self.m.get_block_ids(rid)
            toks = self.tokens[rid]
            for pos in range(n):
                slot = self.memory[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert slot == tuple(toks[:pos + 1]), (rid, pos, slot)

    @invariant()
    def every_cached_block_holds_what_its_hash_says(self):
        for block_hash, block in self.m.block_pool.cached_block_hash_to_block.items():
            slots = self.memory[block.block_id]
            assert None not in slots and GARBAGE not in slots, (block, slots)
            assert chain_hash(slots[-1]) == block_hash, block


class KVCacheMachineNoCaching(KVCacheMachine):
    enable_caching = False


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = _settings
TestKVCacheMachineNoCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheMachineNoCaching.settings = _settings
