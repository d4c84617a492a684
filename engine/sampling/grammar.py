"""Constrained decoding: grammars compiled from a request's
:class:`~tandem.engine.sampling.sampling_params.StructuredOutputsParams`, and the
per-request matchers that mask the logits of every token leaving the grammar.

Who owns what::

    LLMEngine.add_request ──compile (cached by key)──> StructuredOutputManager
    Sampler.__call__ / verify                               │
        ├─ mask(rows, requests)  ── matcher per request ────┤  replays the request's
        │      (bitmask: 1 bit per token, int32 words)      │  output tokens it has not
        └─ accept(request, token) ──────────────────────────┘  seen yet, then masks
    LLMEngine (finish / abort) ──free(request id)

A worker compiles a request's grammar on a thread of its own before it hands the
request to its engine loop, so ``add_request`` finds it in the cache and the loop
never stalls on a compile (a large schema takes ~0.5 s).

A matcher follows ``request.output_token_ids``: before a mask it accepts the
output tokens it has not seen (tokens an earlier attempt emitted, a resumed
request; the first token a prefill worker sampled), and the sampler advances it
with each token it samples. Preemption keeps a request's output tokens (recompute
only recomputes their KV), so the matcher survives it as it is. Speculative
verification accepts the drafts into the matcher to mask the rows after them,
then rolls them back and accepts the tokens actually chosen.

The backend is a small ABC with a registry keyed by name (:data:`BACKENDS`); the
one shipped is xgrammar (see docs/structured_outputs.md for why).
"""

from __future__ import annotations

import abc
import collections
import json
import logging
import re
import threading
import time
from typing import Callable

import torch

from tandem.engine.sampling.sampling_params import InvalidParameterError, StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0
"""A grammar that takes longer to compile is refused (the compile thread is left
to finish in the background; its result is dropped)."""


class GrammarMatcher(abc.ABC):
    """The state of one request inside its grammar."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar refuses it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (at least the longest
        speculative draft must be possible)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[W]`` int32, bit
        ``t % 32`` of word ``t // 32`` set iff token ``t`` is allowed)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer and vocabulary.

    Args (of implementations): tokenizer: the engine's
    :class:`~tandem.engine.text.tokenizer.Tokenizer`; vocab_size: the model's
    vocabulary (logits width, may exceed the tokenizer's).
    """

    @classmethod
    @abc.abstractmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        """Parse ``params`` without a tokenizer (cheap: the router's check).

        Raises:
            InvalidParameterError: ``field`` ``structured_outputs.<kind>``.
        """

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (opaque) of ``params``.

        Raises:
            InvalidParameterError: it does not compile (``structured_outputs.<kind>``).
        """

    @abc.abstractmethod
    def new_matcher(self, compiled) -> GrammarMatcher:
        """A matcher at the start of ``compiled``."""


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _error_text(exc: BaseException) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return _LOCATION.sub("", str(exc)).strip()


class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher):
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar (Dong et al. 2024): a pushdown automaton whose token masks are
    precomputed per grammar position at compile time (context-independent tokens)
    and checked at run time for the rest. JSON schemas are generated compact
    (``", "`` and ``": "``, no free whitespace: small models given free
    whitespace tend to emit it forever) and strict (no properties or items the
    schema does not name)."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=[tokenizer.eos_token_id])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(params.json, any_whitespace=False, strict_mode=True)
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidParameterError(f"structured_outputs.{kind}", _error_text(e)) from None

    def compile(self, params: StructuredOutputsParams):
        c, kind = self._compiler, params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(params.json, any_whitespace=False, strict_mode=True)
            if kind == "json_object":       # an object, not any JSON value (OpenAI's json_object)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(params.choice))
            return c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidParameterError(f"structured_outputs.{kind}", _error_text(e)) from None

    def new_matcher(self, compiled) -> GrammarMatcher:
        # xgrammar 0.2 keeps the whole history: any number of tokens rolls back.
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


def _choice_ebnf(choices) -> str:
    # JSON string literals are valid EBNF literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


BACKENDS: dict[str, type[GrammarBackend]] = {"xgrammar": XGrammarBackend}
DEFAULT_BACKEND = "xgrammar"


def get_grammar_backend_class(name: str = DEFAULT_BACKEND) -> type[GrammarBackend]:
    """The backend registered as ``name``.

    Raises:
        ValueError: no such backend.
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"grammar backend {name!r}: unknown, choose from {sorted(BACKENDS)}"
                         ) from None


def check_structured_outputs(params: StructuredOutputsParams,
                             backend: str = DEFAULT_BACKEND) -> None:
    """Refuse a constraint that cannot parse, without a tokenizer (the router's check).

    Raises:
        InvalidParameterError: ``field`` names the constraint (``structured_outputs.json``).
    """
    get_grammar_backend_class(backend).check(params)


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack ``[N, W]`` int32 bitmask words into a ``[N, vocab_size]`` bool mask
    (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class _State:
    __slots__ = ("matcher", "num_accepted", "broken")

    def __init__(self, matcher: GrammarMatcher):
        self.matcher, self.num_accepted, self.broken = matcher, 0, False


class StructuredOutputManager:
    """Compiled grammars (LRU cache by constraint) and one matcher per live request.

    The backend is built at the first compile (importing xgrammar and reading the
    vocabulary take ~1.5 s), so an engine that never sees a constraint pays nothing.

    Args:
        backend_factory: builds the :class:`GrammarBackend`.
        vocab_size: logits width ``V``.
        eos_token_id: the token a complete grammar allows.
        cache_size: compiled grammars kept.
        compile_timeout_s: a compile that runs longer is refused.

    Attributes:
        num_compiles, num_cache_hits: compiles run and compiles answered from the cache.
        compile_seconds: wall time spent compiling (seconds).
    """

    def __init__(self, backend_factory: Callable[[], GrammarBackend], vocab_size: int,
                 eos_token_id: int, cache_size: int = 256,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.cache_size, self.compile_timeout_s = cache_size, compile_timeout_s
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._states: dict[str, _State] = {}
        self.num_compiles = self.num_cache_hits = 0
        self.compile_seconds = 0.0
        # compile() may run on any thread (a worker compiles a request's grammar
        # off its engine loop): the cache and counters are guarded; a compile
        # itself runs outside the lock, so a slow one delays no cache hit.
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    @property
    def num_matchers(self) -> int:
        """Requests whose matcher is held (created and not yet freed)."""
        return len(self._states)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached by :attr:`~StructuredOutputsParams.key`).

        Thread-safe: a worker calls it on a thread of its own before handing the
        request to the engine loop (:meth:`EngineWorker.compile_constraint`), so
        the loop keeps stepping while a grammar compiles and ``add_request`` then
        finds it in the cache. Two threads compiling the same new key both compile
        it (the second result replaces the first).

        Raises:
            InvalidParameterError: it does not compile, or not within
                ``compile_timeout_s`` (``field`` ``structured_outputs.<kind>``).
        """
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
        with self._backend_lock:
            backend = self.backend
        result: list = []

        def run() -> None:
            try:
                result.append(backend.compile(params))
            except BaseException as e:           # handed to the caller below
                result.append(e)

        start = time.perf_counter()
        worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(self.compile_timeout_s)
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.num_compiles += 1
            if not result:
                raise InvalidParameterError(f"structured_outputs.{params.kind}",
                                            f"did not compile within {self.compile_timeout_s:g} s")
            if isinstance(result[0], BaseException):
                raise result[0]
            self._cache[key] = result[0]
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result[0]

    def free(self, request_id: str) -> bool:
        """Drop a finished request's matcher. Returns whether one was held."""
        return self._states.pop(request_id, None) is not None

    def _state(self, request) -> _State:
        """``request``'s matcher, created at its first use and caught up with the
        output tokens it has not accepted yet."""
        st = self._states.get(request.request_id)
        if st is None:
            compiled = self.compile(request.sampling_params.structured_outputs)
            st = self._states[request.request_id] = _State(self.backend.new_matcher(compiled))
        out = request.output_token_ids
        if st.num_accepted > len(out):      # never expected: tokens are only appended
            st.matcher.rollback(st.num_accepted - len(out))
            st.num_accepted = len(out)
        for t in out[st.num_accepted:]:
            self._accept(request.request_id, st, t)
        return st

    def _accept(self, request_id: str, st: _State, token_id: int) -> None:
        if not st.broken and not st.matcher.accept_token(token_id):
            # Only a bug (or a token sampled without this grammar) gets here: the
            # request goes on unconstrained rather than stalling the batch.
            logger.error("request %r: token %d is outside its grammar; the rest of its "
                         "output is unconstrained", request_id, token_id)
            st.broken = True
        st.num_accepted += 1

    def accept(self, request, token_id: int) -> bool:
        """Advance ``request``'s matcher by a token just sampled for it.

        Returns:
            Whether the grammar has ended with it (the request must stop).
        """
        st = self._state(request)
        self._accept(request.request_id, st, token_id)
        return not st.broken and st.matcher.is_terminated()

    def allowed(self, requests, drafts=None) -> torch.Tensor:
        """The tokens each request's grammar allows next.

        Args:
            requests: ``N`` constrained requests (one row each), or one request when
                ``drafts`` is given.
            drafts: speculative drafts of that one request: ``k + 1`` rows are
                returned, row ``j`` the mask after the first ``j`` drafts (rows
                after a draft the grammar refuses repeat the last valid mask: that
                draft is rejected before they are read). The matcher ends where it began.

        Returns:
            ``[rows, V]`` bool, True where allowed.
        """
        from_drafts = drafts is not None
        rows = len(drafts) + 1 if from_drafts else len(requests)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((rows, words), -1, dtype=torch.int32)
        if from_drafts:
            st = self._state(requests[0])
            pushed = 0
            self._fill(st, bitmask, 0)
            for j, d in enumerate(drafts):
                if st.broken or not st.matcher.accept_token(int(d)):
                    bitmask[j + 1:] = bitmask[j]
                    break
                pushed += 1
                self._fill(st, bitmask, j + 1)
            if pushed:
                st.matcher.rollback(pushed)
        else:
            for i, r in enumerate(requests):
                self._fill(self._state(r), bitmask, i)
        return bitmask_to_allowed(bitmask, self.vocab_size)

    def _fill(self, st: _State, bitmask: torch.Tensor, row: int) -> None:
        if st.broken:
            return                                   # all ones: unconstrained
        if st.matcher.is_terminated():
            bit = self.eos_token_id % 32             # ended: only the end token
            bitmask[row] = 0
            bitmask[row, self.eos_token_id // 32] = (1 << bit) if bit < 31 else -(1 << 31)
            return
        st.matcher.fill_bitmask(bitmask, row)


def constrain_row(row: torch.Tensor, allowed: torch.Tensor, raw: torch.Tensor) -> None:
    """Mask one processed ``[V]`` logits row in place to the ``allowed`` ``[V]`` tokens.

    If nothing allowed is left finite (``min_tokens`` banned the end token that a
    complete grammar needs), the grammar wins: the row becomes the ``raw`` logits
    masked by ``allowed`` alone.
    """
    row.masked_fill_(~allowed, float("-inf"))
    if not bool(torch.isfinite(row).any()):
        row.copy_(raw.masked_fill(~allowed, float("-inf")))


def constrain_rows(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor,
                   raw: torch.Tensor) -> None:
    """Mask ``rows`` of processed ``[N, V]`` float32 ``logits`` in place to the
    ``allowed`` ``[len(rows), V]`` bool tokens (row ``j`` of ``allowed`` for
    ``logits[rows[j]]``): :func:`constrain_row` for a batch, with the same result.

    Branch-free: ``min(logit, +inf or -inf)`` instead of ``masked_fill`` (whose
    per-element branch costs ~3 ns on CPU with a patchy mask), and the "anything
    left?" test by ``amax`` rather than ``isfinite().any()``: 16 rows of a
    49,152-token vocabulary take ~0.4 ms instead of ~3.7 ms on one core.
    ``raw`` ``[N, V]``: the logits before processing, for the rows where nothing
    allowed is left finite (see :func:`constrain_row`).
    """
    if not rows:
        return
    whole = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    idx = None if whole else torch.tensor(rows)
    sub = logits if whole else logits.index_select(0, idx)
    bound = allowed.float().mul_(2).sub_(1).mul_(float("inf"))     # +inf allowed, -inf not
    torch.minimum(sub, bound, out=sub)
    live = sub.amax(dim=-1) > float("-inf")
    if not bool(live.all()):
        for j in (~live).nonzero().flatten().tolist():
            sub[j] = raw[rows[j]].masked_fill(~allowed[j], float("-inf"))
    if not whole:
        logits.index_copy_(0, idx, sub)
