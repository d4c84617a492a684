"""Request state inside an engine: tokens, progress and why it finished."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.sampling.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # recompute: back in the waiting queue, blocks freed
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # blocks reserved, prompt KV landing
    SWAPPED = "swapped"              # swap: in the swapped queue, blocks in host memory
    FINISHED_STOPPED = "stop"        # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"       # max_tokens or the model's context length
    FINISHED_ABORTED = "abort"       # the client cancelled
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}

_arrival_seq = itertools.count()


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position (raw model distribution, natural log).

    Attributes:
        token_id: the sampled token (a prompt position: the prompt's token);
            logprob: its log-probability (finite float).
        top: ``[(token_id, logprob), ...]`` the N most likely tokens, best first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample_request_id(request_id: str, sample_index: int) -> str:
    """The engine's id of sample ``sample_index`` of request ``request_id``: the
    request's own id for sample 0, ``request_id#i`` for sample i (the forks of an
    ``n > 1`` request, a beam search's results, a sample resumed alone). Only the
    engine and its worker use these ids: what leaves a worker names the request and
    the sample apart (:class:`~tandem.engine.runtime.outputs.RequestDelta`)."""
    return request_id if sample_index == 0 else f"{request_id}#{sample_index}"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    A request with ``n > 1`` samples becomes ``n`` Requests: the first (index 0)
    is prefilled, the others fork from it once its prompt is computed and share
    its blocks. Sample i's id is :func:`sample_request_id` of the request's, its
    ``parent_id`` the request's own id.

    Plain Python, no torch: a seeded request's random generator is the
    :class:`~tandem.engine.sampling.sampler.Sampler`'s, keyed by ``request_id`` and
    seeded with ``sampling_params.sample_seed(sample_index)``.

    Attributes:
        num_computed_tokens: tokens (prompt + output) whose K/V are in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache at admission.
        num_preemptions: times this request was preempted (swap or recompute).
        priority: lower is more important (admission order, and last to be preempted).
        kv_transfer_params: set for a request whose prompt KV crosses engines: on a
            producer (prefill) engine the consumer's ticket to send it to; on a
            consumer (decode) engine the producer it comes from (``ticket`` None).
            Cleared on the consumer when the remote prefill is given up and the
            prompt is computed here instead.
        kv_load_finished, kv_load_ok: consumer side: the load of the prompt KV has
            ended, and whether every layer landed.
        kv_load_ticket: consumer side: the KV connector's ticket (plain dict) for the
            producer, set when blocks were reserved and taken by whoever publishes it.
        first_token_from_peer: consumer side: the first output token came from the
            producer on the KV channel (not from the caller's ``start_decode``).
        spec_token_ids: draft tokens proposed to follow the request's last token,
            verified in its next decode step (see :mod:`tandem.engine.scheduling.scheduler`);
            cleared by that step.
        spec_draft_probs: the proposer's distributions of those drafts
            (``[len(spec_token_ids), V]`` float32 tensor), or None for deterministic
            drafts; cleared with them.
        prompt_logprobs: with ``sampling_params.prompt_logprobs`` set, entry p for
            every prompt position computed so far: None for position 0, then the
            :class:`TokenLogprobs` of prompt token p given tokens < p. Filled chunk
            by chunk during prefill, kept across preemption (positions are never
            computed twice); forks share their parent's. Empty otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    sample_index: int = 0
    parent_id: str | None = None       # set for sample i > 0: the request's own id
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    kv_transfer_params: KVTransferParams | None = None
    kv_load_finished: bool = False
    kv_load_ok: bool = False
    kv_load_ticket: dict | None = None
    first_token_from_peer: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    # Children to fork from this request once its prompt is computed (n > 1).
    pending_forks: list["Request"] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_seq))

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]     # the first prompt token has no context

    @property
    def parent_request_id(self) -> str:
        """The id of the request this sample belongs to (its own for sample 0)."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Admission order: priority, then arrival. Preemption takes the largest."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some positions are still to be computed:
        the request's prefill must run over every prompt token (no prefix-cache hits)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def needs_remote_kv(self) -> bool:
        """Consumer side: the prompt KV is to come from another engine."""
        p = self.kv_transfer_params
        return p is not None and p.ticket is None

    @property
    def is_finished(self) -> bool:
        return self.status.finished
