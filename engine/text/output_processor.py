"""Turns requests' new token ids into text, applying stop strings (offline API side).

The router does the same per stream with the same two pieces
(:class:`~tandem.engine.text.detokenizer.IncrementalDetokenizer` and
:class:`~tandem.engine.text.detokenizer.StopStringMatcher`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher, detokenize_until_stop
from tandem.engine.scheduling.request import Request, TokenLogprobs
from tandem.engine.text.tokenizer import Tokenizer


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    num_processed: int = 0
    pieces: list[str] = field(default_factory=list)
    stop_string: str | None = None
    done: bool = False


@dataclass
class CompletionOutput:
    """One sample of a prompt.

    Attributes:
        index: sample index (0..n-1).
        token_ids: generated ids (a matched stop string's tokens are kept).
        text: detokenized output, cut before a matched stop string; a character
            that the end of generation cut short (its first bytes only) is
            dropped, not shown as U+FFFD (``token_ids`` keep its tokens).
        finish_reason: ``stop``, ``length`` or ``abort``.
        stop_reason: the matched stop string or stop token id; None for EOS/length.
        logprobs: per generated token, when requested.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt.

    Attributes:
        request_id: the engine's id of the request.
        prompt_token_ids: the prompt.
        outputs: one :class:`CompletionOutput` per sample, in index order.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per
            prompt token (as vLLM's): None for the first, then the
            :class:`TokenLogprobs` of prompt token p given tokens < p (natural log,
            raw model distribution; ``top`` holds ``prompt_logprobs`` entries).
            Shared by all samples. None when not requested.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputProcessor:
    """Incremental detokenization + stop strings for the requests of one ``generate`` call."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        p = req.sampling_params
        self._states[req.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
            StopStringMatcher(p.stop, p.include_stop_str_in_output))

    def process(self, req: Request) -> str | None:
        """Consume ``req``'s new tokens; returns the matched stop string, if any (the
        caller then finishes the request)."""
        st = self._states[req.request_id]
        if st.done:
            return None
        new = req.output_token_ids[st.num_processed:]
        text, stop, used = detokenize_until_stop(st.detokenizer, st.matcher, new, req.is_finished)
        st.num_processed += used
        st.pieces.append(text)
        if stop is not None:
            # A stop string completed inside a multi-token step (speculative decoding):
            # the tokens after it were never returned.
            del req.output_token_ids[st.num_processed:]
            del req.output_logprobs[st.num_processed:]
            st.stop_string, st.done = stop, True
        elif req.is_finished:
            st.pieces.append(st.matcher.flush())
            st.done = True
        return stop

    def text(self, request_id: str) -> str:
        return "".join(self._states[request_id].pieces)

    def completion(self, req: Request):
        st = self._states[req.request_id]
        return CompletionOutput(
            index=req.sample_index, token_ids=list(req.output_token_ids), text=self.text(req.request_id),
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None)
