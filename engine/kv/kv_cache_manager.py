"""KV cache manager: each request's block table on top of the :class:`BlockPool`.

Plain Python, no torch. The scheduler calls, per request and step::

    blocks, n = get_computed_blocks(rid, prompt)          # prefix-cache lookup (first step)
    allocate_slots(rid, num_computed_tokens, num_new_tokens, blocks)  # False: no room
    take_pending_copies()                                 # copy-on-write, run before forward
    ... forward pass writes KV of the new tokens ...
    cache_blocks(rid, token_ids, num_computed_tokens)     # register now-full blocks
    free(rid)                                             # finished, aborted or preempted

Token ranges of one :meth:`KVCacheManager.allocate_slots` call (block size 4,
``num_computed_tokens=6``, ``num_new_tokens=5``)::

    token index   0  1  2  3 | 4  5  6  7 | 8  9  10 11
                  c  c  c  c | c  c  n  n | n  n  n  .
    block table   [   b0     |    b1      |    b2     ]
                  |<-- computed -->|<--- write --->|

The write range ``[6, 11)`` starts inside ``b1``. If ``b1`` is shared (ref count
> 1, after a fork) or cached (another request may hit it), writing into it would
corrupt someone else's KV, so ``b1`` is first replaced by a fresh block and the
copy ``(b1, fresh)`` is queued: copy-on-write. ``b2`` is a fresh block.

A block becomes findable by hash only in :meth:`KVCacheManager.cache_blocks`,
after the forward pass that wrote its last token: a block that was allocated but
only partly written (the request was cancelled mid-step) never enters the cache.

Swap (preemption to host memory)::

    swap_out(rid)      device table -> host blocks; device blocks released
    swap_in(rid)       host blocks -> device blocks (cached ones reused by hash)
    take_pending_swaps()                                  # run by the model runner

Block operations of one step are queued in three lists and executed by the
model runner in the fixed order swap-out, swap-in, copy-on-write, forward. That
order gives the same result as the order of the calls, whatever they were:

* a swap-out reads blocks whose content is final: a request with blocks written
  by a pending copy or swap-in cannot be swapped out (``swap_out`` raises);
* a copy's source cannot become a swap-in destination: the copy holds a
  reference on it until :meth:`KVCacheManager.take_pending_copies`;
* a swap-in's host source cannot become a swap-out destination: it is released
  by :meth:`KVCacheManager.take_pending_swaps`;
* freeing a request drops queued operations whose destination became free, so
  no stale write lands in a block handed out again in the same step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from tandem.engine.kv.block_pool import Block, BlockHash, BlockPool
from tandem.engine.kv.kv_events import KVEvent
from tandem.engine.kv.kv_swap import SwapManager
from tandem.engine.kv.prefix_cache import PrefixCache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of all requests, keyed by ``request_id``.

    A request is *device-resident* (its block table is in ``req_to_blocks``),
    *swapped* (its host block table is held by ``swap_manager``) or unknown;
    never two of these. The manager owns the device block tables, the hash
    chains and the copy-on-write queue, and two components it calls with
    narrow views of that state:

    * ``prefix_cache`` (:class:`~tandem.engine.kv.prefix_cache.PrefixCache`):
      lookup and registration of full blocks by hash;
    * ``swap_manager`` (:class:`~tandem.engine.kv.kv_swap.SwapManager`): the host
      pool, swapped requests' host tables and the queued swap copies.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block (> 0).
        enable_caching: prefix caching on or off.
        num_host_blocks: host blocks for swapped-out requests (0: no swapping).
        enable_kv_events: record KV cache events for :meth:`take_kv_events`
            (workers report them to the router; off for an offline engine).

    Attributes:
        prefix_cache_queries: tokens looked up by :meth:`get_computed_blocks`
            (every call counts, also repeated calls for a request that waits).
        prefix_cache_hits: of those, tokens found cached.

    Raises:
        ValueError: ``block_size`` < 1, ``num_blocks`` < 1 or ``num_host_blocks`` < 0.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, enable_kv_events: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self.prefix_cache = PrefixCache(self.block_pool, block_size, enable_caching)
        self.swap_manager = SwapManager(self.block_pool, self.prefix_cache, num_host_blocks)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Chained hashes of the request's first len(...) blocks, as far as they
        # have been hashed; extended by cache_blocks so each call is O(new blocks).
        # Invariant: keys are the device-resident and swapped requests;
        # len <= len(block table).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._copy_sources: list[Block] = []     # one reference each, aligned with _pending_copies

    # -- counts -----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, including evictable cached free blocks."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some request, in ``[0, 1]``."""
        return self.block_pool.usage

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache changes since the last call (see :meth:`BlockPool.take_kv_events`)."""
        return self.block_pool.take_kv_events()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids; ``[]`` for a request holding no blocks."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks in the request's (device) block table; 0 for an unknown request."""
        return len(self.req_to_blocks.get(request_id, ()))

    def num_shared_cached_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's table that are cached and held by another
        request too: they stay on the device if this request is preempted, and a
        lookup by hash finds them again. 0 for a request holding no device blocks."""
        n = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.block_hash is None or block.ref_cnt < 2:
                break
            n += 1
        return n

    @property
    def num_host_blocks(self) -> int:
        return self.swap_manager.host_pool.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.swap_manager.host_pool.num_free_blocks

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """A swapped request's host block table; ``[]`` for any other request."""
        return self.swap_manager.get_host_block_ids(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.swap_manager.is_swapped(request_id)

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up by :meth:`get_computed_blocks` (every call counts)."""
        return self.prefix_cache.num_queried_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Of :attr:`prefix_cache_queries`, tokens found cached."""
        return self.prefix_cache.num_hit_tokens

    # -- prefix cache -----------------------------------------------------------

    def get_computed_blocks(self, request_id: str,
                            token_ids: Sequence[int]) -> tuple[list[Block], int]:
        """``(blocks, num_computed_tokens)``: the longest prefix of ``token_ids``
        (the request's tokens so far) whose full blocks are cached; see
        :meth:`PrefixCache.lookup`. ``request_id`` is for symmetry only.

        No references are taken: pass the blocks to :meth:`allocate_slots` in the
        same scheduling step, before any other allocation can evict them.
        """
        del request_id
        return self.prefix_cache.lookup(token_ids)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[Block]:
        """The blocks :meth:`get_computed_blocks` would return, without counting a
        query (for planning)."""
        return self.prefix_cache.find_cached_prefix(token_ids)

    def cache_blocks(self, request_id: str, token_ids: Sequence[int],
                     num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks not yet hashed
        (:meth:`PrefixCache.cache_full_blocks`). Call after the forward pass
        that computed them. A request holding no device blocks (already freed)
        is a no-op, as is disabled prefix caching.

        Raises:
            ValueError: as :meth:`PrefixCache.cache_full_blocks`.
        """
        table = self.req_to_blocks.get(request_id)
        if table is not None:
            self.prefix_cache.cache_full_blocks(
                table, self.req_to_block_hashes[request_id], token_ids, num_computed_tokens)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        return self.prefix_cache.reset()

    # -- allocation -------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       new_computed_blocks: Iterable[Block] = ()) -> bool:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        On the request's first call, references are taken on
        ``new_computed_blocks`` (from :meth:`get_computed_blocks`) and they start
        its block table. Then every block of the table that overlaps the write
        range ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` and
        is shared or cached is replaced by a fresh block (copy-on-write; a copy
        is queued for :meth:`take_pending_copies` when the block already holds
        this request's computed tokens), and fresh blocks are appended until
        the table covers the range. A table already long enough is not shrunk.

        Args:
            request_id: the request.
            num_computed_tokens: tokens whose KV is already written (for a new
                request with a prefix hit: ``len(new_computed_blocks) * block_size``).
            num_new_tokens: tokens this step writes.
            new_computed_blocks: cached blocks of the prefix hit; only on the
                request's first allocation.

        Returns:
            ``True`` on success; ``False`` if there are too few free blocks, in
            which case nothing has changed. Free cached blocks count as free,
            except those in ``new_computed_blocks`` (this call takes them).

        Raises:
            ValueError: a negative count; ``new_computed_blocks`` for a request
                that already holds blocks, or one of them no longer cached (it
                was evicted since the lookup); ``num_computed_tokens`` beyond the
                blocks the request holds; a swapped request (swap it in
                first). Nothing is changed.
        """
        hits = list(new_computed_blocks)
        num_fresh, cow_indices, num_taken_free_hits = self._plan(
            request_id, num_computed_tokens, num_new_tokens, hits)
        num_available = self.block_pool.num_free_blocks - num_taken_free_hits
        if num_fresh + len(cow_indices) > num_available:
            return False

        bs = self.block_size
        self.block_pool.touch(hits)
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend(hits)
        block_hashes = self.req_to_block_hashes.setdefault(request_id, [])
        block_hashes.extend(b.block_hash for b in hits)
        new_blocks = self.block_pool.get_new_blocks(len(cow_indices) + num_fresh)
        replaced: list[Block] = []
        for i, new in zip(cow_indices, new_blocks):
            old = table[i]
            if i * bs < num_computed_tokens:
                # Keep this request's tokens [i * bs, num_computed_tokens). The
                # request's reference on the source moves to the copy and is
                # dropped by take_pending_copies: until the copy has been handed
                # to the runner, the source cannot be freed and reused.
                self._pending_copies.append((old.block_id, new.block_id))
                self._copy_sources.append(old)
            else:
                replaced.append(old)
            table[i] = new
            # Block i is being rewritten: the request's hash chain ends before it.
            del block_hashes[i:]
        table.extend(new_blocks[len(cow_indices):])
        # Released only after get_new_blocks, so a replaced block is never
        # handed back as its own copy.
        self.block_pool.free_blocks(reversed(replaced))
        return True

    def num_new_blocks_needed(self, request_id: str, num_computed_tokens: int,
                              num_new_tokens: int,
                              new_computed_blocks: Iterable[Block] = ()) -> int:
        """Free blocks :meth:`allocate_slots` with the same arguments would take.

        Fresh blocks plus copy-on-write copies plus free cached blocks among
        ``new_computed_blocks`` (each leaves the free block queue). Changes nothing.

        Raises:
            ValueError: as :meth:`allocate_slots`.
        """
        num_fresh, cow_indices, num_taken_free_hits = self._plan(
            request_id, num_computed_tokens, num_new_tokens, list(new_computed_blocks))
        return num_fresh + len(cow_indices) + num_taken_free_hits

    def _plan(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
              hits: list[Block]) -> tuple[int, list[int], int]:
        """Validate an allocation and size it without mutating anything.

        Returns:
            ``(num_fresh, cow_indices, num_taken_free_hits)``: blocks to append,
            table indices to replace by a copy, and distinct free blocks among
            ``hits``.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_computed_tokens="
                             f"{num_computed_tokens}, num_new_tokens={num_new_tokens}")
        if self.swap_manager.is_swapped(request_id):
            raise ValueError(f"request {request_id!r} is swapped out; swap it in first")
        bs = self.block_size
        table = self.req_to_blocks.get(request_id, [])
        if hits:
            if table:
                raise ValueError(f"request {request_id!r} already holds blocks; "
                                 "new_computed_blocks is for its first allocation only")
            for block in hits:
                if block.block_hash is None:
                    raise ValueError(f"{block} was evicted after get_computed_blocks; "
                                     "look up and allocate in the same step")
        held = table + hits
        if num_computed_tokens > len(held) * bs:
            raise ValueError(f"request {request_id!r}: {num_computed_tokens} computed tokens "
                             f"do not fit in its {len(held)} blocks of {bs} tokens")
        num_fresh = max(0, _cdiv(num_computed_tokens + num_new_tokens, bs) - len(held))
        cow_indices: list[int] = []
        if num_new_tokens:
            first = num_computed_tokens // bs
            last = (num_computed_tokens + num_new_tokens - 1) // bs
            for i in range(first, min(last + 1, len(held))):
                # A cached block's content must stay what its hash says; a
                # shared block's content belongs to its other holders too.
                if held[i].ref_cnt > 1 or held[i].block_hash is not None:
                    cow_indices.append(i)
        num_taken_free_hits = len({b.block_id for b in hits if b.ref_cnt == 0})
        return num_fresh, cow_indices, num_taken_free_hits

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write copies queued since the last call, as ``(src_block_id, dst_block_id)``.

        The model runner must execute them in order (a later copy may read an
        earlier one's destination), before the forward pass that writes the new
        tokens. Clears the queue and releases the references the copies held
        on their sources.
        """
        copies, self._pending_copies = self._pending_copies, []
        self.block_pool.free_blocks(reversed(self._copy_sources))
        self._copy_sources = []
        return copies

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        """Give ``child_request_id`` the parent's block table, sharing every block.

        Each block's ref count goes up by one (n > 1 samples of one prompt share
        the prompt's blocks). Takes no free blocks; a later write into a shared
        block goes through copy-on-write in :meth:`allocate_slots`.

        Raises:
            KeyError: the parent holds no block table.
            ValueError: the child already has one.
        """
        if parent_request_id not in self.req_to_blocks:
            raise KeyError(f"fork: unknown parent request {parent_request_id!r}")
        if child_request_id in self.req_to_blocks or self.swap_manager.is_swapped(child_request_id):
            raise ValueError(f"fork: request {child_request_id!r} already holds blocks")
        table = self.req_to_blocks[parent_request_id]
        self.block_pool.touch(table)
        self.req_to_blocks[child_request_id] = list(table)
        self.req_to_block_hashes[child_request_id] = list(
            self.req_to_block_hashes[parent_request_id])

    # -- swap -------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        """The request is device-resident and the host pool can hold its whole table."""
        table = self.req_to_blocks.get(request_id)
        return table is not None and self.swap_manager.can_swap_out(table)

    def swap_out(self, request_id: str) -> bool:
        """Move the request's block table to host blocks (Kwon et al. 2023, section 4.5):
        host blocks and queued copies from :meth:`SwapManager.swap_out`, then the
        device blocks are released as by :meth:`free` (a cached one stays
        findable; a shared one stays allocated to its other holder). The hash
        chain is kept for :meth:`swap_in`.

        Returns:
            ``True`` on success; ``False`` if the host pool has too few free
            blocks, in which case nothing has changed.

        Raises:
            KeyError: the request holds no device block table.
            ValueError: one of its blocks is the destination of a copy or
                swap-in queued in this step (its content is not there yet);
                nothing is changed.
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            raise KeyError(f"swap_out: request {request_id!r} holds no device blocks")
        pending_dst = {d for _, d in self._pending_copies} | self.swap_manager.swap_in_destinations()
        if pending_dst.intersection(b.block_id for b in table):
            raise ValueError(f"swap_out: request {request_id!r} has blocks written by an "
                             "operation queued in this step; swap it out in a later step")
        if not self.swap_manager.swap_out(request_id, table):
            return False
        del self.req_to_blocks[request_id]
        self.block_pool.free_blocks(reversed(table))
        return True

    def num_blocks_to_swap_in(self, request_id: str) -> int:
        """Free device blocks :meth:`swap_in` would take: the table's length, less
        blocks found in use in the prefix cache (those are shared, not taken).

        Raises:
            KeyError: the request is not swapped.
        """
        return self.swap_manager.num_blocks_to_swap_in(request_id,
                                                       self.req_to_block_hashes[request_id])

    def swap_in(self, request_id: str) -> bool:
        """Move a swapped request's table back to device blocks
        (:meth:`SwapManager.swap_in`: blocks still cached on the device are
        reused by hash, the others copied back from host memory).

        Returns:
            ``True`` on success; ``False`` if there are too few free device
            blocks (see :meth:`num_blocks_to_swap_in`), in which case nothing
            has changed.

        Raises:
            KeyError: the request is not swapped.
        """
        if request_id not in self.req_to_block_hashes:
            raise KeyError(request_id)
        table = self.swap_manager.swap_in(request_id, self.req_to_block_hashes[request_id])
        if table is None:
            return False
        self.req_to_blocks[request_id] = table
        return True

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(blocks_to_swap_out, blocks_to_swap_in)`` queued since the last call
        (:meth:`SwapManager.take_pending_swaps`); clears the queues. The model
        runner executes all swap-outs, then all swap-ins, then the copy-on-write
        copies, before the forward pass."""
        return self.swap_manager.take_pending_swaps()

    # -- release ----------------------------------------------------------------

    def free(self, request_id: str) -> bool:
        """Release the request's blocks, tail first.

        Tail first: blocks that reach ref count 0 join the free block queue in
        that order, so under LRU a sequence's tail blocks are evicted before its
        head blocks (the head is the prefix most likely to be shared again).

        A swapped request's host blocks are released instead. Queued copies,
        swap-ins and swap-outs whose destination is now free are dropped: the
        block may be handed out again in this step, and a stale operation
        executed later in the step would overwrite its new owner's data.

        Returns:
            ``True`` if the request held a block table (device or host),
            ``False`` (no-op) otherwise.
        """
        if self.swap_manager.free(request_id):
            del self.req_to_block_hashes[request_id]
            return True
        table = self.req_to_blocks.pop(request_id, None)
        if table is None:
            return False
        del self.req_to_block_hashes[request_id]
        self.block_pool.free_blocks(reversed(table))
        freed = {b.block_id for b in table if b.ref_cnt == 0}
        if freed and any(dst in freed for _, dst in self._pending_copies):
            keep = [dst not in freed for _, dst in self._pending_copies]
            dropped = [b for b, k in zip(self._copy_sources, keep) if not k]
            self._pending_copies = [p for p, k in zip(self._pending_copies, keep) if k]
            self._copy_sources = [b for b, k in zip(self._copy_sources, keep) if k]
            self.block_pool.free_blocks(reversed(dropped))
        self.swap_manager.drop_swap_ins_into(freed)
        return True

    # -- checks -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check both pools and that block tables account for every reference.

        Device: free + in use == total, and ref counts equal block-table
        references. Host: free + in use == total, and the blocks in use are
        exactly the swapped requests' host tables plus the swap-in sources not
        yet released.

        Raises:
            AssertionError: naming the first violated invariant.
        """
        pool = self.block_pool
        pool.check_invariants()
        swapped = self.swap_manager.req_to_host_blocks
        self.swap_manager.check_invariants(self.req_to_block_hashes)
        both = self.req_to_blocks.keys() & swapped.keys()
        assert not both, f"requests both device-resident and swapped: {sorted(both)}"
        assert self.req_to_block_hashes.keys() == (self.req_to_blocks.keys() | swapped.keys()), (
            "requests with a hash chain differ from requests with a block table")
        refs: Counter[int] = Counter(b.block_id for b in self._copy_sources)
        assert len(self._copy_sources) == len(self._pending_copies) and all(
            b.block_id == src for b, (src, _) in zip(self._copy_sources, self._pending_copies)), (
            "pending copies and the references held on their sources disagree")
        for request_id, table in self.req_to_blocks.items():
            refs.update(b.block_id for b in table)
            block_hashes = self.req_to_block_hashes[request_id]
            assert len(block_hashes) <= len(table), (
                f"request {request_id!r}: {len(block_hashes)} block hashes "
                f"for {len(table)} blocks")
            for i, block_hash in enumerate(block_hashes):
                assert table[i].block_hash in (None, block_hash), (
                    f"request {request_id!r}: block {i} ({table[i]}) is cached "
                    "under a hash its tokens do not produce")
        total_refs = sum(refs.values())
        total_ref_cnt = sum(b.ref_cnt for b in pool.blocks)
        assert total_refs == total_ref_cnt, (
            f"block tables (and pending copies) hold {total_refs} references, ref counts "
            f"sum to {total_ref_cnt}")
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt != {refs[block.block_id]} block-table references")
        for src, dst in self._pending_copies:
            assert 0 <= src < pool.num_blocks and 0 <= dst < pool.num_blocks, (
                f"pending copy ({src}, {dst}) names a block outside the pool")
