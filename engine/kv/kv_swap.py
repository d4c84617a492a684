"""Swap: the host block pool and moving a request's block table between device and host.

Plain Python, no torch: a host block is only an id; the model runner owns the
host tensor whose block ``i`` is ``KVCache.host_tensor[:, :, i]`` and executes
the queued ``(device_block_id, host_block_id)`` / ``(host_block_id,
device_block_id)`` pairs.

Swapping is one of the two preemption modes of Kwon et al. 2023 ("Efficient
Memory Management for Large Language Model Serving with PagedAttention",
section 4.5): a preempted request's KV blocks are copied to host memory and its
device blocks freed; when it resumes they are copied back, and it continues
from the same token with the same KV, so its output is unchanged. (The other
mode, recompute, frees the blocks and prefills the request again.)

Unlike the device :class:`~tandem.engine.kv.block_pool.BlockPool` the host pool
has no prefix cache and no sharing: a host block holds one swapped-out
request's copy of one device block, from swap-out until swap-in or abort, so a
free list and the set of blocks in use are all it needs (vLLM v0 kept a
separate CPU block allocator in the same way).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tandem.engine.kv.block_pool import Block, BlockHash, BlockPool, NoFreeBlocksError
from tandem.engine.kv.prefix_cache import PrefixCache


class HostBlockPool:
    """Ids ``0 .. num_blocks - 1`` of host KV blocks: free or in use.

    Args:
        num_blocks: host blocks (>= 0; 0 means swapping is impossible and every
            preemption falls back to recompute).

    Raises:
        ValueError: ``num_blocks`` < 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first (its pages are
        # the likeliest to be resident). Reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._in_use)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free host blocks.

        Raises:
            ValueError: ``num_blocks`` < 0.
            NoFreeBlocksError: fewer free host blocks than asked for; nothing changed.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {num_blocks} host blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(num_blocks)]
        self._in_use.update(out)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Return host blocks to the pool.

        Raises:
            ValueError: an id is not in use (double free, or repeated in
                ``block_ids``); then nothing is changed.
        """
        block_ids = list(block_ids)
        if len(set(block_ids)) != len(block_ids) or not self._in_use.issuperset(block_ids):
            raise ValueError(f"freeing host blocks {block_ids}: not all in use, or repeated")
        self._in_use.difference_update(block_ids)
        self._free.extend(block_ids)

    def is_in_use(self, block_id: int) -> bool:
        return block_id in self._in_use

    def check_invariants(self) -> None:
        """free + in use == total, each id exactly once.

        Raises:
            AssertionError: naming the violated invariant.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is in the free list twice"
        assert not free & self._in_use, f"host blocks both free and in use: {free & self._in_use}"
        assert free | self._in_use == set(range(self.num_blocks)), (
            "host block ids outside the pool, or missing from both lists")
        assert len(self._free) + len(self._in_use) == self.num_blocks, (
            f"host free {len(self._free)} + in use {len(self._in_use)} != total {self.num_blocks}")


class SwapManager:
    """Swap-out and swap-in of block tables between the device pool and the host pool.

    A component of :class:`~tandem.engine.kv.kv_cache_manager.KVCacheManager`.
    It owns the host side: the :class:`HostBlockPool`, the host block table of
    every swapped request (``req_to_host_blocks``) and the step's queued swap
    copies. Its view of the device side is narrow:

    * of the device :class:`BlockPool`: ``num_free_blocks``, ``get_new_blocks``
      and ``touch`` to build a swapped-in table, ``blocks[i]`` and
      ``cache_block`` to register a swapped-in block once its copy is handed
      to the runner. It never frees device blocks: the manager releases a
      swapped-out table itself, as it releases any other.
    * of the :class:`~tandem.engine.kv.prefix_cache.PrefixCache`: ``find_blocks``,
      to reuse blocks still cached on the device instead of copying them.
    * of the device block tables and hash chains: only the table or chain the
      manager passes in, never the manager's dicts.

    A request is swapped exactly while it is a key of ``req_to_host_blocks``.

    Args:
        block_pool: the device block pool.
        prefix_cache: the device prefix cache.
        num_host_blocks: host blocks (0: swapping is impossible).

    Raises:
        ValueError: ``num_host_blocks`` < 0.
    """

    def __init__(self, block_pool: BlockPool, prefix_cache: PrefixCache,
                 num_host_blocks: int) -> None:
        self.block_pool = block_pool
        self.prefix_cache = prefix_cache
        self.host_pool = HostBlockPool(num_host_blocks)
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []   # (device id, host id)
        self.pending_swap_in: list[tuple[int, int]] = []    # (host id, device id)
        # Sources of queued swap-ins: released by take_pending_swaps, so that no
        # swap-out of the same step can overwrite them before they are read.
        self.host_blocks_to_release: list[int] = []
        # Device block id -> hash to register once its pending swap-in is taken.
        self.swap_in_hashes: dict[int, BlockHash] = {}

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.req_to_host_blocks

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """A swapped request's host block table; ``[]`` for any other request."""
        return list(self.req_to_host_blocks.get(request_id, ()))

    def can_swap_out(self, table: Sequence[Block]) -> bool:
        """The host pool can hold all of ``table``."""
        return len(table) <= self.host_pool.num_free_blocks

    def swap_in_destinations(self) -> set[int]:
        """Device block ids written by swap-ins queued in this step."""
        return {d for _, d in self.pending_swap_in}

    def swap_out(self, request_id: str, table: Sequence[Block]) -> bool:
        """Give every block of the request's device ``table`` a host block and a
        queued ``(device_block_id, host_block_id)`` copy; record the host table.

        The caller then releases ``table``'s device blocks and forgets it.

        Returns:
            ``True`` on success; ``False`` if the host pool has too few free
            blocks, in which case nothing has changed.

        Raises:
            ValueError: the request is swapped already.
        """
        if request_id in self.req_to_host_blocks:
            raise ValueError(f"swap_out: request {request_id!r} is swapped already")
        if not self.can_swap_out(table):
            return False
        host_ids = self.host_pool.allocate(len(table))
        self.pending_swap_out.extend(zip((b.block_id for b in table), host_ids))
        self.req_to_host_blocks[request_id] = host_ids
        return True

    def num_blocks_to_swap_in(self, request_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Free device blocks :meth:`swap_in` would take: the host table's length,
        less blocks found in use in the prefix cache (those are shared, not taken).

        Raises:
            KeyError: the request is not swapped.
        """
        host_ids = self.req_to_host_blocks[request_id]
        hits = self.prefix_cache.find_blocks(block_hashes)
        return len(host_ids) - sum(1 for b in hits.values() if b.ref_cnt > 0)

    def swap_in(self, request_id: str, block_hashes: Sequence[BlockHash]) -> list[Block] | None:
        """Build a swapped request's device table again, from its host table.

        Block ``i`` whose chained hash ``block_hashes[i]`` (kept from before
        the swap-out) is still in the prefix cache is taken from the cache, with
        no copy; every other block gets a fresh device block and a queued
        ``(host_block_id, device_block_id)`` copy, and is registered again under
        its hash when :meth:`take_pending_swaps` hands the copy to the runner
        (not before: a request freed in this step drops its copy, and the block
        must not be findable without its KV). The host blocks are released by
        :meth:`take_pending_swaps` too. The request is no longer swapped.

        Returns:
            The new device table (the caller installs it), or ``None`` if there
            are too few free device blocks (see :meth:`num_blocks_to_swap_in`),
            in which case nothing has changed.

        Raises:
            KeyError: the request is not swapped.
        """
        host_ids = self.req_to_host_blocks[request_id]
        hits = self.prefix_cache.find_blocks(block_hashes)
        num_fresh = len(host_ids) - len(hits)
        num_taken_free_hits = len({b.block_id for b in hits.values() if b.ref_cnt == 0})
        if num_fresh > self.block_pool.num_free_blocks - num_taken_free_hits:
            return None
        self.block_pool.touch(hits.values())
        fresh = iter(self.block_pool.get_new_blocks(num_fresh))
        table: list[Block] = []
        for i, host_id in enumerate(host_ids):
            block = hits.get(i)
            if block is None:
                block = next(fresh)
                self.pending_swap_in.append((host_id, block.block_id))
                if i < len(block_hashes):
                    self.swap_in_hashes[block.block_id] = block_hashes[i]
            table.append(block)
        del self.req_to_host_blocks[request_id]
        self.host_blocks_to_release.extend(host_ids)
        return table

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Swaps queued since the last call; clears the queues.

        Returns:
            ``(blocks_to_swap_out, blocks_to_swap_in)``: ``(device_block_id,
            host_block_id)`` and ``(host_block_id, device_block_id)`` pairs. The
            host blocks the swap-ins read become free now, and the full blocks
            they fill findable by hash.
        """
        swap_out, self.pending_swap_out = self.pending_swap_out, []
        swap_in, self.pending_swap_in = self.pending_swap_in, []
        for _, dev in swap_in:
            block_hash = self.swap_in_hashes.get(dev)
            if block_hash is not None:
                # False when another block took this hash meanwhile: it stays uncached.
                self.block_pool.cache_block(self.block_pool.blocks[dev], block_hash)
        self.swap_in_hashes = {}
        self.host_pool.free(self.host_blocks_to_release)
        self.host_blocks_to_release = []
        return swap_out, swap_in

    def free(self, request_id: str) -> bool:
        """Release a swapped request's host blocks (abort); ``False`` if it is not swapped.

        Queued swap-outs into those host blocks are dropped: the blocks may be
        handed to another request's swap-out in this step.
        """
        host_ids = self.req_to_host_blocks.pop(request_id, None)
        if host_ids is None:
            return False
        self.host_pool.free(host_ids)
        dead = set(host_ids)
        self.pending_swap_out = [p for p in self.pending_swap_out if p[1] not in dead]
        return True

    def drop_swap_ins_into(self, freed_block_ids: set[int]) -> None:
        """Drop queued swap-ins (and their pending hashes) whose device block was
        just freed: it may be handed out again in this step, and a stale copy
        executed later would overwrite its new owner's data."""
        if freed_block_ids and self.pending_swap_in:
            self.pending_swap_in = [p for p in self.pending_swap_in
                                    if p[1] not in freed_block_ids]
            for block_id in freed_block_ids:
                self.swap_in_hashes.pop(block_id, None)

    def check_invariants(self, req_to_block_hashes: Mapping[str, Sequence[BlockHash]]) -> None:
        """Host pool accounting, host table ownership and the queued swaps.

        Args:
            req_to_block_hashes: the manager's hash chains (read only); each
                swapped request must have one no longer than its host table.

        Raises:
            AssertionError: naming the first violated invariant.
        """
        pool = self.block_pool
        self.host_pool.check_invariants()
        host_owned = list(self.host_blocks_to_release)
        for request_id, host_ids in self.req_to_host_blocks.items():
            host_owned.extend(host_ids)
            assert request_id in req_to_block_hashes, (
                f"swapped request {request_id!r} has no hash chain")
            assert len(req_to_block_hashes[request_id]) <= len(host_ids), (
                f"swapped request {request_id!r}: more block hashes than host blocks")
        assert len(host_owned) == len(set(host_owned)), "a host block has two owners"
        assert len(host_owned) == self.host_pool.num_used_blocks and all(
            self.host_pool.is_in_use(h) for h in host_owned), (
            f"host tables hold {len(host_owned)} blocks, host pool has "
            f"{self.host_pool.num_used_blocks} in use")
        for dev, host in self.pending_swap_out:
            assert 0 <= dev < pool.num_blocks and self.host_pool.is_in_use(host), (
                f"pending swap-out ({dev}, {host}) names a block outside the pools")
        for host, dev in self.pending_swap_in:
            assert self.host_pool.is_in_use(host) and pool.blocks[dev].ref_cnt > 0, (
                f"pending swap-in ({host}, {dev}) reads a free host block or writes a free one")
        swap_in_dsts = self.swap_in_destinations()
        assert self.swap_in_hashes.keys() <= swap_in_dsts, (
            "a hash waits to be registered for a block no pending swap-in fills")
        for dev in swap_in_dsts:
            assert pool.blocks[dev].block_hash is None, (
                f"block {dev} is findable by hash before its swap-in has run")
