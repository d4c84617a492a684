"""Prefix caching: finding a prompt's cached full blocks, registering new ones.

Plain Python, no torch. A full block is identified by a chained hash of its
tokens and its parent block's hash (vLLM's automatic prefix caching; the same
idea as the radix tree of SGLang's RadixAttention, Zheng et al. 2024, section 3),
so equal hashes mean equal whole prefixes. Lookup walks a prompt's blocks until
the first miss; registration happens only after the forward pass that wrote a
block's last token (:meth:`PrefixCache.cache_full_blocks`). Evicting cached
blocks that no request holds (LRU) is the :class:`~tandem.engine.kv.block_pool.BlockPool`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.kv.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


class PrefixCache:
    """Lookup and registration of full blocks by chained hash, over one block pool.

    A component of :class:`~tandem.engine.kv.kv_cache_manager.KVCacheManager`,
    with a narrow view of the state it works on:

    * of the :class:`BlockPool`, only the hash index: ``get_cached_block``,
      ``cache_block`` and ``reset_prefix_cache``. It never allocates, frees or
      takes references; the manager does that with the blocks it returns.
    * of the block tables, only the one table and hash chain the manager passes
      to :meth:`cache_full_blocks` (it extends that chain in place).

    Args:
        block_pool: the device block pool whose hash index to use.
        block_size: tokens per block (> 0).
        enable_caching: when ``False``, every lookup misses and nothing is registered.

    Attributes:
        num_queried_tokens: tokens looked up by :meth:`lookup` (every call counts,
            also repeated calls for a request that waits).
        num_hit_tokens: of those, tokens found cached.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def lookup(self, token_ids: Sequence[int]) -> tuple[list[Block], int]:
        """Longest prefix of ``token_ids`` whose full blocks are cached, counted
        as a query.

        The hit is capped so that at least one token is left to compute: the
        last prompt token always runs through the model, so its logits exist
        (a prompt of exactly k full blocks hits at most k - 1 of them). No
        references are taken.

        Returns:
            ``(blocks, num_computed_tokens)`` with
            ``num_computed_tokens == len(blocks) * block_size`` (tokens);
            ``([], 0)`` when prefix caching is disabled (not counted).
        """
        if not self.enable_caching:
            return [], 0
        blocks = self.find_cached_prefix(token_ids)
        num_computed_tokens = len(blocks) * self.block_size
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += num_computed_tokens
        return blocks, num_computed_tokens

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[Block]:
        """The blocks :meth:`lookup` would return, without counting a query.

        For planning (the scheduler sizing a request it may not admit).
        """
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_hit_blocks = max(len(token_ids) - 1, 0) // bs
        blocks: list[Block] = []
        parent: BlockHash | None = None
        for i in range(max_hit_blocks):
            block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
            parent = block_hash
        return blocks

    def find_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[int, Block]:
        """Index ``i`` -> the cached block registered under ``block_hashes[i]``,
        for the indices that hit (in use or free). Used to swap a request's
        table back in without copying blocks still on the device."""
        hits: dict[int, Block] = {}
        for i, block_hash in enumerate(block_hashes):
            block = self.block_pool.get_cached_block(block_hash)
            if block is not None:
                hits[i] = block
        return hits

    def cache_full_blocks(self, table: Sequence[Block], block_hashes: list[BlockHash],
                          token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register a request's full, computed blocks.

        Blocks ``i`` with ``len(block_hashes) <= i < num_computed_tokens // block_size``
        are hashed (chained on ``block_hashes[-1]``), registered, and their
        hashes appended to ``block_hashes`` (the request's hash chain, so each
        call costs O(new blocks)). Call after the forward pass that computed
        them. A no-op when prefix caching is disabled. A slot holding the pool's
        null block (released from a sliding window) is hashed, so the chain goes
        on, but registers nothing.

        Args:
            table: the request's block table.
            block_hashes: the request's hash chain so far; extended in place.
            token_ids: its tokens, at least ``num_computed_tokens`` of them.
            num_computed_tokens: tokens whose KV is now written.

        Raises:
            ValueError: fewer than ``num_computed_tokens`` token ids, or more
                computed tokens than ``table`` holds; or a block already cached
                under a hash these tokens do not produce.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(table) * bs:
            raise ValueError(
                f"{num_computed_tokens} computed tokens, but {len(token_ids)} token ids "
                f"and {len(table)} blocks of {bs} tokens")
        parent = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), num_computed_tokens // bs):
            block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            # False is fine: another block already holds this hash, or this
            # block (shared through a fork) was cached by its other holder.
            if table[i] is not self.block_pool.null_block:
                self.block_pool.cache_block(table[i], block_hash)
            block_hashes.append(block_hash)
            parent = block_hash

    def reset(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()
