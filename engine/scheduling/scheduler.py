"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Every step the scheduler decides, for each request, how many of its not yet
computed tokens to run (``num_new_tokens``): 1 for a decode, a chunk of the
prompt for a prefill. Requests join and leave between steps. The design follows
vLLM v1's unified scheduler (no separate prefill/decode phases):

    request tokens:  [ computed (KV in cache) | new this step | not yet scheduled ]
                     0                 num_computed   num_computed+num_new   num_tokens

Three queues, each in :attr:`Request.sort_key` order (priority, then arrival):
*running* (blocks on the device), *swapped* (blocks in host memory) and
*waiting* (new requests, and requests preempted by recompute). One step:

1. **Priority preemption** (vLLM v0's priority scheduling): if the first request
   waiting to start (head of swapped + waiting) is more important than the least
   important running request and lacks blocks or a sequence slot, running
   requests less important than it are preempted until it fits.
2. **Running** requests get their tokens, most important first. When one's next
   tokens do not fit, the least important, latest-arrived running request is
   preempted until they do (or until it was itself the victim). How a victim
   gives up its blocks - swapped out to host memory, or freed to be recomputed -
   is the preemption policy's choice (:mod:`tandem.engine.scheduling.preemption`; Kwon et
   al. 2023, section 4.5).
3. Only if step 2 preempted nothing: **swapped** requests are swapped in and
   **waiting** requests admitted, merged in (priority, arrival) order, while
   token budget, sequence slots and blocks last. The first that does not fit
   ends the step's admissions: no request overtakes an earlier one of the same
   priority, so a swapped (or recompute-preempted) request resumes before any
   request that arrived after it.
   With ``burst_prefill_tokens`` set, a waiting prompt also does not fit when
   the step already holds prompt tokens and this one would take them past
   ``burst_prefill_tokens x (the step's decodes + 1)``: a burst of prompts that
   arrives together is spread over steps, more of it per step the more
   sequences decode; a burst larger than two steps' budgets is left to the
   budget (serving's default; measured in benchmarks/README.md).

No starvation. A request is preempted only in favour of requests that sort
before it: in step 2 the victim is the last running request and the one that
needs blocks sorts before it (or is the victim itself, when the requests before
it hold the blocks); in step 1 only for a strictly more important request. So
the first running request in sort order is never preempted while others run; it
is scheduled first every step, and a lone request always fits in the pool (the
engine caps ``max_model_len`` at the pool's size; for a model with a sliding
window on every layer and chunked prefill it checks instead that the pool holds
one step's blocks, :meth:`KVCacheManager.max_blocks_per_step`), so it progresses and
finishes. Preempted requests go back into their queue at their original
position and resume before everything that arrived after them. By induction
over the sort order, every request finishes in a bounded number of steps as
long as the requests more important than it are finitely many. Strict priority
means an endless stream of more important requests can hold a less important
one back indefinitely, as in vLLM's priority policy; within one priority the
order is first come, first served. A decode worker's reservations for prompts
prefilled elsewhere are waiting requests like any other, admitted in the same
order (:mod:`tandem.engine.scheduling.remote_kv`), so they cannot keep a preempted request
out either; while reserved they are never preemption victims (layers are
landing in their blocks) and count against ``max_num_seqs``.
"""

from __future__ import annotations

import bisect

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.scheduling.preemption import PreemptionMode, get_preemption_policy
from tandem.engine.scheduling.remote_kv import RemoteKVRequests
from tandem.engine.scheduling.request import Request, RequestStatus
from tandem.engine.scheduling.scheduler_output import ScheduledRequest, SchedulerOutput
from tandem.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sort_key(r: Request):
    return r.sort_key


class Scheduler:
    """Running, swapped and waiting queues over one :class:`KVCacheManager`.

    Args:
        config: budget and policy.
        kv_cache_manager: the block accounting of this engine's KV cache.
        max_model_len: context limit in tokens (prompt + output).
        bytes_per_block: one KV block across all layers (bytes), for the
            preemption cost model.

    Attributes:
        num_swap_preemptions, num_recompute_preemptions: preemptions so far, by mode.
        spec_stats: speculative decoding's draft and acceptance counts.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, bytes_per_block: int = 0):
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.preemption_policy = get_preemption_policy(config, bytes_per_block)
        self.waiting: list[Request] = []   # sorted by Request.sort_key
        self.running: list[Request] = []   # sorted by Request.sort_key
        self.swapped: list[Request] = []   # sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        # Consumer side of disaggregation: blocks reserved, prompt KV landing.
        self.remote_kv = RemoteKVRequests(kv_cache_manager)
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # A whole prompt must fit in one step's budget.
            budget = max(budget, max_model_len)
        self.token_budget = budget

    # -- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (and, for n > 1, remember its forks).

        Raises:
            ValueError: its id is already in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        for child in request.pending_forks:
            self.requests[child.request_id] = child
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_sort_key)

    def finish_kv_load(self, request_id: str, ok: bool) -> None:
        """The KV connector reports that a remote-prefill request's load ended
        (``ok``: every layer landed); see :mod:`tandem.engine.scheduling.remote_kv`."""
        req = self.requests.get(request_id)
        if self.remote_kv.load_finished(req, request_id, ok):
            self._requeue(req)

    def set_remote_first_token(self, request_id: str, token_id: int, logprobs=None) -> Request:
        """Give a remote-prefill request the first token its prefill engine sampled.

        Raises:
            KeyError: no such request waiting for remote KV (aborted, or never added).
        """
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KV \
                or req.num_output_tokens:
            raise KeyError(f"request_id: {request_id!r} is not waiting for its first token")
        req.output_token_ids.append(token_id)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        if self.remote_kv.set_first_token(req):
            self._requeue(req)
        return req

    def give_up_remote_prefill(self, request_id: str) -> bool:
        """The remote prefill of a request failed: compute its prompt here instead.

        Returns:
            True if its load is still in flight (the caller cancels it; the request
            is requeued when the load ends). False otherwise, also when the request
            computes its prompt here already (its own KV load timed out first).

        Raises:
            KeyError: no such request (aborted or finished).
        """
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id: {request_id!r} is not waiting for remote KV")
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            if req.needs_remote_kv:     # not reserved yet
                req.kv_transfer_params = None
            return False
        if self.remote_kv.give_up(req):
            self._requeue(req)
            return False
        return not req.kv_load_finished

    def _requeue(self, req: Request) -> None:
        """Back to the waiting queue, to be prefilled here (keeps its output so far)."""
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_sort_key)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks (device or host).
        Unknown or finished ids are ignored (returns None)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        for child in req.pending_forks:    # forks that never started go with their parent
            self._finish(child, RequestStatus.FINISHED_ABORTED)
        req.pending_forks = []
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        """Requests to run, or remote KV loads (of live or aborted requests) to collect."""
        return bool(self.waiting or self.running or self.swapped or self.remote_kv.requests
                    or self.remote_kv.orphaned)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far, swap and recompute together."""
        return self.num_swap_preemptions + self.num_recompute_preemptions

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate, swap and preempt blocks."""
        out = SchedulerOutput()
        for req in self.remote_kv.take_ready():      # remote prefill landed: decode now
            req.kv_transfer_params = None
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_sort_key)
        self._preempt_for_priority(out)
        budget = self.token_budget
        running_preempted = False
        num_decoding = num_prefill_tokens = 0     # this step's (burst_prefill_tokens)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            if num_new == 1:
                num_decoding += 1
            else:
                num_prefill_tokens += num_new
            spec, draft_probs = self._spec_tokens(req, num_new, budget)
            num_new += len(spec)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                running_preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: everything after it is gone too
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new, spec,
                                                  draft_probs))
            budget -= num_new
            i += 1

        # Resume and admit only when the running requests fit: otherwise the
        # blocks just freed would be handed straight back and preempted again.
        burst = self._burst_tokens()
        while (not running_preempted and budget > 0
               and len(self.running) + len(self.remote_kv) < self.config.max_num_seqs):
            req = self._next_to_start()
            if req is None:
                break
            if req.status is RequestStatus.SWAPPED:
                num_new = self._swap_in(req, budget, out)
            elif req.needs_remote_kv:
                num_new = self._reserve_remote(req, out)
            else:
                room = self._burst_room(burst, num_prefill_tokens, num_decoding)
                num_new = self._admit(req, budget, out, room)
                num_prefill_tokens += num_new or 0
            if num_new is None:
                break
            budget -= num_new
        out.block_copies = self.kv.take_pending_copies()
        out.blocks_to_swap_out, out.blocks_to_swap_in = self.kv.take_pending_swaps()
        return out

    def _spec_tokens(self, req: Request, num_new: int, budget: int) -> tuple[tuple[int, ...], object]:
        """The draft tokens (and their proposal distributions) to verify with
        ``req``'s decode this step: as many as the token budget, ``max_tokens`` and
        the context length leave (drafts past those could never be emitted). Only a
        step that decodes the request's last token verifies; the drafts are
        consumed either way."""
        if not req.spec_token_ids:
            return (), None
        spec, req.spec_token_ids = req.spec_token_ids, []
        probs, req.spec_draft_probs = req.spec_draft_probs, None
        if num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return (), None
        limit = min(budget - num_new, self.max_spec_tokens(req), len(spec))
        if limit <= 0:
            return (), None
        return tuple(spec[:limit]), (None if probs is None else probs[:limit])

    def max_spec_tokens(self, req: Request) -> int:
        """Drafts ``req`` can still use in one step: one token (the bonus) always
        follows the accepted drafts, within ``max_tokens`` and the context length."""
        return min(req.sampling_params.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens) - 1

    def _next_to_start(self) -> Request | None:
        """The head of the swapped and waiting queues, whichever sorts first."""
        if self.swapped and (not self.waiting
                             or self.swapped[0].sort_key <= self.waiting[0].sort_key):
            return self.swapped[0]
        return self.waiting[0] if self.waiting else None

    def _swap_in(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Swap ``req`` in and schedule its next tokens; returns how many (None: no room)."""
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.kv.num_free_blocks < self._blocks_to_swap_in(req, num_new):
            return None
        rid = req.request_id
        if not (self.kv.swap_in(rid)
                and self.kv.allocate_slots(rid, req.num_computed_tokens, num_new)):
            raise RuntimeError(f"swap-in of {rid!r} failed after its blocks were counted: "
                               "the block accounting is inconsistent")
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_sort_key)
        out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
        return num_new

    def _blocks_to_swap_in(self, req: Request, num_new: int) -> int:
        """Free device blocks a swap-in plus ``num_new`` tokens take. The tokens
        need no copy-on-write: the blocks found by hash are full, computed ones."""
        num_table = (len(self.kv.get_host_block_ids(req.request_id))
                     + self.kv.num_skipped_blocks(req.request_id))   # null slots: no copy
        extra = max(0, _cdiv(req.num_computed_tokens + num_new, self.kv.block_size) - num_table)
        return self.kv.num_blocks_to_swap_in(req.request_id) + extra

    def _reserve_remote(self, req: Request, out: SchedulerOutput) -> int | None:
        """Reserve blocks for a remote-prefill request's prompt; it computes nothing
        here, so it takes no token budget. Returns 0 (None: no room)."""
        if not self.remote_kv.reserve(req):
            return None
        self.waiting.remove(req)
        out.kv_loads_to_start.append(req)
        return 0

    def _burst_tokens(self) -> int | None:
        """The prompt tokens waiting to be computed here (None: no burst rule)."""
        if self.config.burst_prefill_tokens is None:
            return None
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting
                   if not r.needs_remote_kv)

    def _burst_room(self, burst: int | None, num_prefill_tokens: int,
                    num_decoding: int) -> int | None:
        """Prompt tokens a new prompt may add to a step that holds ``num_prefill_tokens``
        of them beside ``num_decoding`` decodes, ``burst`` prompt tokens waiting
        (``SchedulerConfig.burst_prefill_tokens``); None: no limit. A burst larger than
        two steps' budgets is spread over steps by the budget already: not limited."""
        per_seq = self.config.burst_prefill_tokens
        if per_seq is None or num_prefill_tokens == 0 or burst > 2 * self.token_budget:
            return None
        return per_seq * (num_decoding + 1) - num_prefill_tokens

    def _admit(self, req: Request, budget: int, out: SchedulerOutput,
               room: int | None = None) -> int | None:
        """Start a waiting request's (next) prefill chunk; returns its tokens (None: no
        room: blocks, or ``room``, the prompt tokens this step may still take whole)."""
        blocks, num_cached = self._computed_blocks(req)
        num_new = req.num_tokens - num_cached
        if room is not None and num_new > room:
            return None
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        if not self.kv.allocate_slots(req.request_id, num_cached, num_new, blocks):
            return None
        self.waiting.remove(req)
        if req.status is RequestStatus.WAITING:   # first admission, not a resumed preemption
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_sort_key)
        out.scheduled.append(ScheduledRequest(req, num_cached, num_new))
        return num_new

    def _computed_blocks(self, req: Request) -> tuple[list, int]:
        """``req``'s prefix-cache hits, as :meth:`KVCacheManager.get_computed_blocks`.

        None while its prompt logprobs are incomplete: a cached position has no
        logits to take them from (as in vLLM). Its blocks are still cached for
        others once computed."""
        if req.needs_prompt_logprobs:
            return [], 0
        return self.kv.get_computed_blocks(req.request_id, req.all_token_ids)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Step 1: make room for a waiting request more important than running ones.

        Preempts, least important first, running requests strictly less important
        than the head of swapped + waiting, while that head could not start this
        step: too few free blocks for it and the running requests' next tokens,
        or no free sequence slot.
        """
        head = self._next_to_start()
        if head is None or not self.running or self.running[-1].priority <= head.priority:
            return
        head_need = self._blocks_to_start(head)

        def short() -> bool:
            if len(self.running) >= self.config.max_num_seqs:
                return True
            need = head_need + sum(self._blocks_to_continue(r) for r in self.running)
            return self.kv.num_free_blocks < need

        while self.running and self.running[-1].priority > head.priority and short():
            self._preempt(self.running[-1], out)

    def _blocks_to_start(self, req: Request) -> int:
        """Free blocks ``req`` (swapped or waiting) would take to start now."""
        if req.status is RequestStatus.SWAPPED:
            return self._blocks_to_swap_in(
                req, min(req.num_tokens - req.num_computed_tokens, self.token_budget))
        hits = [] if req.needs_prompt_logprobs else self.kv.find_cached_prefix(req.all_token_ids)
        num_cached = len(hits) * self.kv.block_size
        num_new = min(req.num_tokens - num_cached, self.token_budget)
        return self.kv.num_new_blocks_needed(req.request_id, num_cached, num_new, hits)

    def _blocks_to_continue(self, req: Request) -> int:
        """Free blocks a running request's next tokens would take."""
        num_new = min(req.num_tokens - req.num_computed_tokens, self.token_budget)
        if num_new <= 0:
            return 0
        return self.kv.num_new_blocks_needed(req.request_id, req.num_computed_tokens, num_new)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device, by swap or recompute (policy's choice)."""
        self.running.remove(req)
        mode = self.preemption_policy.choose(req, self.kv)
        if mode is PreemptionMode.SWAP and self.kv.swap_out(req.request_id):
            req.status = RequestStatus.SWAPPED
            self.num_swap_preemptions += 1
            bisect.insort(self.swapped, req, key=_sort_key)
        else:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.num_recompute_preemptions += 1
            # Back at its own place in the order: ahead of everything that arrived later.
            bisect.insort(self.waiting, req, key=_sort_key)
        req.num_preemptions += 1
        out.preempted.append(req)

    # -- after the forward pass ------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list],
               prompt_logprobs: dict[str, list] | None = None) -> list[Request]:
        """Advance requests by the step's results.

        Args:
            out: the step's :class:`SchedulerOutput`.
            sampled: request id -> list of :class:`~tandem.engine.sampling.sampler.SampleResult`;
                one per sampling request, ``1 + len(pending_forks)`` for a parent
                whose prompt just finished (the forks' first tokens follow its own).
            prompt_logprobs: request id -> the :class:`TokenLogprobs` of the prompt
                positions this step computed, continuing :attr:`Request.prompt_logprobs`.

        Returns:
            Requests that got a new token or finished this step (forks included).
        """
        changed: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if s.spec_token_ids:
                self._update_speculative(s, sampled[req.request_id])
                changed.append(req)
                continue
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            if prompt_logprobs and req.request_id in prompt_logprobs:
                req.prompt_logprobs.extend(prompt_logprobs[req.request_id])
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if not s.samples:
                continue
            results = sampled[req.request_id]
            forks, req.pending_forks = req.pending_forks, []
            for child, res in zip(forks, results[1:]):
                if child.is_finished:
                    continue  # aborted before its parent's prompt was computed
                self.kv.fork(req.request_id, child.request_id)
                child.num_computed_tokens = req.num_computed_tokens
                child.num_cached_tokens = req.num_cached_tokens
                child.prompt_logprobs = req.prompt_logprobs     # complete: shared, not copied
                child.status = RequestStatus.RUNNING
                bisect.insort(self.running, child, key=_sort_key)
                self._append_token(child, res)
                changed.append(child)
            self._append_token(req, results[0])
            changed.append(req)
        return changed

    def _update_speculative(self, s: ScheduledRequest, results: list) -> None:
        """A decode step that verified ``s.spec_token_ids``: ``results[j]`` is the token
        chosen after position ``j`` of the step. Accepted drafts and the bonus token
        are appended; drafts after the first rejected one leave no KV that counts
        (their slots are written again later) and are never cached."""
        req = s.request
        accepted = len(results) - 1     # Sampler.verify: the accepted drafts, then one more
        self.spec_stats.observe(len(s.spec_token_ids), accepted)
        req.num_computed_tokens = s.num_computed_tokens + 1 + accepted
        for res in results[:accepted + 1]:
            self._append_token(req, res)
            if req.is_finished:           # a stop inside the run ends the request there
                return
        self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)

    def _append_token(self, req: Request, res) -> None:
        """Append one sampled token; finish the request on EOS, a stop token id,
        the end of its structured-output grammar (whatever ``ignore_eos`` and
        ``min_tokens`` say: nothing may follow it), ``max_tokens`` or the context limit."""
        req.output_token_ids.append(res.token_id)
        if res.logprobs is not None:
            req.output_logprobs.append(res.logprobs)
        p = req.sampling_params
        t = res.token_id
        if getattr(res, "grammar_ended", False):
            req.stop_reason = None
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            return
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and t == req.eos_token_id:
                req.stop_reason = None
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return
            if t in p.stop_token_ids:
                req.stop_reason = t
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start ``child``, whose tokens extend ``parent``'s, where ``parent`` stands
        (a beam search's new beam; :mod:`tandem.engine.runtime.beam_search`).

        A running parent's blocks are shared (:meth:`KVCacheManager.fork`: ref
        counts, copy-on-write of a shared last block when the child writes) and the
        child runs with the parent's computed tokens. A parent off the device
        (preempted: waiting or swapped) lends nothing: the child waits and is
        prefilled, taking prefix-cache hits.

        Raises:
            ValueError: ``child``'s id is already in use.
        """
        if child.request_id in self.requests:
            raise ValueError(f"request_id: {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        if parent.status is RequestStatus.RUNNING and self.kv.num_blocks_of(parent.request_id):
            self.kv.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            bisect.insort(self.running, child, key=_sort_key)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            bisect.insort(self.waiting, child, key=_sort_key)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """End a request from outside (e.g. a matched stop string) and free its blocks."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        orphaned = False
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            # Layers may still land in its blocks: they are freed when the load ends.
            orphaned = self.remote_kv.abort(req)
        for queue in (self.running, self.swapped, self.waiting):
            if req in queue:
                queue.remove(req)
                break
        if not orphaned:
            self.kv.free(req.request_id)
        req.status = status
        self.requests.pop(req.request_id, None)

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Queues agree with request states and with the KV cache manager; then
        :meth:`KVCacheManager.check_invariants` (device and host pools).

        Raises:
            AssertionError: naming the first violated invariant.
        """
        kv = self.kv
        seen: set[str] = set()
        for name, queue, states in (
                ("running", self.running, {RequestStatus.RUNNING}),
                ("swapped", self.swapped, {RequestStatus.SWAPPED}),
                ("waiting", self.waiting, {RequestStatus.WAITING, RequestStatus.PREEMPTED})):
            keys = [r.sort_key for r in queue]
            assert keys == sorted(keys), f"the {name} queue is out of (priority, arrival) order"
            for r in queue:
                rid = r.request_id
                assert rid not in seen, f"request {rid!r} is in two queues"
                seen.add(rid)
                assert self.requests.get(rid) is r, f"{name} request {rid!r} is not registered"
                assert r.status in states, f"{name} request {rid!r} has status {r.status}"
                assert kv.is_swapped(rid) == (name == "swapped"), (
                    f"{name} request {rid!r}: swapped in the KV cache manager is "
                    f"{kv.is_swapped(rid)}")
                if name == "running":
                    assert kv.num_blocks_of(rid) * kv.block_size >= r.num_computed_tokens, (
                        f"running request {rid!r}: {r.num_computed_tokens} computed tokens "
                        f"in {kv.num_blocks_of(rid)} blocks")
                elif name == "waiting":
                    assert kv.num_blocks_of(rid) == 0 and r.num_computed_tokens == 0, (
                        f"waiting request {rid!r} holds blocks or computed tokens")
        for r in self.remote_kv.requests:
            assert r.request_id not in seen, f"request {r.request_id!r} is in two queues"
            seen.add(r.request_id)
        self.remote_kv.check_invariants(self.requests)
        kv.check_invariants()
