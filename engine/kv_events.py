"""KV cache events: what entered and left a worker's prefix cache, for the router.

A worker's block pool records one event whenever the set of block hashes its
prefix cache can hit changes (the same scheme as vLLM's KV events, which
Dynamo's KV router consumes):

* :class:`BlockStored`: full blocks were registered under these hashes
  (:meth:`~tandem.engine.block_pool.BlockPool.cache_block`);
* :class:`BlockRemoved`: cached free blocks were evicted, their hashes dropped
  (handed out again by :meth:`~tandem.engine.block_pool.BlockPool.get_new_blocks`);
* :class:`AllBlocksCleared`: every hash was dropped
  (:meth:`~tandem.engine.block_pool.BlockPool.reset_prefix_cache`).

Replaying a worker's events in order from its start gives exactly the set of
hashes in its prefix cache, so the router can tell which worker holds the
longest cached prefix of a prompt without asking. A block hash is chained over
the parent block's hash (:func:`~tandem.engine.block_pool.hash_block_tokens`),
so holding a hash means holding the whole prefix up to that block.

Plain frozen dataclasses, no torch: they travel in
:class:`~tandem.engine.outputs.StepOutput` across Ray (pickled).
"""

from __future__ import annotations

from dataclasses import dataclass

# tandem.engine.block_pool.BlockHash; not imported, because the block pool imports this module.
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
