"""Per-request output assembly in the router: token deltas -> text deltas -> responses.

One :class:`SampleStream` per sample of a request turns the worker's token
deltas into text with :class:`~tandem.engine.text.detokenizer.IncrementalDetokenizer`
(never a split UTF-8 character, spaces kept; a character that the end of the
sample cuts short is dropped, not shown as U+FFFD) and applies stop strings with
:class:`~tandem.engine.text.detokenizer.StopStringMatcher` (text that might start a
stop string is held back and released exactly once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher, detokenize_until_stop
from tandem.engine.runtime.outputs import RequestDelta
from tandem.engine.scheduling.request import TokenLogprobs
from tandem.engine.sampling.sampling_params import SamplingParams

@dataclass
class SampleUpdate:
    """What one delta added to a sample: text, ids, logprobs and whether it ended.

    ``prompt_logprobs`` is set on the sample's first update only, when they were
    asked for (see :attr:`SampleStream.prompt_logprobs`)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # True when the router ended the sample (stop string) while the worker still runs it.
    needs_abort: bool = False
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass
class SampleStream:
    """Text state of one sample (index) of a request.

    ``prompt_logprobs``: once the first delta arrived, when ``prompt_logprobs`` was
    asked for, one entry per prompt token (``prompt_token_ids``): None for the
    first, then its :class:`TokenLogprobs` given the tokens before it (see
    :class:`~tandem.engine.runtime.outputs.RequestDelta`). A migrated request keeps
    the ones its first attempt delivered.
    """

    index: int
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> SampleUpdate | None:
        """Consume a worker delta; None once the sample already finished."""
        if self.finished:
            return None
        emit, stop, used = detokenize_until_stop(self.detokenizer, self.matcher,
                                                 delta.new_token_ids,
                                                 delta.finish_reason is not None)
        # A stop string inside a multi-token delta (speculative decoding) ends the
        # sample on the token that completed it: the rest is never returned.
        ids = list(delta.new_token_ids[:used])
        self.num_tokens += len(ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        upd = SampleUpdate(emit, ids, list(delta.new_logprobs[:used]))
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            upd.prompt_logprobs = self.prompt_logprobs = delta.prompt_logprobs
        if stop is not None:
            upd.finish_reason, upd.stop_reason = "stop", stop
            upd.needs_abort = delta.finish_reason is None
        elif delta.finish_reason is not None:
            upd.text += self.matcher.flush()
            upd.finish_reason, upd.stop_reason = delta.finish_reason, delta.stop_reason
        self.finish_reason, self.stop_reason = upd.finish_reason, upd.stop_reason
        self.pieces.append(upd.text)
        self.token_ids.extend(ids)
        self.logprobs.extend(upd.logprobs)
        return upd

    def fail(self, reason: str, message: str | None = None) -> SampleUpdate | None:
        """End the sample from the router's side (abort, worker error)."""
        if self.finished:
            return None
        self.finish_reason, self.stop_reason = reason, message
        return SampleUpdate("", [], [], reason, message)


def new_sample_streams(tokenizer, prompt_token_ids, params: SamplingParams,
                       skip_special_tokens: bool) -> list[SampleStream]:
    prompt = tuple(prompt_token_ids)
    return [SampleStream(i, IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens),
                         StopStringMatcher(params.stop, params.include_stop_str_in_output),
                         prompt_token_ids=prompt)
            for i in range(params.n)]
