"""KV cache events: what entered and left a worker's prefix cache, for the router.

A worker's block pool records one event whenever the set of block hashes its
prefix cache can hit changes (the same scheme as vLLM's KV events, which
Dynamo's KV router consumes):

* :class:`BlockStored`: full blocks were registered under these hashes
  (:meth:`~tandem.engine.kv.block_pool.BlockPool.cache_block`);
* :class:`BlockRemoved`: cached free blocks were evicted, their hashes dropped
  (handed out again by :meth:`~tandem.engine.kv.block_pool.BlockPool.get_new_blocks`);
* :class:`AllBlocksCleared`: every hash was dropped
  (:meth:`~tandem.engine.kv.block_pool.BlockPool.reset_prefix_cache`).

Replaying a worker's events in order from its start gives exactly the set of
hashes in its prefix cache, so the router can tell which worker holds the
longest cached prefix of a prompt without asking. A block hash is chained over
the parent block's hash (:func:`~tandem.engine.kv.block_pool.hash_block_tokens`),
so holding a hash means holding the whole prefix up to that block.

Plain frozen dataclasses, no torch: they travel in
:class:`~tandem.engine.runtime.outputs.StepOutput` across Ray (pickled). The block pool
buffers them in a :class:`KVEventRecorder` until the engine loop takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

# tandem.engine.kv.block_pool.BlockHash; not imported, because the block pool imports this module.
BlockHash = int



@dataclass(frozen=True)
class BlockStored:
    """Blocks entered the prefix cache.

    Attributes:
        block_hashes: their chained block hashes (128-bit unsigned ints), in the
            order they were registered.
    """

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted: these hashes no longer hit.

    Attributes:
        block_hashes: the dropped chained block hashes, in eviction order.
    """

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash recorded before this event hits any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """The events a block pool recorded and nobody has taken yet.

    Consecutive events of one kind are merged (a prefill that caches n blocks
    records one :class:`BlockStored` of n hashes), and a clear voids everything
    recorded before it, so the buffer stays small between two :meth:`take` calls.

    Args:
        enabled: record at all; when ``False`` every method but :meth:`take` is a
            no-op, so an engine whose events nobody drains stays bounded.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[tuple[type, list[BlockHash]]] = []    # (kind, hashes)

    def __len__(self) -> int:
        """Events buffered (after merging)."""
        return len(self._events)

    def stored(self, block_hash: BlockHash) -> None:
        self._record(BlockStored, block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        self._record(BlockRemoved, block_hash)

    def cleared(self) -> None:
        if self.enabled:
            self._events = [(AllBlocksCleared, [])]

    def take(self) -> list[KVEvent]:
        """The buffered events, oldest first; empties the buffer."""
        events, self._events = self._events, []
        return [AllBlocksCleared() if kind is AllBlocksCleared else kind(tuple(hashes))
                for kind, hashes in events]

    def _record(self, kind: type, block_hash: BlockHash) -> None:
        if not self.enabled:
            return
        if self._events and self._events[-1][0] is kind:
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash]))
