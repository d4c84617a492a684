"""Block pool: the physical KV cache blocks, their ref counts, the free block queue
and the prefix cache (block hash -> block).

Plain Python, no torch: a block here is only an id plus bookkeeping; the model
runner owns the tensors that block ``i`` names (``key_cache[:, i]``, ...).

Every block is in exactly one of three states::

    in use        ref_cnt > 0                       not in the free block queue
    free, cached  ref_cnt == 0, block_hash is set   in the queue, can still be hit
    free          ref_cnt == 0, block_hash is None  in the queue

A block whose ref count drops to 0 goes to the *tail* of the free block queue
and keeps its hash; allocation pops from the *head*. The queue is therefore in
least-recently-used order, and a cached free block is evicted (its hash dropped)
only when it reaches the head and is handed out again. A cache hit on a free
block takes it out of the middle of the queue (:meth:`BlockPool.touch`).

With ``enable_kv_events`` the pool also records every change to the set of
cached hashes as a KV cache event (:mod:`tandem.engine.kv.kv_events`): a hash is
*stored* when :meth:`BlockPool.cache_block` registers it and *removed* when its
block is evicted; :meth:`BlockPool.reset_prefix_cache` *clears* all of them.
Freeing a cached block records nothing: it stays findable until evicted.

Block id 0 is not reserved by default: every id in ``range(num_blocks)`` can be
allocated. Padding entries of a padded block table may still hold 0, because
attention never reads past a sequence's length. A pool for a model whose every
layer has a sliding window reserves block 0 as the *null block*
(``reserve_null_block``, vLLM v1's ``null_block``): it stands in a block table
for a block that fell out of the window and was released. It is never handed
out, never written (no write range, copy, swap or KV transfer targets it; it
keeps the zeros the cache starts with), never cached, and takes no references:
it is outside the three states above, and outside every count below except
:attr:`BlockPool.num_blocks`.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from tandem.engine.kv.kv_events import KVEvent, KVEventRecorder

BlockHash = int
"""A chained block hash: 128-bit unsigned int (see :func:`hash_block_tokens`)."""

_HASH_BYTES = 16


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra: int | None = None) -> BlockHash:
    """Hash one block: its parent block's hash, its token ids and optional extra keys.

    Chaining over the parent hash makes a block's hash depend on the whole prefix
    up to and including the block, which is what its KV depends on.

    BLAKE2b (128-bit digest) over a fixed byte encoding is used rather than
    Python's ``hash()``: ``hash()`` of a str is salted per process, and a 64-bit
    non-cryptographic hash of a tuple lets a client craft two prompts that
    collide and read another request's KV. The encoding is unambiguous: a flag
    byte says whether ``parent_hash`` / ``extra`` are present, each present value
    takes 16 bytes, then every token id takes 8 bytes (little-endian, signed).
    The result is the same in every process and on every machine.

    Args:
        parent_hash: hash of the previous block of the sequence, ``None`` for the
            first block.
        token_ids: the block's token ids (a full block: ``block_size`` tokens).
        extra: anything else the KV depends on (e.g. an adapter id), or ``None``.

    Raises:
        OverflowError: a token id is outside the int64 range, ``parent_hash``
            outside ``[0, 2**128)``, or ``extra`` outside the signed 128-bit range.
    """
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + parent_hash.to_bytes(_HASH_BYTES, "little"))
    if extra is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + extra.to_bytes(_HASH_BYTES, "little", signed=True))
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as e:
        raise OverflowError(f"token ids must fit in int64: {e}") from None
    return int.from_bytes(h.digest(), "little")


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than the free block queue holds.

    Callers check :attr:`BlockPool.num_free_blocks` first; reaching this is a bug.
    """


class Block:
    """One KV cache block: ``block_size`` token slots of every layer's K and V.

    Attributes:
        block_id: index into the KV cache tensors, in ``[0, num_blocks)``.
        ref_cnt: number of block tables (requests) holding this block.
        block_hash: the chained hash of the tokens this block holds, set only while
            the block is registered in the prefix cache; ``None`` otherwise.
        prev_free, next_free: neighbours in the free block queue; both ``None``
            when the block is not in the queue (or is its only element).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        # Not the links: printing them would walk the whole queue.
        h = None if self.block_hash is None else f"{self.block_hash:032x}"[:12]
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head.

    Not a ``collections.deque``: a prefix-cache hit on a free block must take it
    out of the *middle* of the queue, which is O(n) in a deque (and in a list).
    Linking through the blocks' own ``prev_free`` / ``next_free`` fields makes
    :meth:`popleft`, :meth:`append` and :meth:`remove` all O(1) with no
    allocation, and needs no id -> position index.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head: Block | None = None
        self._tail: Block | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: Block) -> bool:
        # A block in the queue has a predecessor, or is the head.
        return block.prev_free is not None or self._head is block

    def __iter__(self) -> Iterator[Block]:
        """Blocks from head (evicted first) to tail."""
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def popleft(self) -> Block:
        """Remove and return the head block.

        Raises:
            IndexError: the queue is empty.
        """
        if self._head is None:
            raise IndexError("popleft from an empty free block queue")
        block = self._head
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        """Put ``block`` at the tail (evicted last).

        Raises:
            ValueError: ``block`` is already in the queue.
        """
        if block in self:
            raise ValueError(f"{block} is already in the free block queue")
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Take ``block`` out of the queue, wherever it is.

        Raises:
            ValueError: ``block`` is not in the queue.
        """
        if block not in self:
            raise ValueError(f"{block} is not in the free block queue")
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All KV cache blocks of one worker: allocation, ref counts, prefix cache.

    Args:
        num_blocks: number of blocks (> 0).
        enable_caching: keep full blocks findable by hash after they are freed.
            When ``False``, :meth:`cache_block` registers nothing and
            :meth:`get_cached_block` always misses.
        enable_kv_events: record KV cache events for :meth:`take_kv_events`.
            Off, nothing is recorded (an engine nobody drains stays bounded).
        reserve_null_block: take block 0 out of circulation as :attr:`null_block`
            (a sliding-window model's placeholder for released blocks).

    Attributes:
        null_block: block 0 when ``reserve_null_block``, else ``None``.
        num_usable_blocks: blocks that can ever be handed out (``num_blocks``,
            less the null block).

    Raises:
        ValueError: ``num_blocks`` < 1, or < 2 with ``reserve_null_block``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_kv_events: bool = False, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # Ids in order, so a fresh pool hands out 0, 1, 2, ...
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block: Block | None = None
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
        self.num_usable_blocks = num_blocks - reserve_null_block
        # One block per hash. If two requests compute the same block, the second
        # stays uncached (see cache_block); its table is never rewritten.
        self.cached_block_hash_to_block: dict[BlockHash, Block] = {}
        self.kv_events = KVEventRecorder(enable_kv_events)
        self.on_blocks_allocated: Callable[[list[int]], None] | None = None
        """Called with the ids :meth:`get_new_blocks` hands out (a new owner's blocks:
        whatever was kept beside their old contents is stale)."""
        self.on_blocks_released: Callable[[list[int]], None] | None = None
        """Called with the ids :meth:`free_blocks` brings to ref count 0."""

    # -- counts -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not (all can be handed out)."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0 (the null block is not counted)."""
        return self.num_usable_blocks - len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self.cached_block_hash_to_block)

    @property
    def num_free_cached_blocks(self) -> int:
        """Free blocks that still carry a hash (evictable cache). O(num_cached_blocks)."""
        return sum(1 for b in self.cached_block_hash_to_block.values() if b.ref_cnt == 0)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use (ref count > 0), in ``[0, 1]``."""
        return self.num_used_blocks / self.num_usable_blocks

    # -- allocation -------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Hand out ``num_blocks`` blocks from the head of the free block queue.

        A cached block handed out here is evicted from the prefix cache. Each
        returned block has ref count 1 and no hash.

        Raises:
            ValueError: ``num_blocks`` < 0.
            NoFreeBlocksError: fewer than ``num_blocks`` free blocks.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if self.on_blocks_allocated is not None and out:
            self.on_blocks_allocated([b.block_id for b in out])
        return out

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the queue tail in order.

        Pass a sequence's blocks tail first so that, among them, its tail blocks
        are evicted before its head blocks. Freed blocks keep their hash. The
        null block is skipped (it holds no references).

        Raises:
            ValueError: a block would go below ref count 0 (a double free); then
                nothing is changed.
        """
        blocks = [b for b in blocks if b is not self.null_block]
        for block, n in Counter(blocks).items():
            if block.ref_cnt < n:
                raise ValueError(f"freeing {block} {n} time(s): double free")
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                released.append(block.block_id)
        if self.on_blocks_released is not None and released:
            self.on_blocks_released(released)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit, or a fork).

        A free block is taken out of the free block queue; it must be cached,
        since the content of a free uncached block is meaningless. The null
        block is skipped.

        Raises:
            ValueError: a block is free and uncached; then nothing is changed.
        """
        blocks = [b for b in blocks if b is not self.null_block]
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(f"touching free uncached {block}: its content is stale")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # -- prefix cache -----------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """The block registered under ``block_hash``, in use or free; ``None`` on a miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register an in-use block whose every token slot is computed under ``block_hash``.

        Returns:
            ``True`` if registered. ``False`` if caching is disabled or another
            block already holds ``block_hash`` (this block then stays uncached
            and is recycled normally once freed), or if ``block`` is already
            registered under this hash.

        Raises:
            ValueError: ``block`` is free, or already cached under another hash.
        """
        if block.ref_cnt == 0 or block is self.null_block:
            raise ValueError(f"caching free {block}: only written, in-use blocks are cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block} is already cached under another hash")
            return False
        if not self.enable_caching or block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.kv_events.stored(block_hash)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every block hash (e.g. after a weight update made all KV stale).

        Blocks in use stay allocated to their requests; they are just no longer
        found by hash. Returns the number of hashes dropped.
        """
        n = len(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.kv_events.cleared()
        return n

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events recorded since the last call, oldest first; clears them.

        Replayed in order onto the hashes known before, they give exactly
        :attr:`cached_block_hash_to_block`'s keys. Always ``[]`` when
        ``enable_kv_events`` is off.
        """
        return self.kv_events.take()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            self.kv_events.removed(block.block_hash)
            block.block_hash = None

    # -- checks -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check the pool's accounting; O(num_blocks).

        Raises:
            AssertionError: naming the first violated invariant.
        """
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
        seen: set[int] = set()
        prev = None
        for block in self.free_block_queue:
            assert block.block_id not in seen, f"{block} is in the free block queue twice"
            assert block.prev_free is prev, f"{block}: broken prev link in the free block queue"
            assert block.ref_cnt == 0, f"{block} is in the free block queue but in use"
            seen.add(block.block_id)
            prev = block
        assert len(seen) == len(self.free_block_queue), (
            f"free block queue length {len(self.free_block_queue)} != {len(seen)} linked blocks")
        null = self.null_block
        if null is not None:
            assert null.block_id not in seen, "the null block is in the free block queue"
            assert null.ref_cnt == 0 and null.block_hash is None, (
                f"the null block {null} holds references or a hash")
        for block in self.blocks:
            if block.ref_cnt == 0 and block is not null:
                assert block.block_id in seen, f"{block} has ref_cnt 0 but is not free"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} carries a hash the prefix cache does not map to it")
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                f"prefix cache maps hash {block_hash:032x} to {block}, which carries another")
        num_in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert len(seen) + num_in_use == self.num_usable_blocks, (
            f"free {len(seen)} + in use {num_in_use} != usable {self.num_usable_blocks}")
