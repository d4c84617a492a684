"""Consumer side of disaggregation in the scheduler: requests whose prompt KV comes from
another engine.

A remote-prefill request waits in the ordinary waiting queue and is admitted in
(priority, arrival) order like any other, so a reservation is never refused
merely because other requests wait: it waits its turn. On admission its blocks
for the whole prompt are reserved (prefix-cache hits reused; with a sliding window
on every layer, only the blocks its first decode reads) and it moves here,
in state ``WAITING_FOR_REMOTE_KV``, until

* every layer landed (the KV connector says so) **and** its first token, sampled
  by the prefill engine, is known: it joins the running queue with its whole
  prompt computed;
* the load failed, or the remote prefill was given up: its blocks are freed and
  it goes back to the waiting queue to be prefilled here (recompute), keeping a
  first token it already has;
* it is aborted: while layers may still land in its blocks they stay reserved
  (an *orphaned* load) and are freed when the connector reports the load ended,
  so no block is reused under an in-flight write and none is leaked.

Blocks of a load that did not complete never enter the prefix cache: blocks are
registered by hash only once their tokens are computed (landed) here.
"""

from __future__ import annotations

from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.scheduling.request import Request, RequestStatus


class RemoteKVRequests:
    """The ``WAITING_FOR_REMOTE_KV`` requests of one scheduler and their orphaned loads.

    Args:
        kv: the scheduler's KV cache manager (blocks are reserved and freed through it).

    Attributes:
        requests: reserved requests, in admission order.
        orphaned: ids of aborted requests whose load has not ended; their blocks
            are still allocated under these ids.
    """

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.requests: list[Request] = []
        self.orphaned: set[str] = set()

    def __len__(self) -> int:
        return len(self.requests)

    def reserve(self, req: Request) -> bool:
        """Reserve blocks for ``req``'s whole prompt; False (nothing changed) if they do not fit.

        With a sliding window only the blocks its first decode step reads are
        reserved (that step's query, the first output token, is at position
        ``num_prompt_tokens``); the slots before them hold the null block and
        receive nothing (:meth:`num_tokens_not_received`)."""
        rid = req.request_id
        blocks, num_cached = self.kv.get_computed_blocks(rid, req.prompt_token_ids)
        if not self.kv.allocate_slots(rid, num_cached, req.num_prompt_tokens - num_cached, blocks,
                                      first_query_position=req.num_prompt_tokens):
            return False
        req.num_cached_tokens = req.num_computed_tokens = num_cached
        req.kv_load_finished = req.kv_load_ok = False
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests.append(req)
        return True

    def num_tokens_not_received(self, req: Request) -> int:
        """Leading prompt tokens of reserved ``req`` whose KV the transfer need not
        bring: those cached here, and those before its first block inside the
        sliding window (null slots). A multiple of the block size."""
        skipped = self.kv.num_skipped_blocks(req.request_id) * self.kv.block_size
        return max(req.num_cached_tokens, skipped)

    def load_finished(self, req: Request | None, request_id: str, ok: bool) -> bool:
        """The connector reports the end of ``request_id``'s load (``ok``: every layer landed).

        Returns:
            True if ``req`` must now go back to the waiting queue (prefill here).
        """
        if request_id in self.orphaned:
            self.orphaned.discard(request_id)
            self.kv.free(request_id)
            return False
        if req is None or req not in self.requests:
            return False
        req.kv_load_finished, req.kv_load_ok = True, ok
        if ok and req.needs_remote_kv:
            return False            # joins the running queue once its first token is known
        self.kv.free(request_id)
        # Without a first token a failed load waits for the router's word: the first
        # token (the prefill succeeded) or that the remote prefill failed (give_up).
        return self._requeue_if_possible(req)

    def set_first_token(self, req: Request) -> bool:
        """``req``'s first token (sampled by the prefill engine) was appended.

        Returns:
            True if it must go back to the waiting queue (its load already failed).
        """
        return req.kv_load_finished and not req.kv_load_ok and self._requeue_if_possible(req)

    def give_up(self, req: Request) -> bool:
        """The remote prefill failed: prefill ``req`` here.

        Returns:
            True if it goes to the waiting queue now; False while its load is in
            flight (the caller cancels the load; :meth:`load_finished` requeues it).
        """
        req.kv_transfer_params = None
        if not req.kv_load_finished:
            return False
        if req.kv_load_ok:       # landed, but the prefill engine failed after: recompute
            self.kv.free(req.request_id)
        return self._requeue_if_possible(req)

    def _requeue_if_possible(self, req: Request) -> bool:
        if req.needs_remote_kv and req.num_output_tokens == 0:
            return False
        req.kv_transfer_params = None
        self.requests.remove(req)
        req.num_computed_tokens = 0
        return True

    def take_ready(self) -> list[Request]:
        """Remove and return the requests whose KV landed and whose first token is known."""
        ready = [r for r in self.requests
                 if r.kv_load_ok and r.needs_remote_kv and r.num_output_tokens > 0]
        for r in ready:
            self.requests.remove(r)
            r.num_computed_tokens = r.num_prompt_tokens
        return ready

    def abort(self, req: Request) -> bool:
        """Take an aborted ``req`` out. Returns True if its load is in flight: its blocks
        stay reserved (orphaned) until the load ends, and the caller cancels the load."""
        self.requests.remove(req)
        if req.kv_load_finished:
            return False
        self.orphaned.add(req.request_id)
        return True

    def check_invariants(self, registered: dict[str, Request]) -> None:
        """Raises AssertionError naming the first broken invariant."""
        kv = self.kv
        for r in self.requests:
            rid = r.request_id
            assert registered.get(rid) is r, f"remote-KV request {rid!r} is not registered"
            assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV, (
                f"remote-KV request {rid!r} has status {r.status}")
            holds = kv.num_blocks_of(rid) > 0
            loading = not r.kv_load_finished
            assert holds == (loading or (r.kv_load_ok and r.needs_remote_kv)), (
                f"remote-KV request {rid!r}: holds blocks {holds}, load finished "
                f"{r.kv_load_finished}, ok {r.kv_load_ok}")
        for rid in self.orphaned:
            assert rid not in registered, f"orphaned load {rid!r} belongs to a live request"
            assert kv.num_blocks_of(rid) > 0, f"orphaned load {rid!r} holds no blocks"
