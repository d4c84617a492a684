"""Per-request sampling parameters, validated where they are built.

Field names and meanings follow vLLM's ``SamplingParams`` so that a user of
vLLM or SGLang finds what they expect.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from dataclasses import dataclass, field, fields

MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
"""Widest beam search (``n`` with ``use_beam_search``): each beam holds KV blocks."""
MAX_SEED = 2**64 - 1
"""Largest seed: seeds are unsigned 64-bit integers, as ``torch.Generator`` keeps them."""
_INT_FIELDS = ("n", "max_tokens", "top_k", "min_tokens", "seed", "logprobs",
               "prompt_logprobs")
MAX_CONSTRAINT_CHARS = 1 << 16
"""Longest JSON schema, regex or grammar text (characters), and longest sum of the
choices of a ``choice`` constraint: compile work grows with it."""
MAX_CHOICES = 1024
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "length_penalty")


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``field`` names it (e.g. ``"top_p"``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Rebuilt from its own arguments when it crosses Ray (pickled): the default
        # would call __init__ with the formatted text alone.
        return type(self), (self.field, self.message)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    Exactly one field is set. The engine compiles it into a grammar over the
    tokenizer's vocabulary (:mod:`tandem.engine.sampling.grammar`) and masks every
    token that would leave the grammar; once the grammar is complete only the
    end-of-sequence token remains, and the request stops (finish reason ``stop``).

    Attributes:
        json: a JSON schema, kept as JSON text (a dict, list or bool is serialized
            at construction, key order kept: properties are generated in schema order).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings (a non-empty sequence).
        grammar: an EBNF grammar (GBNF dialect, start rule ``root``).
        json_object: any JSON object (OpenAI's ``response_format: json_object``).

    Raises:
        InvalidParameterError: none or several fields set, a schema that is not
            JSON, a wrong type, or a text over :data:`MAX_CONSTRAINT_CHARS`;
            ``field`` is ``structured_outputs.<name>``. Whether it compiles is
            checked by the engine (and the router) against the backend.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
            except (TypeError, ValueError) as e:
                raise InvalidParameterError("structured_outputs.json",
                                            f"not serializable as JSON: {e}") from None
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise InvalidParameterError("structured_outputs.choice",
                                            "must be a list of strings, got one string")
            object.__setattr__(self, "choice", _sequence("structured_outputs.choice", self.choice))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` naming the first bad field."""
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                "structured_outputs", "exactly one of json, regex, choice, grammar or "
                                      f"json_object must be set, got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise InvalidParameterError("structured_outputs.json_object",
                                        f"must be a bool, got {self.json_object!r}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise InvalidParameterError(f"structured_outputs.{name}",
                                            "must be a non-empty string")
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise InvalidParameterError(
                    f"structured_outputs.{name}",
                    f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as e:
                raise InvalidParameterError("structured_outputs.json",
                                            f"not valid JSON: {e}") from None
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidParameterError("structured_outputs.choice",
                                            f"must hold 1..{MAX_CHOICES} strings, "
                                            f"got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidParameterError("structured_outputs.choice",
                                            "every choice must be a non-empty string")
            if sum(map(len, self.choice)) > MAX_CONSTRAINT_CHARS:
                raise InvalidParameterError(
                    "structured_outputs.choice",
                    f"the choices must be at most {MAX_CONSTRAINT_CHARS} characters together")

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple:
        """Hashable identity of the constraint: the compiled-grammar cache key."""
        return (self.kind, getattr(self, self.kind))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    Every float field must be a finite number and every integer field an
    integer (not a bool); NumPy scalars are stored as Python ``int`` / ``float``.

    Raises:
        InvalidParameterError: at construction, naming the first bad field.

    Attributes:
        n: number of independent samples (completions) of the prompt; they share
            the prompt's KV blocks.
        max_tokens: generated tokens per sample, at least 1.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        top_p: nucleus sampling, keep the smallest set with cumulative prob >= top_p,
            in (0, 1].
        min_p: drop tokens whose probability is below ``min_p * p_max``, in [0, 1].
        repetition_penalty: > 0; 1 disables. Logits of tokens seen in the prompt or
            output are divided (positive) or multiplied (negative) by it (CTRL,
            Keskar et al. 2019, section 4.1).
        presence_penalty: in [-2, 2], subtracted once from the logit of every token
            already generated (OpenAI API semantics).
        frequency_penalty: in [-2, 2], subtracted per occurrence of a generated token.
        seed: an integer in [0, 2**64 - 1] (:data:`MAX_SEED`); makes this
            request's samples reproducible whatever else is batched with it. The
            sampler keeps one ``torch.Generator`` per seeded sample, seeded with
            :meth:`sample_seed` (``(seed + sample index) mod 2**64``), so every
            seed is valid for every ``n``.
        stop_token_ids: generation ends (finish reason ``stop``) on any of these
            (integers >= 0; None means none).
        stop: stop strings, applied to the detokenized text (one string, a
            sequence of non-empty strings, or None for none).
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: if set, return this many top log-probabilities (0..20) per
            generated token, plus the sampled token's own.
        min_tokens: EOS and stop token ids are masked until this many tokens exist.
        prompt_logprobs: if set (0..20), return for every prompt position p >= 1 the
            log-probability of prompt token p given the tokens before it, plus this
            many top alternatives (the first prompt token has none: None, as in vLLM).
            Same distribution as ``logprobs``: the raw model's ``log_softmax``,
            without temperature or penalties. Such a request takes no prefix-cache
            hits (cached positions would have no logits).
        structured_outputs: constrain the output to a JSON schema, regex, choice or
            grammar (:class:`StructuredOutputsParams`; a dict of its fields is
            accepted too); None: free text. The grammar's mask is applied after
            penalties, and wins over ``min_tokens`` once the grammar is complete.
        use_beam_search: beam search of width ``n`` (1..:data:`MAX_BEAM_WIDTH`)
            instead of sampling; the ``n`` outputs are the beams, best first
            (:mod:`tandem.engine.runtime.beam_search`). Needs ``temperature`` 0 and
            refuses what would change the beams' scores or cut them afterwards
            (penalties, ``min_tokens``, ``logprobs``, stops, ``structured_outputs``).
        length_penalty: beam search only: a finished beam scores
            ``cumulative_logprob / num_output_tokens ** length_penalty``.
        early_stopping: beam search only (Hugging Face's ``early_stopping``):
            False (stop when no running beam can beat the worst finished one,
            judged at the current length), True (stop once ``n`` beams finished)
            or ``"never"`` (judged at ``max_tokens`` when ``length_penalty`` > 0).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ once, at build time (NumPy
        # scalars become Python numbers: the parameters are journaled as JSON).
        for name in _INT_FIELDS:
            if _is_int(value := getattr(self, name)):
                object.__setattr__(self, name, operator.index(value))
        for name in _FLOAT_FIELDS:
            if _is_real(value := getattr(self, name)):
                object.__setattr__(self, name, float(value))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else _sequence("stop", stop)
        object.__setattr__(self, "stop", stop)
        so = self.structured_outputs
        if isinstance(so, dict):     # e.g. rebuilt from dataclasses.asdict (the journal)
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise InvalidParameterError("structured_outputs", str(e)) from None
            object.__setattr__(self, "structured_outputs", so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidParameterError("structured_outputs",
                                        f"must be a StructuredOutputsParams, got {so!r}")
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` naming the first bad field."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            optional = name in ("seed", "logprobs", "prompt_logprobs")
            if not (value is None and optional) and not _is_int(value):
                raise InvalidParameterError(name, f"must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value):
                raise InvalidParameterError(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidParameterError(name, f"must be a finite number, got {value}")
        if self.n < 1:
            raise InvalidParameterError("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise InvalidParameterError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):
            raise InvalidParameterError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise InvalidParameterError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidParameterError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0):
            raise InvalidParameterError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise InvalidParameterError(
                "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise InvalidParameterError(
                "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise InvalidParameterError("seed", f"must be in [0, 2**64 - 1], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise InvalidParameterError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise InvalidParameterError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameterError("stop_token_ids", "token ids must be >= 0")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidParameterError("stop", "stop strings must be non-empty strings")
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise InvalidParameterError("use_beam_search",
                                        f"must be a boolean, got {self.use_beam_search!r}")
        es = self.early_stopping
        if not (isinstance(es, bool) or es == "never"):
            raise InvalidParameterError("early_stopping",
                                        f"must be true, false or 'never', got {es!r}")
        if not self.use_beam_search:
            for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != default:
                    raise InvalidParameterError(name, "is used by beam search only "
                                                      "(set use_beam_search)")
            return
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise InvalidParameterError("n", f"the beam width of a beam search must be in "
                                             f"[1, {MAX_BEAM_WIDTH}], got {self.n}")
        if self.temperature != 0.0:
            raise InvalidParameterError("temperature", "beam search needs temperature 0, "
                                                       f"got {self.temperature}")
        for name, default in (("top_k", -1), ("top_p", 1.0), ("min_p", 0.0),
                              ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0), ("min_tokens", 0), ("seed", None),
                              ("logprobs", None), ("prompt_logprobs", None),
                              ("stop_token_ids", ()), ("stop", ()),
                              ("structured_outputs", None)):
            if getattr(self, name) != default and not (name == "top_k" and self.top_k == 0):
                if name == "structured_outputs":      # named as its other refusals are
                    name = f"structured_outputs.{self.structured_outputs.kind}"
                raise InvalidParameterError(name, "is not supported with use_beam_search")

    @property
    def num_top_logprobs(self) -> int | None:
        """Most likely tokens the sampler lists per generated token: ``logprobs``, or
        under beam search ``2 * n``, the candidates a beam search step keeps."""
        return 2 * self.n if self.use_beam_search else self.logprobs

    def sample_seed(self, sample_index: int) -> int:
        """The seed of sample ``sample_index``'s generator: ``(seed + sample_index)
        mod 2**64``, so the samples of one request differ, each reproduces, and a
        seed near :data:`MAX_SEED` wraps to 0, 1, ... instead of overflowing
        (the seed of sample 0 is ``seed`` itself).

        Raises:
            ValueError: the request is unseeded, or ``sample_index`` is negative.
        """
        if self.seed is None:
            raise ValueError("sample_seed: the request has no seed")
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        return (self.seed + sample_index) % (MAX_SEED + 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Logits depend on the tokens generated so far (penalties, ``min_tokens``'s EOS mask)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0)


def _is_int(value) -> bool:
    """A Python or NumPy integer; bool is not one (``n=True`` is a mistake, not 1)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _sequence(name: str, value) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        raise InvalidParameterError(name, f"must be a sequence, got {value!r}") from None


def _token_ids(value) -> tuple[int, ...]:
    ids = () if value is None else _sequence("stop_token_ids", value)
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None:
        raise InvalidParameterError("stop_token_ids", f"token ids must be integers, got {bad!r}")
    return tuple(operator.index(t) for t in ids)
