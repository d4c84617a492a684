"""Beam search over the paged KV cache: beams are requests that fork their parents.

The algorithm is Hugging Face transformers' ``generate(num_beams=W,
do_sample=False)`` (``GenerationMixin._beam_search``, transformers 5), so the
beams and their scores match it token for token; the scoring of finished
hypotheses is Wu et al. 2016 (GNMT, section 7) with the length penalty
``len ** length_penalty``. One step, with ``t`` tokens generated so far:

1. Every running beam ``i`` (cumulative logprob ``s_i``, float32) contributes its
   ``2W`` most likely next tokens ``v`` with score ``s_i + log p(v)``; the best
   ``2W`` of all these candidates are kept, best first (``2W``: even if ``W`` of
   them end in EOS, ``W`` remain to continue).
2. A candidate *ends* if its token is EOS (unless ``ignore_eos``) or it reaches
   ``max_tokens``. The best ``W`` candidates that do not end are the next running
   beams.
3. Ending candidates among the first ``W`` become finished hypotheses with score
   ``(s_i + log p(v)) / (t + 1) ** length_penalty`` (the length counts generated
   tokens, EOS included); the best ``W`` finished ones are kept. Candidates that
   end beyond the first ``W`` are dropped. With ``early_stopping=True`` nothing
   is added once ``W`` hypotheses are finished.
4. The search stops when every candidate ended (``max_tokens``); with
   ``early_stopping=True`` once ``W`` hypotheses are finished; otherwise once ``W``
   are finished and the best running beam cannot beat the worst of them:
   ``s_0 / L ** length_penalty <= min(finished scores)``, ``L`` being ``t + 1``
   (or ``max_tokens`` with ``early_stopping="never"`` and ``length_penalty > 0``).

The result is the ``W`` finished hypotheses, best score first.

KV sharing: each beam is a :class:`Request` of the engine's scheduler, batched
with everything else. Its step yields the ``2W`` top log-probabilities of its next
token (the sampler's ``num_top_logprobs``); the greedy token the scheduler
appended is taken back, so the beam waits, holding its blocks, until every
running beam of its search has reported. Then each new beam is a new request
forked from its parent (:meth:`Scheduler.fork_request`): it shares the parent's
blocks by reference count, and the first write into a shared, partly filled last
block copies it (copy-on-write). The parents are then finished, so a block whose
every descendant was dropped goes back to the pool, and a parent with one
surviving child hands it its blocks unshared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from tandem.engine.sampling.sampling_params import (MAX_BEAM_WIDTH, InvalidParameterError,
                                                    SamplingParams)
from tandem.engine.scheduling.request import Request, RequestStatus, sample_request_id

if TYPE_CHECKING:
    from tandem.engine.runtime.llm_engine import LLMEngine

_NEG = -1.0e9     # Hugging Face's "impossible" score


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (offline :meth:`LLM.beam_search`).

    Attributes:
        beam_width: beams kept per step, and beams returned (1..16).
        max_tokens: most tokens generated per beam (>= 1).
        ignore_eos: beams never end at EOS (only at ``max_tokens``).
        temperature: must be 0 (deterministic beam search, as Hugging Face's).
        length_penalty: finished beams score ``cum_logprob / len ** length_penalty``.
        early_stopping: Hugging Face's: False, True or ``"never"`` (see the module doc).

    Raises:
        InvalidParameterError: a bad field, named (``beam_width`` above 16, ...).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidParameterError(
                "beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}], "
                              f"got {self.beam_width!r}")
        self.to_sampling_params()      # the other fields' checks

    def to_sampling_params(self) -> SamplingParams:
        """The same search as :class:`SamplingParams` (``use_beam_search``, ``n`` = width)."""
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens,
                              temperature=self.temperature, ignore_eos=self.ignore_eos,
                              use_beam_search=True, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping)


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's ``BeamSearchSequence``, plus Hugging Face's score).

    Attributes:
        tokens: prompt and generated token ids (as vLLM).
        output_token_ids: the generated ids (an ending EOS included).
        text: the generated text (special tokens skipped); filled by :class:`LLM`.
        cum_logprob: sum of the generated tokens' logprobs (natural log, float32).
        score: ``cum_logprob / len(output_token_ids) ** length_penalty``, Hugging
            Face's ``sequences_scores``; beams are ordered by it.
        finish_reason: ``stop`` (EOS) or ``length``.
    """

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    text: str = ""


@dataclass
class BeamSearchOutput:
    """What :meth:`LLM.beam_search` returns per prompt: the beams, best score first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    request: Request
    tokens: list[int]                   # generated so far (the request may hold one more)
    score: torch.Tensor                 # 0-dim float32 cumulative logprob
    top: tuple | None = None            # ((token_id, logprob), ...) of its next token, once known


@dataclass
class BeamSearch:
    """The state of one beam search in an engine (see the module doc).

    Attributes:
        request_id: the search's id; its results are ``request_id`` (best beam) and
            ``request_id#i`` for beam ``i`` > 0, like the samples of ``n > 1``.
        results: ``W`` :class:`Request` s, unregistered; each is given its beam's
            tokens and a finished status when the search ends.
        sequences: the finished beams, best first, once the search ended.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    priority: int
    arrival_time: float
    results: list[Request]
    running: list[_Beam] = field(default_factory=list)
    finished: list[tuple[torch.Tensor, torch.Tensor, list[int], str]] = field(default_factory=list)
    num_generated: int = 0
    num_forks: int = 0
    sequences: list[BeamSearchSequence] | None = None

    @property
    def width(self) -> int:
        return self.params.n

    def new_beam_request(self, output_token_ids: list[int]) -> Request:
        self.num_forks += 1
        # The greedy token each step appends is taken back (see BeamSearchManager), so
        # the scheduler ends a beam only at max_tokens, when the search ends too.
        params = dataclasses.replace(self.params, ignore_eos=True)
        return Request(f"{self.request_id}/beam{self.num_forks}", self.prompt_token_ids,
                       params, eos_token_id=self.eos_token_id, priority=self.priority,
                       arrival_time=self.arrival_time, output_token_ids=output_token_ids)

    def ready(self) -> bool:
        return all(b.top is not None for b in self.running)

    def select(self) -> tuple[list[tuple[_Beam, int, torch.Tensor]], bool]:
        """One step of the search over the running beams' reported top tokens.

        Returns:
            ``(next, done)``: the next running beams as ``(parent, token_id, score)``,
            best first, and whether the search ended.
        """
        w, p = self.width, self.params
        k = 2 * w
        ids, scores, parents = [], [], []
        for i, beam in enumerate(self.running):
            toks, lps = zip(*beam.top)
            ids.extend(toks)
            parents.extend([i] * len(toks))
            scores.append(beam.score + torch.tensor(lps, dtype=torch.float32))
        flat = torch.cat(scores)
        top_scores, top_idx = torch.topk(flat, k=min(k, flat.numel()))
        cand = [(parents[j], ids[j]) for j in top_idx.tolist()]
        length = self.num_generated + 1
        ends = torch.tensor([(not p.ignore_eos and t == self.eos_token_id) or length >= p.max_tokens
                             for _, t in cand])
        running_scores = top_scores + ends.to(torch.float32) * _NEG
        keep_scores, keep = torch.topk(running_scores, k=min(w, len(cand)))
        nxt = [(self.running[cand[j][0]], cand[j][1], keep_scores[n])
               for n, j in enumerate(keep.tolist())]
        # Finished hypotheses: ending candidates among the first W only.
        full = len(self.finished) == w and p.early_stopping is True
        if not full:
            penalized = top_scores / (length ** p.length_penalty)
            for j in range(min(w, len(cand))):
                if ends[j]:
                    parent, tok = self.running[cand[j][0]], cand[j][1]
                    reason = "length" if tok != self.eos_token_id or p.ignore_eos else "stop"
                    self.finished.append((penalized[j], top_scores[j],
                                          parent.tokens + [tok], reason))
            self.finished.sort(key=lambda h: -float(h[0]))      # stable: earlier first on ties
            del self.finished[w:]
        self.num_generated = length
        done = bool(ends.all())
        if len(self.finished) == w:
            if p.early_stopping is True:
                done = True
            else:
                best_len = (p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0
                            else self.num_generated)
                best_possible = keep_scores[0] / (best_len ** p.length_penalty)
                if not bool(best_possible > self.finished[-1][0]):
                    done = True
        return nxt, done

    def finish(self) -> None:
        """Fill :attr:`sequences` and :attr:`results` from the finished hypotheses."""
        self.sequences = []
        for i, (score, cum, tokens, reason) in enumerate(self.finished):
            self.sequences.append(BeamSearchSequence(
                self.prompt_token_ids + tokens, list(tokens), float(cum), float(score), reason))
            res = self.results[i]
            res.output_token_ids = list(tokens)
            res.status = (RequestStatus.FINISHED_STOPPED if reason == "stop"
                          else RequestStatus.FINISHED_LENGTH)
        for res in self.results[len(self.finished):]:     # not reached: W always finish
            res.status = RequestStatus.FINISHED_LENGTH


class BeamSearchManager:
    """The engine's beam searches: started by :meth:`add`, advanced by :meth:`update`
    after each engine step, ended by the search itself or :meth:`abort`.

    Args:
        engine: the engine whose scheduler runs the beams.
    """

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.searches: dict[str, BeamSearch] = {}
        self._search_of: dict[str, BeamSearch] = {}     # beam request id -> its search
        self._result_ids: set[str] = set()             # results of the running searches

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.searches

    def is_result_id(self, request_id: str) -> bool:
        """``request_id`` names a result of a search still running (``id`` or ``id#i``)."""
        return request_id in self._result_ids

    def sample_ids(self, request_id: str) -> list[str]:
        """The ids of a search's results but the first (``request_id#i``); [] otherwise."""
        s = self.searches.get(request_id)
        return [r.request_id for r in s.results[1:]] if s is not None else []

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0) -> list[Request]:
        """Start a beam search of width ``params.n``; returns its result requests.

        Raises:
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self.searches or request_id in self.engine.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        eos = self.engine.tokenizer.eos_token_id
        results = [Request(sample_request_id(request_id, i), prompt_token_ids, params,
                           eos_token_id=eos, priority=priority, sample_index=i,
                           parent_id=request_id if i else None)
                   for i in range(params.n)]
        search = BeamSearch(request_id, prompt_token_ids, params, eos, priority,
                            results[0].arrival_time, results)
        first = search.new_beam_request([])
        search.running = [_Beam(first, [], torch.zeros((), dtype=torch.float32))]
        self.engine.scheduler.add_request(first)
        self.searches[request_id] = search
        self._result_ids.update(r.request_id for r in results)
        self._search_of[first.request_id] = search
        return results

    def update(self, changed: list[Request]) -> list[Request]:
        """Take the beams' reports out of a step's changed requests, advance the
        searches whose every beam reported, and return the other changed requests
        plus the results of searches that ended."""
        out, touched = [], []
        for req in changed:
            search = self._search_of.get(req.request_id)
            if search is None:
                out.append(req)
                continue
            beam = next(b for b in search.running if b.request is req)
            beam.top = req.output_logprobs[-1].top
            if not req.is_finished:         # the greedy token: the search picks its own
                req.output_token_ids.pop()
                req.output_logprobs.pop()
            if search not in touched:
                touched.append(search)
        for search in touched:
            if search.ready() and self._advance(search):
                out.extend(search.results)
        return out

    def _advance(self, search: BeamSearch) -> bool:
        """One step of ``search``: fork the new beams, finish the old. True if it ended."""
        nxt, done = search.select()
        old = search.running
        search.running = []
        if not done:
            sch = self.engine.scheduler
            for parent, token, score in nxt:
                tokens = parent.tokens + [token]
                child = search.new_beam_request(list(tokens))
                sch.fork_request(parent.request, child)
                self._search_of[child.request_id] = search
                search.running.append(_Beam(child, tokens, score))
        for beam in old:       # after the forks: shared blocks never drop to ref count 0
            self._end_beam(beam.request, RequestStatus.FINISHED_STOPPED)
        if done:
            search.finish()
            self._forget(search)
        return done

    def _forget(self, search: BeamSearch) -> None:
        del self.searches[search.request_id]
        self._result_ids.difference_update(r.request_id for r in search.results)

    def _end_beam(self, req: Request, status: RequestStatus) -> None:
        self._search_of.pop(req.request_id, None)
        self.engine.finish_request(req.request_id, status)

    def abort(self, request_id: str) -> bool:
        """Abort a search: its beams' blocks are freed. False if unknown."""
        search = self.searches.get(request_id)
        if search is None:
            return False
        self._forget(search)
        for beam in search.running:
            self._end_beam(beam.request, RequestStatus.FINISHED_ABORTED)
        search.running = []
        for res in search.results:
            res.status = RequestStatus.FINISHED_ABORTED
        return True


def check_beam_request(params: SamplingParams, *, kv_transfer_params=None,
                       output_token_ids: Sequence[int] = (), sample_index: int = 0) -> None:
    """Refuse what a beam search cannot take (it is computed in one engine, whole).

    Raises:
        InvalidParameterError: naming ``kv_transfer_params``, ``output_token_ids``
            or ``sample_index``.
    """
    if kv_transfer_params is not None:
        raise InvalidParameterError("kv_transfer_params",
                                    "a beam search's prompt is computed by its own engine")
    if output_token_ids:
        raise InvalidParameterError("output_token_ids", "a beam search cannot be resumed")
    if sample_index:
        raise InvalidParameterError("sample_index", "must be 0 for a beam search")


__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearch",
           "BeamSearchManager", "check_beam_request"]
