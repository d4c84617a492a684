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

A request is converted to the router's
:class:`~tandem.router.generation_request.GenerationRequest`, as the gRPC front end
converts its own, and checked by the same
:class:`~tandem.router.validation.RequestValidator`, so both front ends accept and
refuse exactly the same inputs; a refusal is HTTP 400 with vLLM's error shape
``{"error": {"message", "type", "param", "code"}}`` whose ``param`` is the OpenAI
field name (``top_p``, ``messages[0].role``). Rate limits admit a request through
the same path as on gRPC (:mod:`tandem.router.admission`); a refusal is 429 with
``Retry-After``. A body that is not JSON, not UTF-8, or holds a string that is not
valid Unicode (a lone surrogate, ``"\ud800"``) is 400 too. An unknown model is
404; a body over :data:`MAX_BODY_BYTES` 413 (by its Content-Length or, chunked,
once it grows past it); a request head over :data:`MAX_HEADER_BYTES` 431; no live
decode worker 503; a failure after the stream started is one
``data: {"error": ...}`` frame, then ``data: [DONE]``. Every error, the HTTP
server's own included, has that shape, and ``/openapi.json`` documents it (and
``/health``, ``/metrics`` as text). Messages never carry a traceback or an
internal path.

The request and error models and the field mapping are in
:mod:`tandem.router.openai_protocol`; the two generation endpoints in
:mod:`tandem.router.openai_completions` and :mod:`tandem.router.openai_chat`
(mixins of :class:`OpenAIServer`); this module wires the app, authentication,
admission and what both endpoints share.

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
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.router.admission import HeldSlot, RateLimitExceeded, admit
from tandem.router.generation_request import GenerationRequest
from tandem.router.openai_chat import ChatServing
from tandem.router.openai_completions import CompletionsServing
from tandem.router.openai_protocol import (_ENGINE_CONSTRAINT_PARAMS, _ERRORS, MAX_BODY_BYTES,
                                           MAX_HEADER_BYTES, APIError, ChatCompletionRequest,
                                           CompletionRequest, DetokenizeRequest, ErrorResponse,
                                           TokenizeRequest, _check_failed, _check_size,
                                           _loc_param, _param_name)
from tandem.router.orchestrator import (FAIL_WITH_SIBLINGS, Orchestrator, RequestFailed,
                                        ServiceUnavailable)
from tandem.router.validation import InvalidRequestError, RequestValidator, ValidatedRequest
from tandem.router.worker_client import WorkerError

logger = logging.getLogger(__name__)


# -- errors ----------------------------------------------------------------------------------


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


# -- the app ---------------------------------------------------------------------------------

class OpenAIServer(CompletionsServing, ChatServing):
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

    async def _admit(self, request, request_id: str) -> HeldSlot | None:
        """Admit the request under its API key's rate limits
        (:func:`~tandem.router.admission.admit`); the slot to release when it ends.

        Raises:
            APIError: 429 (with ``Retry-After``) when a limit refuses it.
        """
        key_id = request.scope.get("state", {}).get("api_key_id")
        try:
            return await admit(self.limiter, key_id, request_id, self.metrics)
        except RateLimitExceeded as exc:
            raise APIError(429, str(exc), retry_after_s=exc.retry_after_s) from None

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
        # The owner handles SIGINT/SIGTERM. uvicorn installs its own around serve()
        # (install_signal_handlers before 0.29, capture_signals since) and puts the
        # ones it found back when it stops: Python's default SIGINT handler, so a
        # second Ctrl-C during the rest of the shutdown would raise
        # KeyboardInterrupt mid-cleanup and orphan workers.
        self._server.install_signal_handlers = lambda: None
        self._server.capture_signals = contextlib.nullcontext
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

    def _invalid(self, exc: InvalidRequestError, chat: bool, completion_tokens=False,
                 constraint_param: str | None = None) -> APIError:
        param = _param_name(exc.field, chat, completion_tokens, constraint_param)
        if self.metrics:
            self.metrics.invalid_request(exc.field)
        return APIError(400, f"{param}: {exc.message}", param)

    def _validate(self, req: GenerationRequest, chat: bool, fill_max_tokens: bool,
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

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
