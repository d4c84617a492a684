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
* freeing a request (or releasing its blocks that left the sliding window)
  drops queued operations whose destination became free, so no stale write
  lands in a block handed out again in the same step.

Sliding window (vLLM v1's ``SlidingWindowManager``). When every attention layer
of the model has a sliding window of at most ``sliding_window`` tokens, a query
at position ``p`` reads only keys ``p - sliding_window + 1 .. p``. A step's
earliest query is at its first written position (``num_computed_tokens``: the
chunk start of a chunked prefill, the decode token before its draft tokens), and
later queries of the step read later keys only, so a block whose tokens all lie
before ``num_computed_tokens - sliding_window + 1`` (the first key the step reads)
is never read again. Each
:meth:`KVCacheManager.allocate_slots` releases those blocks to the pool (a
shared one stays with its other holders; a cached one stays findable as
evictable cache) and puts the pool's *null block* in their block-table slots.
The null block is never written; the attention kernels never weigh it, since its
positions are outside every query's window (they may read its zeros and mask
them). Block size 4, window 6, ``num_computed_tokens=13``::

    token index   0  1  2  3 | 4  5  6  7 | 8  9  10 11 | 12 13 14 15
                               the query at 13 reads  |<-- 8 .. 13 ---->|
    block table   [  null    |   null     |    b2     |     b3     ]

``(13 - 6 + 1) // 4 = 2`` blocks are released: block 2 starts at token 8, the
first key the query at 13 still reads. A request's table therefore holds at most
``cdiv(sliding_window - 1 + num_new_tokens, block_size) + 1`` blocks in a step,
however long the sequence. Prefix-cache lookups keep the simple rule: every
block of the prefix must be cached (vLLM only needs the blocks inside the
window); hits that lie wholly outside the window are not taken. Models with
some full-attention layers (Gemma 2/3) release nothing.
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


def kv_sliding_window(layer_windows: Sequence[int | None]) -> int | None:
    """The window (tokens) within which every layer attends, given each layer's
    sliding window (``ModelConfig.layer_windows``; ``None`` for a full-attention
    layer): the largest one, or ``None`` when some layer (or, for an empty
    sequence, every layer) attends to the whole context, as Gemma 2/3's global
    layers do. Blocks outside this window can be released
    (:class:`KVCacheManager`'s ``sliding_window``)."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


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
        sliding_window: tokens (>= 1) that every attention layer's window is
            within (:func:`kv_sliding_window`), or ``None`` when some layer
            attends to the whole context. Set, blocks that fall out of the window
            are released and block 0 is reserved as the null block.

    Attributes:
        prefix_cache_queries: tokens looked up by :meth:`get_computed_blocks`
            (every call counts, also repeated calls for a request that waits).
        prefix_cache_hits: of those, tokens found cached.

    Raises:
        ValueError: ``block_size`` < 1, ``num_blocks`` < 1 (< 2 with a
            ``sliding_window``), ``num_host_blocks`` < 0 or ``sliding_window`` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, enable_kv_events: bool = False,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events,
                                    reserve_null_block=sliding_window is not None)
        self.null_block = self.block_pool.null_block
        self.prefix_cache = PrefixCache(self.block_pool, block_size, enable_caching)
        self.swap_manager = SwapManager(self.block_pool, self.prefix_cache, num_host_blocks)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Chained hashes of the request's first len(...) blocks, as far as they
        # have been hashed; extended by cache_blocks so each call is O(new blocks).
        # Invariant: keys are the device-resident and swapped requests;
        # len <= len(block table).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # Leading block-table slots that hold the null block (sliding window), for
        # device-resident and swapped requests; absent means 0.
        self.req_to_num_skipped: dict[str, int] = {}
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
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV: :attr:`num_blocks` less the null block, if any."""
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use by some request, in ``[0, 1]``."""
        return self.block_pool.usage

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache changes since the last call (see :meth:`BlockPool.take_kv_events`)."""
        return self.block_pool.take_kv_events()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids; ``[]`` for a request holding no blocks.

        Slots released from the sliding window hold the null block's id (0)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        """Slots of the request's (device) block table, null ones included (it
        covers ``num_blocks_of * block_size`` tokens); 0 for an unknown request."""
        return len(self.req_to_blocks.get(request_id, ()))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's device block table holds (its slots less the null
        ones released from the sliding window); 0 for an unknown request."""
        return self.num_blocks_of(request_id) - self.num_skipped_blocks(request_id)

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading slots of the request's block table (device or host) that hold the
        null block: released from the sliding window. 0 without a window."""
        return self.req_to_num_skipped.get(request_id, 0)

    def max_blocks_per_step(self, num_new_tokens: int) -> int | None:
        """With a sliding window, the most blocks one request's table holds in a step
        that writes ``num_new_tokens`` tokens, however long its sequence: its reads
        and writes span ``sliding_window - 1 + num_new_tokens`` positions, which
        touch at most ``cdiv(sliding_window - 1 + num_new_tokens, block_size) + 1``
        blocks. ``None`` without a window (a request holds its whole sequence)."""
        if self.sliding_window is None:
            return None
        return _cdiv(self.sliding_window - 1 + num_new_tokens, self.block_size) + 1

    def num_unneeded_blocks(self, first_query_position: int) -> int:
        """Leading blocks of a sequence that no query at ``first_query_position`` or
        later reads: ``(first_query_position - sliding_window + 1) // block_size``
        (the query at ``p`` reads keys ``p - sliding_window + 1 .. p``), at least
        0; always 0 without a sliding window."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

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
                       new_computed_blocks: Iterable[Block] = (),
                       first_query_position: int | None = None) -> bool:
        """Make the request's block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        On the request's first call, references are taken on
        ``new_computed_blocks`` (from :meth:`get_computed_blocks`) and they start
        its block table. Then every block of the table that overlaps the write
        range ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` and
        is shared or cached is replaced by a fresh block (copy-on-write; a copy
        is queued for :meth:`take_pending_copies` when the block already holds
        this request's computed tokens), and fresh blocks are appended until
        the table covers the range. A table already long enough is not shrunk.

        With a sliding window, the first :meth:`num_unneeded_blocks` of
        ``first_query_position`` slots hold the null block instead: held blocks
        there are released (see the module docstring), hits there are not taken,
        and new slots there get no block.

        Args:
            request_id: the request.
            num_computed_tokens: tokens whose KV is already written (for a new
                request with a prefix hit: ``len(new_computed_blocks) * block_size``).
            num_new_tokens: tokens this step writes.
            new_computed_blocks: cached blocks of the prefix hit; only on the
                request's first allocation.
            first_query_position: the earliest position whose attention reads this
                table next (default ``num_computed_tokens``). A consumer reserving
                blocks for a prompt whose KV comes from another engine passes the
                prompt length: the transferred tokens are written, not attended, here.

        Returns:
            ``True`` on success; ``False`` if there are too few free blocks, in
            which case nothing has changed. Free cached blocks count as free,
            except those in ``new_computed_blocks`` (this call takes them), and
            so do blocks this call releases from the sliding window.

        Raises:
            ValueError: a negative count; ``new_computed_blocks`` for a request
                that already holds blocks, or one of them no longer cached (it
                was evicted since the lookup); ``num_computed_tokens`` beyond the
                blocks the request holds; a swapped request (swap it in
                first); ``first_query_position`` outside ``[num_computed_tokens,
                num_computed_tokens + num_new_tokens]``. Nothing is changed.
        """
        hits = list(new_computed_blocks)
        plan = self._plan(request_id, num_computed_tokens, num_new_tokens, hits,
                          first_query_position)
        num_fresh, cow_indices, num_taken_free_hits, num_skipped, released = plan
        num_available = (self.block_pool.num_free_blocks - num_taken_free_hits
                         + sum(1 for b in released if b.ref_cnt == 1))
        if num_fresh + len(cow_indices) > num_available:
            return False

        bs = self.block_size
        table = self.req_to_blocks.setdefault(request_id, [])
        block_hashes = self.req_to_block_hashes.setdefault(request_id, [])
        if released:
            for i in range(self.num_skipped_blocks(request_id), min(num_skipped, len(table))):
                table[i] = self.null_block
            self._release(released)   # before get_new_blocks: they may be handed back
        taken = hits[num_skipped:]
        self.block_pool.touch(taken)
        table.extend([self.null_block] * (len(hits) - len(taken)) + taken)
        block_hashes.extend(b.block_hash for b in hits)
        if len(table) < num_skipped:
            table.extend([self.null_block] * (num_skipped - len(table)))
        if num_skipped:
            self.req_to_num_skipped[request_id] = num_skipped
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
        ``new_computed_blocks`` (each leaves the free block queue), less the
        blocks it would release from the sliding window to the free block queue
        (at least 0). Changes nothing.

        Raises:
            ValueError: as :meth:`allocate_slots`.
        """
        num_fresh, cow_indices, num_taken_free_hits, _, released = self._plan(
            request_id, num_computed_tokens, num_new_tokens, list(new_computed_blocks), None)
        num_released_free = sum(1 for b in released if b.ref_cnt == 1)
        return max(0, num_fresh + len(cow_indices) + num_taken_free_hits - num_released_free)

    def _plan(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
              hits: list[Block], first_query_position: int | None
              ) -> tuple[int, list[int], int, int, list[Block]]:
        """Validate an allocation and size it without mutating anything.

        Returns:
            ``(num_fresh, cow_indices, num_taken_free_hits, num_skipped, released)``:
            blocks to append, table indices to replace by a copy, distinct free
            blocks among the hits taken, the leading null slots of the table
            afterwards, and held blocks to release from the sliding window.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_computed_tokens="
                             f"{num_computed_tokens}, num_new_tokens={num_new_tokens}")
        if first_query_position is None:
            first_query_position = num_computed_tokens
        if not num_computed_tokens <= first_query_position <= num_computed_tokens + num_new_tokens:
            raise ValueError(f"first_query_position {first_query_position} outside "
                             f"[{num_computed_tokens}, {num_computed_tokens + num_new_tokens}]")
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
        num_skipped = max(self.num_skipped_blocks(request_id),
                          self.num_unneeded_blocks(first_query_position))
        released = table[self.num_skipped_blocks(request_id):num_skipped]
        num_fresh = max(0, _cdiv(num_computed_tokens + num_new_tokens, bs)
                        - max(len(held), num_skipped))
        cow_indices: list[int] = []
        if num_new_tokens:
            first = max(num_computed_tokens // bs, num_skipped)
            last = (num_computed_tokens + num_new_tokens - 1) // bs
            for i in range(first, min(last + 1, len(held))):
                # A cached block's content must stay what its hash says; a
                # shared block's content belongs to its other holders too.
                if held[i].ref_cnt > 1 or held[i].block_hash is not None:
                    cow_indices.append(i)
        num_taken_free_hits = len({b.block_id for b in hits[num_skipped:] if b.ref_cnt == 0})
        return num_fresh, cow_indices, num_taken_free_hits, num_skipped, released

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
        if parent_request_id in self.req_to_num_skipped:
            self.req_to_num_skipped[child_request_id] = self.req_to_num_skipped[parent_request_id]

    # -- swap -------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        """The request is device-resident and the host pool can hold the blocks of
        its table (null slots take no host block)."""
        table = self.req_to_blocks.get(request_id)
        return table is not None and self.swap_manager.can_swap_out(
            table[self.num_skipped_blocks(request_id):])

    def swap_out(self, request_id: str) -> bool:
        """Move the request's block table to host blocks (Kwon et al. 2023, section 4.5):
        host blocks and queued copies from :meth:`SwapManager.swap_out`, then the
        device blocks are released as by :meth:`free` (a cached one stays
        findable; a shared one stays allocated to its other holder). The hash
        chain is kept for :meth:`swap_in`, and so are null slots (sliding
        window): only the held blocks move.

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
        held = table[self.num_skipped_blocks(request_id):]     # null slots stay null
        if not self.swap_manager.swap_out(request_id, held):
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
        skipped = self.num_skipped_blocks(request_id)
        return self.swap_manager.num_blocks_to_swap_in(
            request_id, self.req_to_block_hashes[request_id][skipped:])

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
        skipped = self.num_skipped_blocks(request_id)
        table = self.swap_manager.swap_in(request_id,
                                          self.req_to_block_hashes[request_id][skipped:])
        if table is None:
            return False
        self.req_to_blocks[request_id] = [self.null_block] * skipped + table
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
            self.req_to_num_skipped.pop(request_id, None)
            return True
        table = self.req_to_blocks.pop(request_id, None)
        if table is None:
            return False
        del self.req_to_block_hashes[request_id]
        skipped = self.req_to_num_skipped.pop(request_id, 0)
        self._release(table[skipped:])
        return True

    def _release(self, blocks: list[Block]) -> None:
        """Drop the references of a table's ``blocks`` (in sequence order; released
        tail first), then the queued copies and swap-ins whose destination became free."""
        self.block_pool.free_blocks(reversed(blocks))
        freed = {b.block_id for b in blocks if b.ref_cnt == 0}
        if freed and any(dst in freed for _, dst in self._pending_copies):
            keep = [dst not in freed for _, dst in self._pending_copies]
            dropped = [b for b, k in zip(self._copy_sources, keep) if not k]
            self._pending_copies = [p for p, k in zip(self._pending_copies, keep) if k]
            self._copy_sources = [b for b, k in zip(self._copy_sources, keep) if k]
            self.block_pool.free_blocks(reversed(dropped))
        self.swap_manager.drop_swap_ins_into(freed)

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
        self.swap_manager.check_invariants(
            {rid: chain[self.num_skipped_blocks(rid):]
             for rid, chain in self.req_to_block_hashes.items()})
        assert self.req_to_num_skipped.keys() <= self.req_to_block_hashes.keys(), (
            "null slots recorded for a request without a block table")
        both = self.req_to_blocks.keys() & swapped.keys()
        assert not both, f"requests both device-resident and swapped: {sorted(both)}"
        assert self.req_to_block_hashes.keys() == (self.req_to_blocks.keys() | swapped.keys()), (
            "requests with a hash chain differ from requests with a block table")
        refs: Counter[int] = Counter(b.block_id for b in self._copy_sources)
        assert len(self._copy_sources) == len(self._pending_copies) and all(
            b.block_id == src for b, (src, _) in zip(self._copy_sources, self._pending_copies)), (
            "pending copies and the references held on their sources disagree")
        null = self.null_block
        for request_id, table in self.req_to_blocks.items():
            skipped = self.num_skipped_blocks(request_id)
            assert skipped <= len(table) and all(b is null for b in table[:skipped]) and (
                null is None or all(b is not null for b in table[skipped:])), (
                f"request {request_id!r}: its {skipped} leading null slots disagree with "
                "its block table")
            refs.update(b.block_id for b in table[skipped:])
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
