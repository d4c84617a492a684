"""Small typed messages that cross a worker's boundary: the request a worker is
given, per-step token deltas and worker stats.

The same dataclasses cross Ray (pickled) and are turned into protobuf in one
place, the router's front end.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.scheduling.request import TokenLogprobs
from tandem.engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkerRequest:
    """A request as the router hands it to a worker.

    Attributes:
        request_id: the router's internal id of the request (every sample's).
        prompt_token_ids: the prompt (tokens).
        sampling_params: validated sampling parameters.
        priority: lower is more important.
        kv_transfer_params: for a disaggregated request: on the decode worker the
            prefill worker its KV comes from, on the prefill worker the decode
            worker's ticket; None when the worker computes the prompt itself.
        output_token_ids: a resumed request (migrated after its decode worker
            died): the tokens an earlier attempt already emitted to the client;
            the worker computes their KV and continues after them.
        output_logprobs: their :class:`TokenLogprobs` when logprobs were asked
            (empty, or one per token).
        router_id: the router that added it: its deltas go only to that router's
            :meth:`~tandem.engine.runtime.engine_loop.EngineLoop.poll`, and it is
            aborted if that router stops polling. ``""``: the default subscriber.
        attempt: how many times the router started this request before (0 first).
        sample_index: which sample of an ``n > 1`` request this ``n == 1`` request
            is (a sample resumed alone after a migration; its seed stream is
            sample ``sample_index``'s); 0 otherwise. The worker runs it under the
            engine id :func:`~tandem.engine.scheduling.request.sample_request_id`.
        sent_on_stream: the router wrote this request on the worker's output stream
            before this call, which it makes only when the stream broke before the
            worker's :class:`AddResult` came (the worker may have added it from
            there already; see :mod:`~tandem.engine.runtime.output_stream`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    priority: int = 0
    kv_transfer_params: KVTransferParams | None = None
    output_token_ids: tuple[int, ...] = ()
    output_logprobs: tuple[TokenLogprobs, ...] = ()
    router_id: str = ""
    attempt: int = 0
    sample_index: int = 0
    sent_on_stream: bool = False


@dataclass(frozen=True)
class RequestDelta:
    """What one step did for one request.

    Attributes:
        request_id: the request (the router's id, whichever sample this is).
        sample_index: which of its samples (``n > 1``) or beams (beam search), 0-based.
        new_token_ids: tokens generated in this step (usually one).
        new_logprobs: their log-probabilities, when asked for.
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` once finished, else None.
        stop_reason: the stop token id that ended it, if any.
        num_prompt_tokens, num_cached_tokens, num_output_tokens: usage so far (tokens).
        kv_transfer_ticket: a remote-prefill request's KV ticket (plain dict), once,
            in the step that reserved its blocks; the router hands it to the prefill
            worker.
        prompt_logprobs: when ``sampling_params.prompt_logprobs`` was set, on the
            sample's first delta with tokens only (None on every other delta): one
            entry per prompt token, None for the first (it has no context), then
            the :class:`TokenLogprobs` of prompt token p given tokens < p
            (``token_id`` is the prompt's, ``top`` the ``prompt_logprobs`` most
            likely tokens). Every sample of an ``n > 1`` request carries the same.
            A resumed request (``WorkerRequest.output_token_ids``) sent them with
            its first token already and carries none.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    kv_transfer_ticket: dict | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    sample_index: int = 0


@dataclass(frozen=True)
class WorkerStats:
    """A worker's load and counters, sent with every step (gauges are snapshots,
    counters are totals since start).

    Attributes:
        worker_id, role: e.g. ``decode-0``, ``decode`` | ``prefill`` | ``colocated``.
        num_running, num_waiting, num_swapped: requests in the running / waiting /
            swapped queues.
        num_free_blocks, num_blocks: KV blocks free (incl. evictable cached) / total.
        kv_cache_usage: fraction of blocks in use, 0..1.
        num_free_host_blocks, num_host_blocks: host (swap space) blocks free / total.
        num_preemptions: total preemptions, swap and recompute together.
        num_swap_preemptions, num_recompute_preemptions: total preemptions by mode.
        prefix_cache_queries, prefix_cache_hits: total tokens looked up / found.
        num_step_tokens: tokens run in the last step.
        queued_prefill_tokens: prompt tokens waiting or being prefilled.
        spec_decode_num_drafts, spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens: speculative decoding totals: verification
            steps with drafts, draft tokens verified, of those accepted.
        spec_decode_num_accepted_tokens_per_pos: accepted drafts by position in
            the draft (index 0: the first draft).
        structured_output_compiles, structured_output_cache_hits: grammar compiles
            run, and compiles answered from the compiled-grammar cache (totals).
        structured_output_compile_seconds: wall time spent compiling grammars
            (seconds, total).
    """

    worker_id: str
    role: str
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_free_host_blocks: int = 0
    num_host_blocks: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_step_tokens: int = 0
    queued_prefill_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    structured_output_compiles: int = 0
    structured_output_cache_hits: int = 0
    structured_output_compile_seconds: float = 0.0


@dataclass(frozen=True)
class AddResult:
    """A worker's answer to a request its router sent on the output stream
    (:mod:`~tandem.engine.runtime.output_stream`): a decode worker added it, a
    prefill worker prefilled it (and its first token), or why not. Sent to that
    router only, ahead of any step output with the request's deltas.

    Attributes:
        request_id, sample_index, attempt: the :class:`WorkerRequest`'s.
        error: what the call would have raised (``add_request``'s or ``prefill``'s:
            ``InvalidParameterError``, ``WorkerFencedError``, ``KVTransferError``,
            ...); None: done.
        first: a prefill worker's answer: the first token's :class:`RequestDelta`,
            as ``prefill`` returns it; None from a decode worker.
    """

    request_id: str
    sample_index: int = 0
    attempt: int = 0
    error: BaseException | None = None
    first: RequestDelta | None = None

    @staticmethod
    def key_of(request: WorkerRequest) -> tuple[str, int, int]:
        """The key that matches an answer with its request."""
        return (request.request_id, request.sample_index, request.attempt)

    @classmethod
    def to(cls, request: WorkerRequest, error: BaseException | None = None,
           first: RequestDelta | None = None) -> AddResult:
        """The answer to ``request``."""
        return cls(*cls.key_of(request), error, first)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.request_id, self.sample_index, self.attempt)


@dataclass(frozen=True)
class StepOutput:
    """One message per engine step: every request's new tokens, plus the worker's stats.

    Attributes:
        deltas: each changed request's new tokens.
        stats: the worker's stats after the step.
        step_time_s: wall time of the step (seconds).
        kv_events: prefix-cache changes since the previous message, oldest first
            (:mod:`tandem.engine.kv.kv_events`); empty when the engine records none.
        finished_at: when the step ended, ``time.time()`` on the worker's host
            (seconds since the epoch; 0.0 when not a step): the router measures the
            delivery of step outputs against it.
    """

    deltas: tuple[RequestDelta, ...]
    stats: WorkerStats
    step_time_s: float = 0.0
    kv_events: tuple = ()
    finished_at: float = 0.0
