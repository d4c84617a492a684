"""Continuous batching with a per-step token budget, chunked prefill and recompute preemption.

Every step the scheduler decides, for each request, how many of its not yet
computed tokens to run (``num_new_tokens``): 1 for a decode, a chunk of the
prompt for a prefill. Requests join and leave between steps. The design follows
vLLM v1's unified scheduler (no separate prefill/decode phases):

    request tokens:  [ computed (KV in cache) | new this step | not yet scheduled ]
                     0                 num_computed   num_computed+num_new   num_tokens

Running requests are served first (oldest / most important first); when the
block pool cannot hold a running request's next tokens, the least important,
latest-arrived running request is preempted (recompute: its blocks are freed and
it goes back to the head of the waiting queue, to be prefilled again later,
prompt and generated tokens together). Waiting requests are admitted in
(priority, arrival) order while budget, sequence slots and blocks last.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token: its logits give the next token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: requests and their token counts for this step.
        block_copies: ``(src_block_id, dst_block_id)`` copy-on-write copies to do
            before the forward pass.
        preempted: requests preempted (recompute) while scheduling this step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one :class:`KVCacheManager`.

    Args:
        config: budget and policy.
        kv_cache_manager: the block accounting of this engine's KV cache.
        max_model_len: context limit in tokens (prompt + output).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int):
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []   # sorted by Request.sort_key
        self.running: list[Request] = []   # sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # A whole prompt must fit in one step's budget.
            budget = max(budget, max_model_len)
        self.token_budget = budget

    # -- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (and, for n > 1, remember its forks)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        for child in request.pending_forks:
            self.requests[child.request_id] = child
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def add_prefilled(self, request: Request) -> None:
        """Put a request whose prompt KV is already in this cache (a remote prefill,
        blocks reserved beforehand) straight into the running queue; its first
        generated token is in ``request.output_token_ids``."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        for child in req.pending_forks:    # forks that never started go with their parent
            self._finish(child, RequestStatus.FINISHED_ABORTED)
        req.pending_forks = []
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their blocks."""
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: everything after it is gone too
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            blocks, num_cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(req.request_id, num_cached, num_new, blocks):
                break
            self.waiting.pop(0)
            if req.status is RequestStatus.WAITING:   # first admission, not a resumed preemption
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            out.scheduled.append(ScheduledRequest(req, num_cached, num_new))
            budget -= num_new
        out.block_copies = self.kv.take_pending_copies()
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        # Back to the head of its priority class: it keeps its original arrival order.
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    # -- after the forward pass ------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list]) -> list[Request]:
        """Advance requests by the step's results.

        Args:
            out: the step's :class:`SchedulerOutput`.
            sampled: request id -> list of :class:`~tandem.engine.sampler.SampleResult`;
                one per sampling request, ``1 + len(pending_forks)`` for a parent
                whose prompt just finished (the forks' first tokens follow its own).

        Returns:
            Requests that got a new token or finished this step (forks included).
        """
        changed: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
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
                child.status = RequestStatus.RUNNING
                bisect.insort(self.running, child, key=lambda r: r.sort_key)
                self._append_token(child, res)
                changed.append(child)
            self._append_token(req, results[0])
            changed.append(req)
        return changed

    def _append_token(self, req: Request, res) -> None:
        req.output_token_ids.append(res.token_id)
        if res.logprobs is not None:
            req.output_logprobs.append(res.logprobs)
        p = req.sampling_params
        t = res.token_id
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

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """End a request from outside (e.g. a matched stop string) and free its blocks."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = status
        self.requests.pop(req.request_id, None)
