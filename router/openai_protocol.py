"""What the OpenAI-compatible HTTP front end reads and writes: the request models
(pydantic; OpenAI's fields plus vLLM's extras), the error shape and its statuses,
the limits on bodies and heads, the mapping of a request's sampling fields onto the
router's :class:`~tandem.router.generation_request.SamplingFields` (so both front
ends validate alike), and of the validator's field paths back onto OpenAI names. The
endpoints are :mod:`tandem.router.openai_completions`,
:mod:`tandem.router.openai_chat` and :mod:`tandem.router.openai_api` (the app).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from tandem.router.generation_request import Constraint, SamplingFields
from tandem.router.validation import CONSTRAINT_FIELDS, MAX_PROMPT_BYTES

MAX_BATCH_PROMPTS = 64
"""Prompts per ``/v1/completions`` request (a list prompt)."""
MAX_HEADER_BYTES = 64 * 1024
"""The request line and headers together; a larger head is refused (431)."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""A request body; a larger one is refused with 413 before it is read whole."""


# -- request schemas (OpenAI + vLLM extras) ----------------------------------------------------

def _valid_unicode(value: str) -> str:
    """``value`` if UTF-8 can encode it. JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no tokenizer, protobuf string or UTF-8 response can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "unicode_surrogate",
            "must be valid Unicode: character {position} is a lone surrogate ({code})",
            {"position": exc.start, "code": f"U+{ord(value[exc.start]):04X}"}) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string field of a request: refused (400 naming the field) unless valid Unicode."""


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    use_beam_search: bool = False     # vLLM's: the n choices are the beams, best first
    length_penalty: float | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Text
    content: Text | list[dict[str, Any]] | None = None
    # Tool calling: an assistant turn's calls, a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Text | None = None
    name: Text | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error's body (vLLM's shape)."""

    error: ErrorInfo


_ERRORS = {
    # A range, not 422: FastAPI documents its own 422 schema unless one is given.
    "4XX": "Refused: 400 bad input (`param` names the field), 401 no or a wrong API key, "
           f"404 unknown model, 413 a body over {MAX_BODY_BYTES} bytes, 431 a request head "
           f"over {MAX_HEADER_BYTES} bytes",
    "5XX": "500 a server fault; 503 no decode worker can serve (retry)",
}


def _check_size(param: str, size: int) -> None:
    """Refuse ``/tokenize`` text over the validator's cap (as a generation request
    would be) before tokenizing it on the event loop: 400 naming ``param``."""
    if size > MAX_PROMPT_BYTES:
        what = "the contents must" if param == "messages" else "must"
        raise APIError(400, f"{param}: {what} be at most {MAX_PROMPT_BYTES} bytes of UTF-8, "
                            f"got {size}", param)


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 413: "RequestTooLargeError",
             429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after_s: float = 0.0):
        # A message quoting the client's text must still encode as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        if self.status == 429:
            from tandem.control.rate_limits import retry_after_seconds

            return {"Retry-After": str(retry_after_seconds(self.retry_after_s))}
        return None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def _param_name(field: str, chat: bool, uses_completion_tokens: bool = False,
                constraint_param: str | None = None) -> str:
    """A validator field path (``sampling.top_p``, ``chat.messages[0].role``) as the
    OpenAI request's field name (``top_p``, ``messages[0].role``); a constraint's
    (``sampling.json_schema``) as ``constraint_param``, the field that carried it."""
    if field.startswith("sampling."):
        name = field.removeprefix("sampling.")
        if name in CONSTRAINT_FIELDS and constraint_param is not None:
            return constraint_param
        if name == "logprobs":
            return "top_logprobs" if chat else "logprobs"
        if name == "max_tokens" and uses_completion_tokens:
            return "max_completion_tokens"
        return name
    if field.startswith("chat.") or field == "chat":
        return field.removeprefix("chat.") if field != "chat" else "messages"
    if field in ("prompt", "input") or field.startswith("token_ids"):
        return "messages" if chat else "prompt"
    return field


def _loc_param(loc) -> str | None:
    """A pydantic error location (``("body", "messages", 0, "role")``) as a field name
    (``messages[0].role``), without the union-member tags pydantic inserts
    (``"str"``, ``"list[int]"``, ``"function-after[...]"``): ``("body", "prompt",
    "list[...]", 1)`` is ``prompt[1]``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# The gRPC API's integer types, which the HTTP front end holds its values to.
_U32, _I32, _U64 = (0, 2**32 - 1), (-2**31, 2**31 - 1), (0, 2**64 - 1)
_INT_RANGES = {"n": _U32, "max_tokens": _U32, "top_k": _I32, "seed": _U64, "min_tokens": _U32}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "length_penalty")
_PLAIN_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                 "use_beam_search")


def _in_range(param: str, value: int | None, bounds: tuple[int, int]) -> None:
    """Refuse an integer its gRPC API field could not hold (e.g. a negative ``n``) as a
    400 naming ``param``, as the gRPC front end's wire type refuses it."""
    if value is not None and not bounds[0] <= value <= bounds[1]:
        raise APIError(400, f"{param}: {value!r} is out of range", param)


def _f32(x: float) -> float:
    """``x`` in single precision, as a gRPC API ``float`` holds it (±inf past its range),
    so the same number means the same through both front ends."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _sampling_fields(r: _Sampling, max_tokens: int | None,
                     logprobs: int | None) -> tuple[SamplingFields, str | None]:
    """The request's sampling fields, and the request field that set its constraint
    (None: no constraint), for error messages.

    Raises:
        APIError: 400 naming the field: an integer out of its range, a constraint
            :func:`_constraint` refuses.
    """
    kw: dict[str, Any] = {name: getattr(r, name) for name in _INT_RANGES}
    kw["max_tokens"] = max_tokens
    for name, bounds in _INT_RANGES.items():
        _in_range(name, kw[name], bounds)
    stop_token_ids = tuple(r.stop_token_ids or ())
    if not all(_U32[0] <= t <= _U32[1] for t in stop_token_ids):
        raise APIError(400, "stop_token_ids: every id must be in [0, 2^32)", "stop_token_ids")
    _in_range("logprobs", logprobs, _U32)
    kw.update({name: None if getattr(r, name) is None else _f32(getattr(r, name))
               for name in _FLOAT_FIELDS})
    kw.update({name: getattr(r, name) for name in _PLAIN_FIELDS})
    constraint, param = _constraint(r)
    stop = (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())
    return SamplingFields(**kw, logprobs=logprobs, stop=stop, stop_token_ids=stop_token_ids,
                          constraint=constraint), param


# A guided_* field -> the StructuredOutputsParams field it sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


# An engine's structured-outputs field (a worker's refusal) -> the request field.
_ENGINE_CONSTRAINT_PARAMS = {"structured_outputs.json": "guided_json",
                             "structured_outputs.regex": "guided_regex",
                             "structured_outputs.choice": "guided_choice",
                             "structured_outputs.grammar": "guided_grammar",
                             "structured_outputs.json_object": "response_format"}


def _constraint(r: _Sampling) -> tuple[Constraint | None, str | None]:
    """The constraint of ``response_format`` or a ``guided_*`` field, and the request
    field that set it (for error messages); ``(None, None)`` when there is none.

    Raises:
        APIError: 400 naming the field: two constraints, an unknown
            ``response_format`` type, a ``json_schema`` without its ``schema``.
    """
    found: list[tuple[str, str, Any]] = []       # (request field, kind, value)
    rf = r.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", "json_object", True))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise APIError(400, "response_format.json_schema.schema: a JSON schema object "
                                    "is required", "response_format")
            found.append(("response_format", "json", schema))
        elif kind != "text":
            raise APIError(400, "response_format.type: must be 'text', 'json_object' or "
                                f"'json_schema', got {kind!r}", "response_format")
    for name, kind in _GUIDED.items():
        value = getattr(r, name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: only one of response_format (json_object or "
                            "json_schema), guided_json, guided_regex, guided_choice and "
                            f"guided_grammar may be set, got {found[0][0]} too", found[1][0])
    param, kind, value = found[0]
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)
    return Constraint(kind, tuple(value) if kind == "choice" else value), param


def _refuse_unsupported(r: _Sampling) -> None:
    if r.logit_bias:
        raise APIError(400, "logit_bias: not supported", "logit_bias")
    if r.stream_options is not None and not r.stream:
        # As vLLM and OpenAI answer: the options would be silently ignored.
        raise APIError(400, "stream_options: only allowed when stream is true",
                       "stream_options")
    if not _I32[0] <= r.priority <= _I32[1]:
        raise APIError(400, f"priority: {r.priority} is out of range", "priority")


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                           f"messages[{i}].content[{j}]")
        try:
            parts.append(_valid_unicode(part["text"]))
        except PydanticCustomError as exc:    # the schema leaves parts untyped
            param = f"messages[{i}].content[{j}].text"
            raise APIError(400, f"{param}: {exc.message()}", param) from None
    return "".join(parts)


def _stop_reason(s) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the sample
    (None for EOS, length, abort; never a worker's error text). ``s``: a sample or
    the update that finished it."""
    return s.stop_reason if s.finish_reason == "stop" else None


def _check_failed(s) -> None:
    """A sample a worker failed ends the response with a 500 (the worker's message is
    logged by the orchestrator, not sent). ``s``: a sample or one of its updates."""
    if s.finish_reason == "error":
        raise APIError(500, "generation failed on a worker")


class _Usage:
    """Token counts over a response's prompts and samples."""

    def __init__(self) -> None:
        self.prompt = self.completion = 0
        self.cached: dict[int, int] = {}       # per prompt: its samples share the prompt

    def add_prompt(self, n: int) -> None:
        self.prompt += n

    def add_sample(self, s, prompt_index: int = 0) -> None:
        self.completion += s.num_tokens
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), s.num_cached_tokens)

    def body(self) -> dict:
        out = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
               "total_tokens": self.prompt + self.completion}
        cached = sum(self.cached.values())
        if cached:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out
