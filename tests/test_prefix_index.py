"""PrefixIndex: applying KV cache events, dropping workers, matching prompts.

The property tests drive the random KV cache manager machines of
``test_block_properties`` and ``test_swap_properties`` with KV events on, feed
every drained event to a :class:`PrefixIndex` after each rule, and check that the
index holds exactly the manager's cached hashes and that, for many prompts, its
match is exactly the manager's own prefix-cache lookup (``find_cached_prefix``).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import initialize, invariant

from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.router.prefix_index import PrefixIndex, prompt_block_hashes
from tests.test_block_properties import KVCacheMachine, KVCacheMachineNoCaching
from tests.test_swap_properties import SwapMachine


def test_apply_stored_removed_cleared():
    ix = PrefixIndex()
    ix.apply("w0", [BlockStored((1, 2, 3))])
    ix.apply("w1", [BlockStored((1, 2)), BlockStored((9,))])
    assert ix.hashes_of("w0") == {1, 2, 3} and ix.hashes_of("w1") == {1, 2, 9}
    assert len(ix) == 4
    assert ix.match([1, 2, 3, 4]) == {"w0": 3, "w1": 2}
    assert ix.match([1, 5, 3]) == {"w0": 1, "w1": 1}
    assert ix.match([7, 1]) == {"w0": 0, "w1": 0}          # the first block misses
    assert ix.match([1, 2], ["w1", "w7"]) == {"w1": 2, "w7": 0}
    # Removing a hash breaks the chain there; an unknown hash or worker is ignored.
    ix.apply("w0", [BlockRemoved((2, 77))])
    ix.apply("w7", [BlockRemoved((1,))])
    assert ix.match([1, 2, 3]) == {"w0": 1, "w1": 2}
    ix.check_invariants()
    ix.apply("w1", [AllBlocksCleared(), BlockStored((5,))])
    assert ix.hashes_of("w1") == {5}
    assert ix.remove_worker("w0") == 2 and ix.remove_worker("w0") == 0
    assert ix.match([1]) == {"w1": 0} and len(ix) == 1
    ix.check_invariants()
    with pytest.raises(TypeError, match="not a KV cache event"):
        ix.apply("w1", [BlockStored((6,)), "oops"])
    assert ix.hashes_of("w1") == {5, 6}


def test_two_real_workers_match_their_lookups():
    bs = 4
    managers = {w: KVCacheManager(32, bs, enable_kv_events=True) for w in ("w0", "w1")}
    ix = PrefixIndex()
    shared = list(range(100, 108))
    work = {"w0": [shared + [1, 2, 3, 4, 5]], "w1": [shared + [6, 7, 8, 9, 10], list(range(9))]}
    for w, prompts in work.items():
        m = managers[w]
        for i, tokens in enumerate(prompts):
            assert m.allocate_slots(f"r{i}", 0, len(tokens))
            m.cache_blocks(f"r{i}", tokens, len(tokens))
        ix.apply(w, m.take_kv_events())
    for prompt in (shared + [1, 2, 3, 4, 5, 0], shared + [6, 7, 8, 9, 0], shared + [0],
                   list(range(9)), list(range(8)), [5] * 20):
        want = {w: len(m.find_cached_prefix(prompt)) for w, m in managers.items()}
        assert ix.match(prompt_block_hashes(prompt, bs)) == want
    assert ix.match(prompt_block_hashes(shared + [1, 2, 3, 4, 5, 0], bs)) == {"w0": 3, "w1": 2}


class IndexedMixin:
    """Rebuilds the machine's manager with KV events on and checks a PrefixIndex fed from it."""

    @initialize()
    def setup(self):
        super().setup()
        m = self.m
        self.m = KVCacheManager(m.num_blocks, m.block_size, m.enable_caching, m.num_host_blocks,
                                enable_kv_events=True)
        self.index = PrefixIndex()

    def _probe_prompts(self):
        """Every live request's tokens, every cached block's whole prefix plus one
        token (so its last block can hit), and those with one token changed."""
        memory = getattr(self, "memory", None) or self.device
        prefixes = [tuple(t) for t in self.tokens.values()]
        for block in self.m.block_pool.cached_block_hash_to_block.values():
            prefixes.append(memory[block.block_id][-1] + (0,))
        for p in list(prefixes):
            for i in range(0, len(p), 3):
                prefixes.append(p[:i] + ((p[i] + 1) % 3,) + p[i + 1:])
        return prefixes

    @invariant()
    def prefix_index_matches_the_prefix_cache(self):
        self.index.apply("w", self.m.take_kv_events())
        self.index.check_invariants()
        assert self.index.hashes_of("w") == set(self.m.block_pool.cached_block_hash_to_block)
        bs = self.m.block_size
        for prompt in self._probe_prompts():
            got = self.index.match(prompt_block_hashes(prompt, bs), ["w"])["w"]
            assert got == len(self.m.find_cached_prefix(prompt)), prompt


class IndexedKVCacheMachine(IndexedMixin, KVCacheMachine):
    pass


class IndexedKVCacheMachineNoCaching(IndexedMixin, KVCacheMachineNoCaching):
    pass


class IndexedSwapMachine(IndexedMixin, SwapMachine):
    pass


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestIndexedKVCacheMachine = IndexedKVCacheMachine.TestCase
TestIndexedKVCacheMachine.settings = _settings
TestIndexedKVCacheMachineNoCaching = IndexedKVCacheMachineNoCaching.TestCase
TestIndexedKVCacheMachineNoCaching.settings = settings(_settings, max_examples=20)
TestIndexedSwapMachine = IndexedSwapMachine.TestCase
TestIndexedSwapMachine.settings = _settings
