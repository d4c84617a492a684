"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn), beside the gRPC one.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream`` as server-sent events, ``data: <json>\\n\\n`` frames ending with
``data: [DONE]``, and ``stream_options.include_usage``), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``.
Request fields follow the OpenAI API plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``) and structured outputs:
``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` on both
endpoints, at most one per request (docs/structured_outputs.md). Chat completions take
``tools``, ``tool_choice`` and ``parallel_tool_calls`` and answer ``tool_calls``
(docs/tool_calling.md; :mod:`tandem.router.tool_calling`,
:mod:`tandem.router.tool_parsers`).

A request is converted to the gRPC API's ``GenerateRequest`` and checked by the
same :class:`~tandem.router.validation.RequestValidator`, so both front ends
accept and refuse exactly the same inputs; a refusal is HTTP 400 with vLLM's
error shape ``{"error": {"message", "type", "param", "code"}}`` whose ``param``
is the OpenAI field name (``top_p``, ``messages[0].role``). A body that is not
JSON, not UTF-8, or holds a string that is not valid Unicode (a lone surrogate,
``"\ud800"``) is 400 too. An unknown model is 404; a body over
:data:`MAX_BODY_BYTES` 413 (by its Content-Length or, chunked, once it grows past
it); a request head over :data:`MAX_HEADER_BYTES` 431; no live decode worker 503; a
failure after the stream started is one ``data: {"error": ...}`` frame, then
``data: [DONE]``. Every error, the HTTP server's own included, has that shape,
and ``/openapi.json`` documents it (and ``/health``, ``/metrics`` as text).
Messages never carry a traceback or an internal path.

A client that disconnects (or cancels a stream) closes the request's
orchestrator generator there and then, which aborts it on the workers, frees its
blocks and counts it (``tandem:request_aborts{source="http_disconnect"}``, once
per prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import socket
import time
import uuid
from typing import Annotated, Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.router.orchestrator import (FAIL_WITH_SIBLINGS, Orchestrator, RequestFailed,
                                        ServiceUnavailable)
from tandem.router.tool_calling import (ToolPlan, ToolRequestError, plan_tools, template_message,
                                        template_tools)
from tandem.router.tool_parsers import ToolCallStream, extract_tool_calls
from tandem.router.validation import (CONSTRAINT_FIELDS, MAX_PROMPT_BYTES, InvalidRequestError,
                                      RequestValidator, ValidatedRequest)
from tandem.router.worker_client import WorkerError
from tandem.v1 import tandem_pb2 as pb

logger = logging.getLogger(__name__)

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


# -- errors ----------------------------------------------------------------------------------

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
_ERROR_RESPONSES: dict = {code: {"model": ErrorResponse, "description": why}
                          for code, why in _ERRORS.items()}
# A route answering text gets its errors documented explicitly as JSON: FastAPI would
# put a `model` under the route's own media type.
_TEXT_ROUTE_ERRORS: dict = {
    code: {"description": why, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for code, why in _ERRORS.items()}
_GENERATION_RESPONSES: dict = {
    200: {"description": "JSON; with `stream: true`, server-sent events of JSON chunks "
                         "ending with `data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **_ERROR_RESPONSES,
    429: {"model": ErrorResponse, "description": "the API key's rate limit or concurrency "
                                                 "cap refused it",
          "headers": {"Retry-After": {"description": "whole seconds to wait",
                                      "schema": {"type": "integer"}}}},
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


def _set(msg, name: str, value, param: str) -> None:
    """``msg.name = value`` for a protobuf field, refusing values its type cannot
    hold (e.g. a negative ``n``) as a 400 naming ``param``."""
    try:
        setattr(msg, name, value)
    except (ValueError, TypeError):
        raise APIError(400, f"{param}: {value!r} is out of range", param) from None


def _sampling_message(r: _Sampling, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    _set(sp, "n", r.n, "n")
    if max_tokens is not None:
        _set(sp, "max_tokens", max_tokens, "max_tokens")
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        value = getattr(r, name)
        if value is not None:
            _set(sp, name, value, name)
    for name in ("min_p", "presence_penalty", "frequency_penalty", "include_stop_str_in_output",
                 "ignore_eos", "min_tokens", "skip_special_tokens", "use_beam_search"):
        _set(sp, name, getattr(r, name), name)
    if r.length_penalty is not None:
        _set(sp, "length_penalty", r.length_penalty, "length_penalty")
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    try:
        sp.stop.extend(stop)
    except (ValueError, TypeError):
        raise APIError(400, "stop: must be a string or a list of strings", "stop") from None
    try:
        sp.stop_token_ids.extend(r.stop_token_ids or [])
    except (ValueError, TypeError):
        raise APIError(400, "stop_token_ids: every id must be in [0, 2^32)",
                       "stop_token_ids") from None
    if logprobs is not None:
        _set(sp, "logprobs", logprobs, "logprobs")
    return sp


_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# An engine's structured-outputs field (a worker's refusal) -> the request field.
_ENGINE_CONSTRAINT_PARAMS = {"structured_outputs.json": "guided_json",
                             "structured_outputs.regex": "guided_regex",
                             "structured_outputs.choice": "guided_choice",
                             "structured_outputs.grammar": "guided_grammar",
                             "structured_outputs.json_object": "response_format"}


def _set_constraint(sp: pb.SamplingParams, r: _Sampling) -> str | None:
    """Fill ``sp``'s ``constraint`` from ``response_format`` or a ``guided_*`` field.

    Returns:
        The request field that set it (for error messages), or None.

    Raises:
        APIError: 400 naming the field: two constraints, an unknown
            ``response_format`` type, a ``json_schema`` without its ``schema``.
    """
    found: list[tuple[str, str, Any]] = []       # (request field, proto field, value)
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
            found.append(("response_format", "json_schema", schema))
        elif kind != "text":
            raise APIError(400, "response_format.type: must be 'text', 'json_object' or "
                                f"'json_schema', got {kind!r}", "response_format")
    for name, proto_field in _GUIDED.items():
        value = getattr(r, name)
        if value is not None:
            found.append((name, proto_field, value))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: only one of response_format (json_object or "
                            "json_schema), guided_json, guided_regex, guided_choice and "
                            f"guided_grammar may be set, got {found[0][0]} too", found[1][0])
    param, proto_field, value = found[0]
    if proto_field == "json_schema" and not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)
    try:
        if proto_field == "choice":
            sp.choice.choices.extend(value)
        else:
            setattr(sp, proto_field, value)
    except (ValueError, TypeError):
        raise APIError(400, f"{param}: {value!r} is not valid here", param) from None
    return param


def _refuse_unsupported(r: _Sampling) -> None:
    if r.logit_bias:
        raise APIError(400, "logit_bias: not supported", "logit_bias")
    if r.stream_options is not None and not r.stream:
        # As vLLM and OpenAI answer: the options would be silently ignored.
        raise APIError(400, "stream_options: only allowed when stream is true",
                       "stream_options")
    try:
        pb.GenerateRequest(priority=r.priority)
    except ValueError:
        raise APIError(400, f"priority: {r.priority} is out of range", "priority") from None


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


# -- the app ---------------------------------------------------------------------------------

class OpenAIServer:
    """The HTTP front end over an :class:`Orchestrator`.

    Args:
        orchestrator: runs the requests (shared with the gRPC front end).
        tokenizer: the served model's tokenizer.
        model_info: ``model_name``, ``max_model_len`` (as for the gRPC service).
        metrics: optional :class:`~tandem.router.metrics.Metrics` (``/metrics``).
        healthy: returns whether the cluster can serve (``/health``).
        api_keys: optional key store with ``verify(key) -> key id | None``; when
            given and non-empty every endpoint but ``open_paths`` needs
            ``Authorization: Bearer <key>`` (401 otherwise).
        limiter: optional :class:`~tandem.control.rate_limits.RateLimiter`: each
            generation request takes a token and a concurrency slot of its key
            (``anonymous`` without keys), else 429 with ``Retry-After``. Should
            Redis be unreachable, requests are admitted (and a warning logged).
        open_paths: paths served without a key.
        tool_call_parser: the parser (``hermes``, ``llama3_json``) that reads tool calls
            out of ``tool_choice="auto"`` outputs; None refuses ``auto`` (400), as vLLM
            does without ``--enable-auto-tool-choice``.

    Raises:
        ValueError: an unknown ``tool_call_parser``.
    """

    def __init__(self, orchestrator: Orchestrator, tokenizer, model_info: dict, metrics=None,
                 healthy=lambda: True, api_keys=None, limiter=None,
                 open_paths=("/health", "/metrics"), tool_call_parser: str | None = None):
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.info = model_info
        self.model_name = model_info["model_name"]
        self.validator = RequestValidator(tokenizer, model_info["max_model_len"])
        self.metrics = metrics
        self.healthy = healthy
        self.api_keys = api_keys
        self.limiter = limiter
        self.open_paths = tuple(open_paths)
        if tool_call_parser is not None:
            from tandem.router.tool_parsers import get_tool_parser

            get_tool_parser(tool_call_parser)
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        self.app = self._build_app()
        self._server = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    # -- wiring ----------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="Tandem OpenAI-compatible API", version="1")

        @app.exception_handler(APIError)
        async def api_error(_request, exc: APIError):
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        @app.exception_handler(RequestValidationError)
        async def schema_error(_request, exc: RequestValidationError):
            errors = exc.errors()
            # Of a union's members' errors the first is the first member's ("should be
            # a valid string" for a string holding a surrogate): name the real one.
            first = next((e for e in errors if e.get("type") == "unicode_surrogate"),
                         errors[0] if errors else {})
            if first.get("type") == "json_invalid":
                why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
                err = APIError(400, f"the body is not valid JSON: {why}")
            else:
                param = _loc_param(first.get("loc", ()))
                msg = first.get("msg", "invalid request")
                err = APIError(400, f"{param}: {msg}" if param else msg, param)
            return JSONResponse(err.body(), status_code=400)

        @app.exception_handler(HTTPException)
        async def http_error(_request, exc: HTTPException):
            # Starlette's and FastAPI's own refusals (unknown path, wrong method, a
            # body FastAPI cannot parse, the body cap in _AuthMiddleware), in the
            # API's error shape rather than {"detail": ...}.
            message = exc.detail if isinstance(exc.detail, str) else \
                http.HTTPStatus(exc.status_code).phrase
            if isinstance(exc.__cause__, UnicodeDecodeError):
                message = "the body is not valid JSON: it is not UTF-8"
            elif isinstance(exc.__cause__, RecursionError):
                message = "the body is not valid JSON: it is nested too deeply"
            elif exc.__cause__ is not None and exc.status_code == 400:
                message = "the body is not valid JSON"
            err = APIError(exc.status_code, message)
            return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

        @app.exception_handler(Exception)
        async def unexpected(_request, exc: Exception):
            logger.exception("HTTP request failed")
            return JSONResponse(APIError(500, "internal error").body(), status_code=500)

        app.add_middleware(_AuthMiddleware, server=self)
        text = {"content": {"text/plain": {"schema": {"type": "string"}}}}

        @app.get("/health", response_class=PlainTextResponse,
                 responses={**_TEXT_ROUTE_ERRORS, 503: {**text, "description": "cannot serve"}})
        async def health():
            return PlainTextResponse("", status_code=200 if self.healthy() else 503)

        @app.get("/metrics", response_class=PlainTextResponse, responses=_TEXT_ROUTE_ERRORS)
        async def metrics():
            if self.metrics is None:
                raise APIError(404, "metrics are not enabled on this server")
            from prometheus_client import CONTENT_TYPE_LATEST

            return PlainTextResponse(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", responses=_ERROR_RESPONSES)
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "tandem", "root": self.model_name, "parent": None,
                "max_model_len": self.info["max_model_len"]}]}

        @app.post("/tokenize", responses=_ERROR_RESPONSES)
        async def tokenize(body: TokenizeRequest):
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise APIError(400, "prompt: exactly one of prompt or messages must be set",
                               "prompt")
            if body.prompt is not None:
                _check_size("prompt", len(body.prompt.encode()))
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                ids = self._chat_ids(body.messages, body.add_generation_prompt)
            return {"count": len(ids), "max_model_len": self.info["max_model_len"],
                    "tokens": ids}

        @app.post("/detokenize", responses=_ERROR_RESPONSES)
        async def detokenize(body: DetokenizeRequest):
            self._check_model(body.model)
            vocab = self.tokenizer.vocab_size
            for i, t in enumerate(body.tokens):
                if not 0 <= t < vocab:
                    raise APIError(400, f"tokens[{i}]: token id {t} is not in [0, {vocab})",
                                   f"tokens[{i}]")
            return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

        @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
        async def completions(body: CompletionRequest, request: Request):
            return await self._completions(body, request)

        @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            return await self._chat(body, request)

        return app

    def _needs_key(self, path: str) -> bool:
        return bool(self.api_keys) and not any(path == p for p in self.open_paths)

    def _check_key(self, headers: list[str]) -> tuple[APIError | None, str | None]:
        """``(error, key id)`` for the request's ``Authorization`` header values."""
        from tandem.router.auth import parse_bearer

        if not headers:
            return APIError(401, "missing API key: send 'Authorization: Bearer <key>'"), None
        key = parse_bearer(headers[0]) if len(headers) == 1 else None
        if key is None:
            return APIError(401, "send exactly one 'Authorization: Bearer <key>' header"), None
        key_id = self.api_keys.verify(key)
        if key_id is None:
            return APIError(401, "invalid API key"), None
        return None, key_id

    async def _admit(self, request, request_id: str) -> str | None:
        """Take the request's rate-limit token and concurrency slot; the key id to
        release it under (None: nothing to release).

        Raises:
            APIError: 429 when a limit refuses it.
        """
        if self.limiter is None:
            return None
        from tandem.control.rate_limits import refusal_message

        key_id = request.scope.get("state", {}).get("api_key_id") or "anonymous"
        verdict = await self.limiter.admit_or_pass(key_id, request_id)
        if verdict is None:
            return None
        if not verdict.allowed:
            if self.metrics:
                self.metrics.request_rate_limited(verdict.reason)
            raise APIError(429, refusal_message(verdict), retry_after_s=verdict.retry_after_s)
        return key_id

    def _release(self, key_id: str | None, request_id: str) -> None:
        if key_id is not None and self.limiter is not None:
            task = asyncio.ensure_future(asyncio.to_thread(self.limiter.release, key_id, request_id))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def start(self, host: str, port: int, tls=None) -> int:
        """Serve on ``host:port`` (0 = any free port) on the running event loop.

        Args:
            tls: a :class:`~tandem.router.tls.TLSConfig` to serve HTTPS (client
                certificates verified when it requires them); None: plain HTTP.

        Returns:
            The bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        ssl = {} if tls is None else dict(
            ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile, ssl_ca_certs=tls.ca_certs,
            ssl_cert_reqs=tls.ssl_cert_reqs)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=2,
                                http=_http_protocol(),
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES, **ssl)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None   # the owner handles signals
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()          # raises what stopped it
                raise OSError(f"HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
            self._server = None

    # -- helpers ---------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _check_serving(self) -> None:
        if not self.orchestrator.cluster.can_serve:
            raise APIError(503, "no decode worker is alive")

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        from jinja2 import TemplateError  # comes with transformers' chat templates

        conversation = [{"role": m.role, "content": _message_text(m, i)}
                        for i, m in enumerate(messages)]
        _check_size("messages", sum(len(m["content"].encode()) for m in conversation))
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt)
        except TemplateError as exc:       # the template refused the conversation
            raise APIError(400, f"messages: rejected by the chat template: {exc}",
                           "messages") from None
        except ValueError as exc:          # "messages...: why"
            param, _, message = str(exc).partition(": ")
            raise APIError(400, f"{param}: {message}", param) from None

    def _tool_chat_ids(self, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """The prompt of a chat request with tools or tool turns: the conversation and
        the tools through the chat template, with the checks the validator makes of
        chat text (roles, no control tokens) applied to every string it renders.

        Raises:
            APIError: 400 naming the field (``messages[1].tool_calls[0].function.arguments``,
                ``tools``).
        """
        from jinja2 import TemplateError  # comes with transformers' chat templates

        v = self.validator
        tools = template_tools(plan.tools)
        tools_text = json.dumps(tools, ensure_ascii=False) if tools else ""
        conversation, size = [], len(tools_text.encode())
        try:
            if tools:
                v.check_chat_text("tools", tools_text)
            for i, m in enumerate(body.messages):
                text = _message_text(m, i)
                v.check_chat_role(f"messages[{i}].role", m.role)
                v.check_chat_text(f"messages[{i}].content", text)
                for name in ("tool_call_id", "name"):
                    if getattr(m, name):
                        v.check_chat_text(f"messages[{i}].{name}", getattr(m, name))
                if m.tool_calls:
                    calls_text = json.dumps(m.tool_calls, ensure_ascii=False)
                    v.check_chat_text(f"messages[{i}].tool_calls", calls_text)
                    size += len(calls_text.encode())
                size += len(text.encode())
                conversation.append(template_message(m.role, text, m.tool_calls,
                                                     m.tool_call_id, m.name, i))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None
        _check_size("messages", size)
        try:
            return self.tokenizer.apply_chat_template(conversation, body.add_generation_prompt,
                                                      tools=tools)
        except TemplateError as exc:       # the template refused the conversation
            raise APIError(400, f"messages: rejected by the chat template: {exc}",
                           "messages") from None
        except ValueError as exc:          # "messages...: why"
            param, _, message = str(exc).partition(": ")
            raise APIError(400, f"{param}: {message}", param) from None

    def _invalid(self, exc: InvalidRequestError, chat: bool, completion_tokens=False,
                 constraint_param: str | None = None) -> APIError:
        param = _param_name(exc.field, chat, completion_tokens, constraint_param)
        if self.metrics:
            self.metrics.invalid_request(exc.field)
        return APIError(400, f"{param}: {exc.message}", param)

    def _validate(self, req: pb.GenerateRequest, chat: bool, fill_max_tokens: bool,
                  completion_tokens: bool = False,
                  constraint_param: str | None = None) -> ValidatedRequest:
        try:
            return self.validator.validate(req, fill_max_tokens=fill_max_tokens)
        except InvalidRequestError as exc:
            raise self._invalid(exc, chat, completion_tokens, constraint_param) from None

    @contextlib.asynccontextmanager
    async def _running(self, requests: list[ValidatedRequest]):
        """Run ``requests`` concurrently: ``async with self._running(rs) as events``,
        then ``async for i, ev in events`` gives ``(prompt index, SampleEvent)`` as they
        come. Leaving the block stops the requests still running: each counts as an
        abort by ``http_disconnect`` when the block is left by a cancel or a close
        (the client went away), as an error when by an exception (one request
        failed: the HTTP request fails, with every prompt of it)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        started = [False] * len(requests)

        async def one(i: int, v: ValidatedRequest) -> None:
            started[i] = True
            events = self.orchestrator.generate(v, "http_disconnect")
            try:
                async with contextlib.aclosing(events):
                    async for ev in events:
                        queue.put_nowait((i, ev))
            except BaseException as exc:            # handed to the consumer
                queue.put_nowait((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise
            finally:
                queue.put_nowait((i, done))

        async def events() -> AsyncIterator[tuple]:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if not isinstance(item, asyncio.CancelledError):
                        raise item
                else:
                    yield i, item

        async def stop(message: str | None) -> None:
            for i, t in enumerate(tasks):
                if not t.done():
                    if not started[i] and message is None and self.metrics:
                        # Cancelled before the orchestrator saw it: counted here.
                        self.metrics.request_cancelled("http_disconnect")
                    t.cancel(message)
            await asyncio.gather(*tasks, return_exceptions=True)

        tasks = [asyncio.ensure_future(one(i, v)) for i, v in enumerate(requests)]
        try:
            yield events()
        except (asyncio.CancelledError, GeneratorExit):
            await stop(None)
            raise
        except BaseException:
            await stop(FAIL_WITH_SIBLINGS)
            raise
        else:
            await stop(FAIL_WITH_SIBLINGS)       # none left running on a normal end

    @staticmethod
    def _http_error(exc: BaseException) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, InvalidParameterError):
            field = getattr(exc, "field", None)
            if field in _ENGINE_CONSTRAINT_PARAMS:     # compiled by a worker, refused there
                param = _ENGINE_CONSTRAINT_PARAMS[field]
                return APIError(400, f"{param}: {exc.message}", param)
            return APIError(400, str(exc), field)
        if isinstance(exc, WorkerError):       # its text is the worker's, for the log only
            logger.warning("HTTP request: %s", exc)
            return APIError(503, f"worker {exc.worker_id} failed while serving the request; "
                                 "try again")
        if isinstance(exc, ServiceUnavailable):
            return APIError(503, str(exc))
        if isinstance(exc, RequestFailed):
            return APIError(500, str(exc))
        logger.error("request failed", exc_info=exc)
        return APIError(500, "internal error")

    async def _collect(self, requests: list[ValidatedRequest], request) -> dict:
        """Run to the end (non-streaming); a client disconnect cancels the requests."""
        finals: dict[tuple[int, int], Any] = {}

        async def run() -> None:
            async with self._running(requests) as events:
                async for i, ev in events:
                    if ev.sample.finished:
                        finals[(i, ev.sample.index)] = ev.sample

        task = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():          # the client left: abort (and count) on the workers
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
        exc = task.exception()
        if exc is not None:
            raise self._http_error(exc)
        for s in finals.values():
            _check_failed(s)
        return finals

    # -- completions -----------------------------------------------------------------------
    def _completion_requests(self, body: CompletionRequest) -> tuple[list[ValidatedRequest], list]:
        self._check_model(body.model)
        _refuse_unsupported(body)
        if body.suffix:
            raise APIError(400, "suffix: not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")
        p = body.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise APIError(400, f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request, "
                                f"got {len(prompts)}", "prompt")
        sampling = _sampling_message(body, body.max_tokens, body.logprobs)
        constraint_param = _set_constraint(sampling, body)
        if body.echo and body.logprobs is not None:     # the prompt's own, as vLLM echoes them
            sampling.prompt_logprobs = body.logprobs
        base = uuid.uuid4().hex
        out = []
        for i, prompt in enumerate(prompts):
            req = pb.GenerateRequest(request_id=f"cmpl-{base}-{i}", sampling=sampling,
                                     priority=body.priority, stream=body.stream)
            if isinstance(prompt, str):
                req.prompt = prompt
            else:
                try:
                    req.token_ids.ids.extend(prompt)
                except (ValueError, TypeError):
                    raise APIError(400, "prompt: token ids must be in [0, 2^32)",
                                   "prompt") from None
            out.append(self._validate(req, chat=False, fill_max_tokens=False,
                                      constraint_param=constraint_param))
        return out, prompts

    def _prompt_text(self, v: ValidatedRequest) -> str:
        return self.tokenizer.decode(list(v.prompt_token_ids), skip_special_tokens=False)

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, logprobs, offset: int, prompt_ids=None) -> dict:
        """OpenAI completion logprobs of ``logprobs`` (generated tokens'), after the
        prompt's when ``prompt_ids`` is given (echo: the prompt's own entries, None
        for the first token, which nothing precedes)."""
        entries = []
        if prompt_ids is not None:
            entries = [(t, None, None) if lp is None else (t, lp.logprob, lp.top)
                       for t, lp in zip(prompt_ids, logprobs[0])]
            logprobs = logprobs[1]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in logprobs]
        tokens = [self._token_str(t) for t, _, _ in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [None if top is None else {self._token_str(t): v for t, v in top}
                                 for _, _, top in entries],
                "text_offset": offsets}

    async def _completions(self, body: CompletionRequest, request):
        requests, _ = self._completion_requests(body)
        self._check_serving()
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n
        key_id = await self._admit(request, rid)
        if body.stream:
            return self._sse(self._completion_stream(body, requests, request, rid, created),
                             on_close=lambda: self._release(key_id, rid))
        try:
            finals = await self._collect(requests, request)
        finally:
            self._release(key_id, rid)
        choices, usage = [], _Usage()
        for i, v in enumerate(requests):
            prompt_text = self._prompt_text(v) if body.echo else ""
            usage.add_prompt(len(v.prompt_token_ids))
            for j in range(n):
                s = finals[(i, j)]
                usage.add_sample(s, i)
                text = prompt_text + "".join(s.pieces)
                lps = None
                if body.logprobs is not None and body.echo:
                    lps = self._completion_logprobs((s.prompt_logprobs, s.logprobs), 0,
                                                    list(v.prompt_token_ids))
                elif body.logprobs is not None:
                    lps = self._completion_logprobs(s.logprobs, 0)
                choices.append({"index": i * n + j, "text": text, "logprobs": lps,
                                "finish_reason": s.finish_reason,
                                "stop_reason": _stop_reason(s)})
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    async def _completion_stream(self, body, requests, request, rid, created):
        n = body.n
        base = {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name}
        usage = _Usage()
        for v in requests:
            usage.add_prompt(len(v.prompt_token_ids))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        offsets: dict[int, int] = {}
        scored_echo = body.echo and body.logprobs is not None
        if body.echo and not scored_echo:
            for i, v in enumerate(requests):
                text = self._prompt_text(v)
                for j in range(n):
                    yield {**base, "choices": [{"index": i * n + j, "text": text,
                                                "logprobs": None, "finish_reason": None}]}
        async with self._running(requests) as events:
            async for i, ev in events:
                # The update, not the sample: _running queues events, so the sample
                # may have run ahead (finished) by the time an earlier event is read.
                s, upd = ev.sample, ev.update
                finished = upd.finish_reason is not None
                idx = i * n + s.index
                _check_failed(upd)
                if scored_echo and upd.prompt_logprobs is not None:
                    # The prompt's scores come with the sample's first tokens: echo it now.
                    ids = list(requests[i].prompt_token_ids)
                    lps = self._completion_logprobs((upd.prompt_logprobs, ()), 0, ids)
                    offsets[idx] = sum(len(t) for t in lps["tokens"])
                    yield {**base, "choices": [{"index": idx,
                                                "text": self._prompt_text(requests[i]),
                                                "logprobs": lps, "finish_reason": None}]}
                if not (upd.text or upd.token_ids or finished):
                    continue
                lps = None
                if body.logprobs is not None:
                    lps = self._completion_logprobs(upd.logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps["tokens"])
                choice = {"index": idx, "text": upd.text, "logprobs": lps,
                          "finish_reason": upd.finish_reason}
                if finished:
                    choice["stop_reason"] = _stop_reason(upd)
                    usage.add_sample(s, i)
                chunk = {**base, "choices": [choice]}
                if include_usage and continuous:
                    chunk["usage"] = usage.body()
                yield chunk
        if include_usage:
            yield {**base, "choices": [], "usage": usage.body()}

    # -- chat ------------------------------------------------------------------------------
    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        try:
            return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                              self.tool_call_parser)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def _chat_request(self, body: ChatCompletionRequest,
                      plan: ToolPlan | None = None) -> ValidatedRequest:
        self._check_model(body.model)
        _refuse_unsupported(body)
        plan = plan or self._tool_plan(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs to be true", "top_logprobs")
        if not body.messages:
            raise APIError(400, "messages: must contain at least one message", "messages")
        uses_completion = body.max_completion_tokens is not None
        max_tokens = body.max_completion_tokens if uses_completion else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            sampling = _sampling_message(body, max_tokens, logprobs)
        except APIError as exc:
            if exc.param == "logprobs":
                exc.param, exc.message = "top_logprobs", exc.message.replace("logprobs", "top_logprobs", 1)
            if exc.param == "max_tokens" and uses_completion:
                exc.param = "max_completion_tokens"
            raise
        constraint_param = _set_constraint(sampling, body)
        if plan.schema is not None:
            # A forced tool choice is a JSON-schema constraint (vLLM's).
            if constraint_param is not None:
                raise APIError(400, f"tool_choice: {plan.mode!r} cannot be combined with "
                                    f"{constraint_param}", "tool_choice")
            sampling.json_schema = json.dumps(plan.schema, ensure_ascii=False)
            constraint_param = "tools"
        req = pb.GenerateRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", sampling=sampling,
                                 priority=body.priority, stream=body.stream)
        if plan.tools or any(m.tool_calls or m.tool_call_id is not None for m in body.messages):
            # Tools and tool turns reach the template only here (the gRPC chat message
            # has role and content): the prompt goes on as token ids.
            req.token_ids.ids.extend(self._tool_chat_ids(body, plan))
        else:
            for i, m in enumerate(body.messages):
                req.chat.messages.append(pb.ChatMessage(role=m.role,
                                                        content=_message_text(m, i)))
        return self._validate(req, chat=True, fill_max_tokens=max_tokens is None,
                              completion_tokens=uses_completion,
                              constraint_param=constraint_param)

    def _chat_logprobs(self, logprobs) -> dict:
        def entry(token_id: int, lp: float) -> dict:
            t = self._token_str(token_id)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    async def _chat(self, body: ChatCompletionRequest, request):
        self._check_model(body.model)          # an unknown model first: 404 before any 400
        plan = self._tool_plan(body)
        v = self._chat_request(body, plan)
        self._check_serving()
        rid, created = v.request_id, int(time.time())
        key_id = await self._admit(request, rid)
        if body.stream:
            return self._sse(self._chat_stream(body, v, request, rid, created, plan),
                             on_close=lambda: self._release(key_id, rid))
        try:
            finals = await self._collect([v], request)
        finally:
            self._release(key_id, rid)
        usage = _Usage()
        usage.add_prompt(len(v.prompt_token_ids))
        choices = []
        for j in range(body.n):
            s = finals[(0, j)]
            usage.add_sample(s)
            message, finish_reason = _chat_message("".join(s.pieces), s.finish_reason, plan)
            choices.append({"index": j, "message": message,
                            "logprobs": self._chat_logprobs(s.logprobs) if body.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": _stop_reason(s)})
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    async def _chat_stream(self, body, v, request, rid, created, plan: ToolPlan | None = None):
        # Per sample: reads tool calls out of its deltas (None: plain content).
        tool_streams = {j: ToolCallStream(plan.parser, plan.max_calls) for j in range(body.n)} \
            if plan is not None and plan.parser is not None else {}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        usage = _Usage()
        usage.add_prompt(len(v.prompt_token_ids))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        # The role chunks go out with the first output, as vLLM sends them: clients take
        # the first chunk's arrival as TTFT (`vllm bench serve` does), so sent before
        # the prefill they would report a TTFT of ~0 and fold the prefill into TPOT.
        # A request that fails first gets its error frame first.
        role_sent = False

        def role_chunks():
            return [{**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
                    for j in range(body.n)]

        async with self._running([v]) as events:
            async for _, ev in events:
                s, upd = ev.sample, ev.update       # the update: see _completion_stream
                finished = upd.finish_reason is not None
                _check_failed(upd)
                if not (upd.text or upd.token_ids or finished):
                    continue
                if not role_sent:
                    role_sent = True
                    for chunk in role_chunks():
                        yield chunk
                finish_reason = upd.finish_reason
                if tool_streams:
                    delta, finish_reason = _tool_delta(tool_streams[s.index], upd.text,
                                                       finish_reason)
                    if not (delta or finished or body.logprobs):
                        continue               # held back: may start a tool call
                else:
                    delta = {"content": upd.text} if upd.text or not finished else {}
                choice = {"index": s.index, "delta": delta,
                          "logprobs": self._chat_logprobs(upd.logprobs) if body.logprobs else None,
                          "finish_reason": finish_reason}
                if finished:
                    choice["stop_reason"] = _stop_reason(upd)
                    usage.add_sample(s)
                chunk = {**base, "choices": [choice]}
                if include_usage and continuous:
                    chunk["usage"] = usage.body()
                yield chunk
        if include_usage:
            yield {**base, "choices": [], "usage": usage.body()}

    # -- server-sent events ----------------------------------------------------------------
    def _sse(self, chunks: AsyncIterator[dict], on_close=None):
        """Stream ``chunks`` as server-sent events. A client that goes away closes
        ``chunks`` (which aborts and counts its requests) before the response ends."""
        async def frames():
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except Exception as exc:              # after the headers: an error frame
                yield f"data: {json.dumps(self._http_error(exc).body())}\n\n"
            finally:
                if on_close is not None:
                    on_close()
            yield "data: [DONE]\n\n"

        return _EventStream(frames(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})


class _EventStream(StreamingResponse):
    """A :class:`StreamingResponse` that closes its body however the response ends.
    After a disconnect starlette stops reading the body and leaves it to the garbage
    collector, which would abort its requests late, whenever it runs."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _stop_reason(s) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the sample
    (None for EOS, length, abort; never a worker's error text). ``s``: a sample or
    the update that finished it."""
    return s.stop_reason if s.finish_reason == "stop" else None


def _chat_message(text: str, finish_reason: str | None,
                  plan: ToolPlan) -> tuple[dict, str | None]:
    """A finished sample's ``message`` and ``finish_reason``: with tool calls found in
    ``text`` (``plan``'s parser), ``content`` is the text before them (None if none),
    ``tool_calls`` the calls and the finish reason ``tool_calls``."""
    if plan.parser is not None:
        content, calls = extract_tool_calls(plan.parser, text, plan.max_calls)
        if calls:
            return ({"role": "assistant", "content": content,
                     "tool_calls": [c.to_openai() for c in calls]}, "tool_calls")
    return {"role": "assistant", "content": text}, finish_reason


def _tool_delta(stream: ToolCallStream, text: str,
                finish_reason: str | None) -> tuple[dict, str | None]:
    """A chunk's ``delta`` and ``finish_reason`` for ``text`` (a sample's new text) read
    by its :class:`ToolCallStream`; ``finish_reason`` not None: the sample ended."""
    content, calls = stream.feed(text) if text else ("", [])
    if finish_reason is not None:
        more, more_calls = stream.finish()
        content, calls = content + more, calls + more_calls
        if stream.complete:               # as the non-streaming answer decides it
            finish_reason = "tool_calls"
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta, finish_reason


def _check_failed(s) -> None:
    """A sample a worker failed ends the response with a 500 (the worker's message is
    logged by the orchestrator, not sent). ``s``: a sample or one of its updates."""
    if s.finish_reason == "error":
        raise APIError(500, "generation failed on a worker")


def _head_bytes(scope) -> int:
    """The size of the request line and headers as the client sent them (give or
    take the whitespace around header values, which h11 strips)."""
    target = len(scope.get("raw_path") or b"") + (len(scope["query_string"]) + 1
                                                  if scope.get("query_string") else 0)
    line = len(scope["method"]) + 1 + target + len(" HTTP/") + len(scope["http_version"]) + 2
    return line + sum(len(k) + 2 + len(v) + 2 for k, v in scope["headers"]) + 2


class _AuthMiddleware:
    """Checks ``Authorization: Bearer <key>`` before any route runs, refuses a head
    over :data:`MAX_HEADER_BYTES` (431) and a body over :data:`MAX_BODY_BYTES` (413)
    by its Content-Length or while it streams in (a plain ASGI middleware, so
    bodies and disconnects pass through untouched)."""

    def __init__(self, app, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # h11 checks its cap (uvicorn's h11_max_incomplete_event_size) only on a head
        # still incomplete after a read: one that arrives whole in one read, up to a
        # socket read's size, passes it. Measured here, every head gets the same cap.
        if _head_bytes(scope) > MAX_HEADER_BYTES:
            err = APIError(431, f"the request line and headers must be at most "
                                f"{MAX_HEADER_BYTES} bytes")
            await JSONResponse(err.body(), status_code=431)(scope, receive, send)
            return
        too_large = f"the request body must be at most {MAX_BODY_BYTES} bytes"
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            err = APIError(413, too_large)
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    # An HTTPException: FastAPI's body reading passes it on to the
                    # app's handler (any other exception becomes a 400 there).
                    raise HTTPException(413, too_large)
            return message

        receive_ = counted_receive
        if self.server._needs_key(scope["path"]):
            err, key_id = self.server._check_key(
                [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"])
            if err is None:
                scope.setdefault("state", {})["api_key_id"] = key_id
            else:
                response = JSONResponse(err.body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive_, send)


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


async def _wait_disconnect(request) -> None:
    """Returns when the HTTP client disconnects (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _http_protocol():
    """uvicorn's h11 protocol, answering a request that h11 refuses in the API's
    error shape, with h11's status: 431 for a head over :data:`MAX_HEADER_BYTES`
    ("Receive buffer too long"), 400 for a malformed one. uvicorn's own answer is a
    plain-text 400 for both."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Connection(h11.Connection):
        error_status = 400

        def next_event(self):
            try:
                return super().next_event()
            except h11.RemoteProtocolError as exc:
                self.error_status = exc.error_status_hint
                raise

    class HTTPProtocol(H11Protocol):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.conn = Connection(h11.SERVER, config.h11_max_incomplete_event_size)

        def send_400_response(self, msg: str) -> None:
            if self.conn.error_status == 431:
                err = APIError(431, f"the request line and headers must be at most "
                                    f"{MAX_HEADER_BYTES} bytes")
            else:
                err = APIError(400, "invalid HTTP request")
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            self.transport.write(self.conn.send(h11.Response(
                status_code=err.status, headers=headers,
                reason=http.HTTPStatus(err.status).phrase.encode())))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

    return HTTPProtocol
