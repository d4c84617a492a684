"""Random steps of fork / append / free / swap-out / swap-in against a model of the memory.

Each ``step`` rule makes one to five calls on the KV cache manager in any order
(new request, next chunk or decode token, swap-out, swap-in, free), then runs
the queued block operations the way the model runner does - all swap-outs,
then all swap-ins, then all copies - and only then writes the step's new KV.
Slot ``p`` of a sequence holds ``tuple(tokens[:p + 1])``, the tokens its KV
depends on. After every rule:

* every device-resident request's first ``num_computed`` slots, read through
  its block table, and every swapped request's, read through its host table,
  hold exactly its own prefixes: no swap, copy or reuse loses or mixes up KV,
  whatever the order of the calls within the step;
* every cached block holds the full block its hash names;
* device and host accounting hold (``check_invariants``, free + in use == total).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.engine.kv.block_pool import hash_block_tokens
from tandem.engine.kv.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 2
NUM_BLOCKS = 10
NUM_HOST_BLOCKS = 8
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)
action_st = st.lists(st.sampled_from(["new", "sched", "swap_out", "swap_in", "free"]),
                     min_size=1, max_size=5)


def chain_hash(prefix: tuple[int, ...]) -> int:
    parent = None
    for i in range(0, len(prefix), BLOCK_SIZE):
        parent = hash_block_tokens(parent, prefix[i:i + BLOCK_SIZE])
    return parent


class SwapMachine(RuleBasedStateMachine):
    enable_caching = True

    @initialize()
    def setup(self):
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_caching, NUM_HOST_BLOCKS)
        self.device = {i: [None] * BLOCK_SIZE for i in range(NUM_BLOCKS)}
        self.host = {i: [None] * BLOCK_SIZE for i in range(NUM_HOST_BLOCKS)}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.next_id = 0

    def _state(self):
        m = self.m
        return ({r: m.get_block_ids(r) for r in m.req_to_blocks},
                {r: list(h) for r, h in m.swap_manager.req_to_host_blocks.items()},
                [(b.ref_cnt, b.block_hash) for b in m.block_pool.blocks],
                [b.block_id for b in m.block_pool.free_block_queue], sorted(m.swap_manager.host_pool._free),
                list(m._pending_copies), list(m.swap_manager.pending_swap_out), list(m.swap_manager.pending_swap_in))

    def _resident(self):
        return sorted(r for r in self.tokens if not self.m.is_swapped(r))

    def _swapped(self):
        return sorted(r for r in self.tokens if self.m.is_swapped(r))

    @rule(actions=action_st, data=st.data())
    def step(self, actions, data):
        writes: dict[str, tuple[int, int]] = {}      # rid -> [start, end) written this step
        for action in actions:
            if action == "new":
                self._new(data, writes)
            elif action == "sched":
                rids = [r for r in self._resident() if r not in writes]
                if rids:
                    self._sched(data.draw(st.sampled_from(rids)), data, writes)
            elif action == "swap_out":
                if self._resident():
                    self._swap_out(data.draw(st.sampled_from(self._resident())), writes)
            elif action == "swap_in":
                if self._swapped():
                    rid = data.draw(st.sampled_from(self._swapped()))
                    event("swap-in" if self.m.swap_in(rid) else "swap-in refused")
            elif action == "free" and self.tokens:
                rid = data.draw(st.sampled_from(sorted(self.tokens)))
                assert self.m.free(rid) is True and self.m.free(rid) is False
                del self.tokens[rid], self.num_computed[rid]
                writes.pop(rid, None)
        self._execute(writes)

    def _new(self, data, writes):
        prompt = data.draw(tokens_st)
        self.next_id += 1
        rid = f"r{self.next_id}"
        hits, num_hit = self.m.get_computed_blocks(rid, prompt)
        chunk = data.draw(st.integers(1, len(prompt) - num_hit))
        if self.m.allocate_slots(rid, num_hit, chunk, hits):
            self.tokens[rid], self.num_computed[rid] = list(prompt), num_hit
            writes[rid] = (num_hit, num_hit + chunk)
        else:
            assert self.m.get_block_ids(rid) == []

    def _sched(self, rid, data, writes):
        toks = self.tokens[rid]
        if len(toks) == self.num_computed[rid]:
            toks.append(data.draw(st.integers(0, 2)))
        start = self.num_computed[rid]
        num_new = data.draw(st.integers(1, len(toks) - start))
        before = self._state()
        if self.m.allocate_slots(rid, start, num_new):
            writes[rid] = (start, start + num_new)
        else:
            assert self._state() == before

    def _swap_out(self, rid, writes):
        before = self._state()
        try:
            ok = self.m.swap_out(rid)
        except ValueError:
            event("swap-out refused: blocks written this step")
            assert self._state() == before
            return
        event("swap-out" if ok else "swap-out refused: host full")
        if ok:
            writes.pop(rid, None)      # no longer running: its new tokens are not computed
        else:
            assert self._state() == before

    def _execute(self, writes):
        copies = self.m.take_pending_copies()
        swap_out, swap_in = self.m.take_pending_swaps()
        for d, h in swap_out:
            self.host[h] = list(self.device[d])
        for h, d in swap_in:
            self.device[d] = list(self.host[h])
        for s, d in copies:
            event("copy-on-write copy")
            self.device[d] = list(self.device[s])
        for rid, (start, end) in writes.items():
            table, toks = self.m.get_block_ids(rid), self.tokens[rid]
            for p in range(start, end):
                self.device[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] = tuple(toks[:p + 1])
            self.num_computed[rid] = end
            self.m.cache_blocks(rid, self.tokens[rid], end)

    @precondition(lambda self: self._resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._resident()))
        self.next_id += 1
        child = f"r{self.next_id}"
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.num_computed[child] = self.num_computed[parent]

    @invariant()
    def accounting(self):
        self.m.check_invariants()
        assert set(self.m.req_to_blocks) | set(self.m.swap_manager.req_to_host_blocks) == set(self.tokens)
        assert self.m._pending_copies == self.m.swap_manager.pending_swap_out == self.m.swap_manager.pending_swap_in == []
        for rid, n in self.num_computed.items():
            table = self.m.get_block_ids(rid) or self.m.get_host_block_ids(rid)
            assert len(table) >= -(-n // BLOCK_SIZE), (rid, table, n)
        host_used = sum(len(h) for h in self.m.swap_manager.req_to_host_blocks.values())
        assert self.m.num_free_host_blocks + host_used == NUM_HOST_BLOCKS

    @invariant()
    def every_request_sees_its_own_kv(self):
        for rid, n in self.num_computed.items():
            swapped = self.m.is_swapped(rid)
            table = self.m.get_host_block_ids(rid) if swapped else self.m.get_block_ids(rid)
            memory = self.host if swapped else self.device
            for pos in range(n):
                slot = memory[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert slot == tuple(self.tokens[rid][:pos + 1]), (rid, swapped, pos, slot)

    @invariant()
    def every_cached_block_holds_what_its_hash_says(self):
        for block_hash, block in self.m.block_pool.cached_block_hash_to_block.items():
            slots = self.device[block.block_id]
            assert None not in slots and chain_hash(slots[-1]) == block_hash, (block, slots)


class SwapMachineNoCaching(SwapMachine):
    enable_caching = False


_settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = _settings
TestSwapMachineNoCaching = SwapMachineNoCaching.TestCase
TestSwapMachineNoCaching.settings = _settings
