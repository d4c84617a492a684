"""The router's index of which worker holds which cached block: block hash -> worker ids.

Built only from the workers' KV cache events (:mod:`tandem.engine.kv.kv_events`),
the way Dynamo's KV router builds its radix index from vLLM's KV events: a
worker's events, applied in the order it recorded them, leave exactly the set of
block hashes in its prefix cache. A block hash is chained over its parent's
(:func:`~tandem.engine.kv.block_pool.hash_block_tokens`), so a flat hash -> workers
map answers "how many leading blocks of this prompt does worker w hold" by
walking the prompt's hashes until w drops out; no tree is needed.

Per-worker hash sets make dropping a worker (dead, replaced, restarted with an
empty cache) one operation, so stale entries never steer a request to a worker
that no longer has the blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.engine.kv.block_pool import BlockHash, hash_block_tokens
from tandem.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of the prompt blocks a prefix-cache lookup can hit, first block first.

    Computed exactly as the engine does
    (:meth:`~tandem.engine.kv.prefix_cache.PrefixCacheMixin.find_cached_prefix`):
    full blocks only, :func:`~tandem.engine.kv.block_pool.hash_block_tokens` chained
    over the parent hash, and at most ``(len(token_ids) - 1) // block_size``
    blocks, because the last prompt token is always computed (a prompt of
    exactly k full blocks can hit at most k - 1 of them).

    Args:
        token_ids: the prompt's token ids.
        block_size: the worker's block size (tokens per block); workers with
            different block sizes hash different blocks.

    Raises:
        ValueError: ``block_size`` < 1.
        OverflowError: a token id outside int64 (from ``hash_block_tokens``).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(max(len(token_ids) - 1, 0) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Block hash -> the workers whose prefix cache holds it, fed by KV cache events.

    Not thread-safe: the router updates and queries it from its event loop.
    Memory is bounded by the workers' cached blocks (a worker reports a hash
    only while one of its blocks is registered under it).
    """

    def __init__(self) -> None:
        self._workers_of: dict[BlockHash, set[str]] = {}
        self._hashes_of: dict[str, set[BlockHash]] = {}

    def __len__(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._workers_of)

    def hashes_of(self, worker_id: str) -> frozenset[BlockHash]:
        """The block hashes ``worker_id`` holds (empty for an unknown worker)."""
        return frozenset(self._hashes_of.get(worker_id, ()))

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply ``worker_id``'s KV cache events, oldest first.

        A removed hash the index does not hold for the worker is ignored (its
        store may predate a :meth:`remove_worker`).

        Raises:
            TypeError: an event of an unknown type; the events before it are applied.
        """
        for ev in events:
            if isinstance(ev, BlockStored):
                held = self._hashes_of.setdefault(worker_id, set())
                for h in ev.block_hashes:
                    held.add(h)
                    self._workers_of.setdefault(h, set()).add(worker_id)
            elif isinstance(ev, BlockRemoved):
                held = self._hashes_of.get(worker_id)
                if held is None:
                    continue
                for h in ev.block_hashes:
                    if h in held:
                        held.discard(h)
                        self._drop(h, worker_id)
            elif isinstance(ev, AllBlocksCleared):
                self.remove_worker(worker_id)
            else:
                raise TypeError(f"not a KV cache event: {ev!r}")

    def remove_worker(self, worker_id: str) -> int:
        """Forget every hash of ``worker_id`` (it died, was replaced, or cleared its cache).

        Returns:
            The number of hashes dropped (0 for an unknown worker).
        """
        held = self._hashes_of.pop(worker_id, set())
        for h in held:
            self._drop(h, worker_id)
        return len(held)

    def match(self, block_hashes: Sequence[BlockHash],
              worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """How many leading blocks of ``block_hashes`` each worker holds.

        Args:
            block_hashes: a prompt's chained block hashes, first block first
                (:func:`prompt_block_hashes`).
            worker_ids: the workers to consider (default: every worker in the index).

        Returns:
            ``{worker_id: num_blocks}`` for the considered workers, 0 for a
            worker holding not even the first block. O(matched blocks x workers).
        """
        ids = list(self._hashes_of) if worker_ids is None else list(worker_ids)
        counts = dict.fromkeys(ids, 0)
        # Workers still matching; each drops out at its first missing block.
        matching = {w for w in ids if w in self._hashes_of}
        for i, h in enumerate(block_hashes):
            matching &= self._workers_of.get(h, set())
            if not matching:
                break
            for w in matching:
                counts[w] = i + 1
        return counts

    def _drop(self, block_hash: BlockHash, worker_id: str) -> None:
        workers = self._workers_of[block_hash]
        workers.discard(worker_id)
        if not workers:
            del self._workers_of[block_hash]

    def check_invariants(self) -> None:
        """The two maps are each other's inverse, with no empty sets in the hash map.

        Raises:
            AssertionError: naming the first violation.
        """
        for h, workers in self._workers_of.items():
            assert workers, f"hash {h:032x} maps to no worker"
            for w in workers:
                assert h in self._hashes_of.get(w, ()), (
                    f"hash {h:032x} lists worker {w!r}, whose hash set lacks it")
        for w, held in self._hashes_of.items():
            for h in held:
                assert w in self._workers_of.get(h, ()), (
                    f"worker {w!r} holds hash {h:032x}, which does not list it")
