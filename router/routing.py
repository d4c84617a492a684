"""Routing policies: which decode worker and which prefill worker get a request.

DESIGN.md step 2: a decode worker is picked by free KV blocks, running batch
size and longest cached prefix; a prefill worker by queued prefill tokens and
cached prefix. Policies are registered by their config string
(:data:`ROUTING_POLICIES`, :func:`make_routing_policy`):

* ``least_loaded`` (:class:`LeastLoadedPolicy`): load only.
* ``prefix_aware`` (:class:`PrefixAwarePolicy`): the worker holding the longest
  cached prefix of the prompt, unless it is overloaded; least-loaded otherwise
  and to break ties. It learns what each worker caches from the workers' KV
  cache events (:meth:`RoutingPolicy.on_kv_events`).

A policy sees workers as :class:`~tandem.router.registry.WorkerHandle` (their
``stats``, ``inflight_prefill_tokens``, ``info["block_size"]``); it picks, and
the caller accounts for the pick (e.g. adds the prompt to the prefill worker's
``inflight_prefill_tokens``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.engine.kv.kv_events import KVEvent
from tandem.router.prefix_index import PrefixIndex, prompt_block_hashes
from tandem.router.registry import WorkerHandle


def decode_load_key(w: WorkerHandle) -> tuple:
    """Least-loaded order of decode-side workers (smaller is less loaded): most free
    KV blocks, then fewest running + waiting requests, then worker id. A worker
    with no stats yet sorts as if it had 0 free blocks and no requests."""
    s = w.stats
    if s is None:
        return (0, 0, w.worker_id)
    return (-s.num_free_blocks, s.num_running + s.num_waiting, w.worker_id)


def prefill_load_key(w: WorkerHandle) -> tuple:
    """Least-loaded order of prefill workers: fewest in-flight prefill tokens, then id."""
    return (w.inflight_prefill_tokens, w.worker_id)


def _alive(workers: Sequence[WorkerHandle], kind: str) -> list[WorkerHandle]:
    alive = [w for w in workers if w.alive]
    if not alive:
        raise RuntimeError(f"no {kind} worker is alive")
    return alive


class RoutingPolicy(ABC):
    """Picks workers for a request. Picking mutates nothing; only
    :meth:`on_kv_events` and :meth:`forget_worker` change the policy's state.

    Decode side, as a score: a policy ranks the decode-side workers
    (:meth:`decode_candidates`), each with a *cost* in requests; the worker
    picked is the one with the smallest ``in-flight requests + cost``, the first
    in rank order on ties. In-flight requests are those every router has sent
    to the worker and not seen finish; with several routers the pick and the
    reservation are one atomic step in the cluster state
    (:class:`tandem.control.reservations.Reservations`), so routers do not all
    pick the same worker from the same stale stats. :meth:`pick_decode` is the
    same rule on a local count.
    """

    name: str = ""

    @abstractmethod
    def decode_candidates(self, workers: Sequence[WorkerHandle],
                          prompt_token_ids: Sequence[int]) -> list[tuple[WorkerHandle, float]]:
        """The alive decode-side workers with their costs (requests), in tie-break order.

        Args:
            workers: the decode-side workers; dead ones are skipped.
            prompt_token_ids: the request's prompt.

        Raises:
            RuntimeError: none of ``workers`` is alive.
        """

    def pick_decode(self, workers: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
                    inflight: Mapping[str, int] | None = None) -> WorkerHandle:
        """The decode (or colocated) worker that runs the request's decode steps: the
        smallest ``inflight[worker] + cost`` (:meth:`decode_candidates`), first on ties.

        Args:
            workers: the decode-side workers; dead ones are skipped.
            prompt_token_ids: the request's prompt.
            inflight: requests in flight per worker id (missing = 0).

        Raises:
            RuntimeError: none of ``workers`` is alive.
        """
        inflight = inflight or {}
        ranked = self.decode_candidates(workers, prompt_token_ids)
        return min(enumerate(ranked),
                   key=lambda ic: (inflight.get(ic[1][0].worker_id, 0) + ic[1][1], ic[0]))[1][0]

    @abstractmethod
    def pick_prefill(self, workers: Sequence[WorkerHandle],
                     prompt_token_ids: Sequence[int]) -> WorkerHandle:
        """The prefill worker that runs the prompt.

        Args:
            workers: the prefill workers; dead ones are skipped.
            prompt_token_ids: the request's prompt.

        Raises:
            RuntimeError: none of ``workers`` is alive.
        """

    def on_kv_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """A worker's KV cache events (from its step output), oldest first. Ignored by default."""

    def forget_worker(self, worker_id: str) -> None:
        """The worker died, was replaced or removed: drop what is known about it."""


class LeastLoadedPolicy(RoutingPolicy):
    """Decode: fewest in-flight requests, ties in :func:`decode_load_key` order (all
    costs 0); prefill: :func:`prefill_load_key`. Ignores the prompt."""

    name = "least_loaded"

    def decode_candidates(self, workers: Sequence[WorkerHandle],
                          prompt_token_ids: Sequence[int]) -> list[tuple[WorkerHandle, float]]:
        return [(w, 0.0) for w in sorted(_alive(workers, "decode"), key=decode_load_key)]

    def pick_prefill(self, workers: Sequence[WorkerHandle],
                     prompt_token_ids: Sequence[int]) -> WorkerHandle:
        return min(_alive(workers, "prefill"), key=prefill_load_key)


class PrefixAwarePolicy(RoutingPolicy):
    """Longest cached prefix wins unless overloaded; least-loaded is the fallback.

    A worker's cached prefix of a prompt is the number of leading prompt blocks
    (hashed at that worker's block size, :func:`prompt_block_hashes`) whose hashes
    its KV cache events say it holds, counted in tokens.

    Decode side (the score of :class:`RoutingPolicy`). A worker holding a cached
    prefix of ``h`` of the prompt's ``n`` tokens gets the credit
    ``max_extra_requests * h / n`` requests (cost = minus the credit), unless
    its ``kv_cache_usage`` exceeds ``max_kv_usage`` (no credit: its cache is
    about to be evicted anyway). So a worker holding the whole prompt wins
    unless it has more than ``max_extra_requests`` in-flight requests beyond
    another worker's; among equal scores the longer prefix wins, then the least
    loaded (:func:`decode_load_key`). With no hits anywhere this is exactly
    least-loaded. (The overlap-plus-load score of Dynamo's KV-aware router.)

    Prefill side. A prefill worker's cost for the prompt is its in-flight prefill
    tokens plus the prompt tokens it would compute (prompt length minus its
    cached prefix); the cheapest wins, ties going to the longer prefix, then to
    the least loaded (:func:`prefill_load_key`). So the longest prefix wins
    unless its worker's queue is longer than another's by more than the tokens
    the hit saves, and with no hits anywhere this is exactly least-loaded.

    Args:
        max_kv_usage: fraction of KV blocks in use (0..1] above which a decode
            worker takes no request for its cache.
        max_extra_requests: the credit (in-flight requests, >= 0) of a decode
            worker that holds the whole prompt: it may have this many requests
            more than another worker and still win on its cache.

    Raises:
        ValueError: a parameter out of range.
    """

    name = "prefix_aware"

    def __init__(self, max_kv_usage: float = 0.9, max_extra_requests: int = 8) -> None:
        if not 0.0 < max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {max_kv_usage}")
        if max_extra_requests < 0:
            raise ValueError(f"max_extra_requests must be >= 0, got {max_extra_requests}")
        self.max_kv_usage = max_kv_usage
        self.max_extra_requests = max_extra_requests
        self.index = PrefixIndex()

    def on_kv_events(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self.index.apply(worker_id, events)

    def forget_worker(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)

    def cached_prefix_tokens(self, workers: Sequence[WorkerHandle],
                             prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """``{worker_id: tokens}`` of the prompt's leading blocks each worker holds.

        0 for a worker whose ``info`` has no ``block_size`` (its hashes cannot be
        computed). Hashes the prompt once per distinct block size.
        """
        by_block_size: dict[int, list[str]] = {}
        hits = {w.worker_id: 0 for w in workers}
        for w in workers:
            if w.block_size is not None:
                by_block_size.setdefault(w.block_size, []).append(w.worker_id)
        for block_size, ids in by_block_size.items():
            hashes = prompt_block_hashes(prompt_token_ids, block_size)
            for worker_id, num_blocks in self.index.match(hashes, ids).items():
                hits[worker_id] = num_blocks * block_size
        return hits

    def decode_candidates(self, workers: Sequence[WorkerHandle],
                          prompt_token_ids: Sequence[int]) -> list[tuple[WorkerHandle, float]]:
        alive = _alive(workers, "decode")
        hits = self.cached_prefix_tokens(alive, prompt_token_ids)
        n = max(1, len(prompt_token_ids))

        def credit(w: WorkerHandle) -> float:
            if w.stats is not None and w.stats.kv_cache_usage > self.max_kv_usage:
                return 0.0
            return self.max_extra_requests * hits[w.worker_id] / n
        ranked = sorted(alive, key=lambda w: (-credit(w), decode_load_key(w)))
        return [(w, -credit(w)) for w in ranked]

    def pick_prefill(self, workers: Sequence[WorkerHandle],
                     prompt_token_ids: Sequence[int]) -> WorkerHandle:
        alive = _alive(workers, "prefill")
        hits = self.cached_prefix_tokens(alive, prompt_token_ids)
        n = len(prompt_token_ids)

        def cost(w: WorkerHandle) -> tuple:
            h = hits[w.worker_id]
            return (w.inflight_prefill_tokens + n - h, -h, prefill_load_key(w))
        return min(alive, key=cost)


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
}


def make_routing_policy(name: str, **params: Any) -> RoutingPolicy:
    """The policy registered as ``name`` (the ``routing_policy`` config string).

    Args:
        name: a key of :data:`ROUTING_POLICIES`.
        params: the policy's constructor arguments (e.g. ``max_kv_usage``).

    Raises:
        ValueError: unknown ``name`` (naming the field and the known names), or
            a parameter the policy refuses.
        TypeError: a parameter the policy does not take.
    """
    try:
        cls = ROUTING_POLICIES[name]
    except KeyError:
        raise ValueError(f"routing_policy: unknown {name!r}, "
                         f"expected one of {', '.join(ROUTING_POLICIES)}") from None
    return cls(**params)
