"""Prefix caching: finding a prompt's cached full blocks, registering new ones.

Plain Python, no torch. A full block is identified by a chained hash of its
tokens and its parent block's hash (vLLM's automatic prefix caching; the same
idea as the radix tree of SGLang's RadixAttention, Zheng et al. 2024, section 3),
so equal hashes mean equal whole prefixes. Lookup walks a prompt's blocks until
the first miss; registration happens only after the forward pass that wrote a
block's last token (:meth:`PrefixCacheMixin.cache_blocks`). Evicting cached
blocks that no request holds (LRU) is the :class:`~tandem.engine.block_pool.BlockPool`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


class PrefixCacheMixin:
    """The prefix-cache half of :class:`~tandem.engine.kv_cache_manager.KVCacheManager`
    (state lives there: ``block_pool``, ``block_size``, ``enable_caching``,
    ``req_to_blocks``, ``req_to_block_hashes`` and the query/hit counters)."""

    block_pool: BlockPool
    block_size: int
    enable_caching: bool
    req_to_blocks: dict[str, list[Block]]
    req_to_block_hashes: dict[str, list[BlockHash]]
    prefix_cache_queries: int
    prefix_cache_hits: int

    def get_computed_blocks(self, request_id: str,
                            token_ids: Sequence[int]) -> tuple[list[Block], int]:
        """Longest prefix of ``token_ids`` whose full blocks are in the prefix cache.

        The hit is capped so that at least one token is left to compute: the
        last prompt token always runs through the model, so its logits exist
        (a prompt of exactly k full blocks hits at most k - 1 of them).
        No references are taken: pass the blocks to :meth:`allocate_slots` in the
        same scheduling step, before any other allocation can evict them.

        Args:
            request_id: the request (for symmetry with the other calls; the
                lookup depends only on ``token_ids``).
            token_ids: the request's tokens so far (prompt, plus any output of a
                resumed request).

        Returns:
            ``(blocks, num_computed_tokens)`` with
            ``num_computed_tokens == len(blocks) * block_size`` (tokens).
            ``([], 0)`` when prefix caching is disabled.
        """
        del request_id
        if not self.enable_caching:
            return [], 0
        blocks = self.find_cached_prefix(token_ids)
        num_computed_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_computed_tokens
        return blocks, num_computed_tokens

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[Block]:
        """The blocks :meth:`get_computed_blocks` would return, without counting a query.

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

    def cache_blocks(self, request_id: str, token_ids: Sequence[int],
                     num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Blocks ``i < num_computed_tokens // block_size`` not yet hashed for this
        request are hashed (chained) and cached. Call after the forward pass
        that computed them. A request holding no blocks (already freed) is a
        no-op, as is disabled prefix caching.

        Args:
            request_id: the request.
            token_ids: its tokens, at least ``num_computed_tokens`` of them.
            num_computed_tokens: tokens whose KV is now written.

        Raises:
            ValueError: fewer than ``num_computed_tokens`` token ids, or more
                computed tokens than the request's blocks hold; or a block
                already cached under a hash these tokens do not produce.
        """
        table = self.req_to_blocks.get(request_id)
        if not self.enable_caching or table is None:
            return
        bs = self.block_size
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(table) * bs:
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed tokens, but "
                f"{len(token_ids)} token ids and {len(table)} blocks of {bs} tokens")
        block_hashes = self.req_to_block_hashes[request_id]
        parent = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), num_computed_tokens // bs):
            block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            # False is fine: another block already holds this hash, or this
            # block (shared through a fork) was cached by its other holder.
            self.block_pool.cache_block(table[i], block_hash)
            block_hashes.append(block_hash)
            parent = block_hash

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()
