"""The gRPC front end (grpc.aio): ``tandem.v1.Tandem`` plus health and reflection.

A front end converts its wire format to the router's internal types and back;
the request's lifecycle (workers, KV transfer, aborts) is the
:class:`~tandem.router.orchestrator.Orchestrator`'s. Each ``Generate`` call:
convert the ``GenerateRequest`` to a
:class:`~tandem.router.generation_request.GenerationRequest`
(:func:`request_from_proto`), validate it (``INVALID_ARGUMENT`` naming the field),
admit it under its API key's rate limits (:mod:`tandem.router.admission`;
``RESOURCE_EXHAUSTED``), run it on the orchestrator, and turn its sample events
into ``GenerateResponse`` messages (streaming: one per change; otherwise one per
finished sample). A client that cancels or disconnects cancels the call's task,
which closes the orchestrator's generator there and then: it aborts the request
on the workers and counts it (``tandem:request_aborts{source="grpc_cancel"}``). ``Generate`` is served from
the call's arrival (see :func:`add_tandem_service`), so a cancel before its
request was even read counts too.

With API keys configured every call but health and reflection must present
one (:mod:`tandem.router.grpc_security`: ``UNAUTHENTICATED`` otherwise, before the
handler runs); with a certificate the port speaks TLS only.

Error messages reach clients, so they carry only what the router wrote for
them: a field path and why, or a short status with the request id. A
worker's exception text (a Ray error's holds the worker's traceback and file
paths) and any unexpected exception are logged here, with the request id, and
never sent; an unexpected exception is ``INTERNAL``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid

import grpc
from google.protobuf.message import DecodeError

from tandem.engine.scheduling.request import TokenLogprobs
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams
from tandem.router.admission import RateLimitExceeded, admit
from tandem.router.auth import APIKeyStore
from tandem.router.generation_request import (ChatMessage, Constraint, GenerationRequest,
                                              SamplingFields)
from tandem.router.grpc_security import current_key_id
from tandem.router.orchestrator import Orchestrator, RequestFailed, ServiceUnavailable
from tandem.router.stream import SampleStream
from tandem.router.tls import TLSConfig
from tandem.router.validation import (CONSTRAINT_FIELDS, InvalidRequestError,
                                      RequestValidator, constraint_field_path)
from tandem.router.worker_client import WorkerError
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
"""The largest request message accepted (RESOURCE_EXHAUSTED beyond it, before parsing)."""
MAX_METADATA_BYTES = 16 << 10
"""The largest request metadata (headers) accepted."""

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def refused_field_path(exc: InvalidParameterError, input_field: str | None) -> str | None:
    """The proto path of the field a worker refused (its engine names
    ``SamplingParams`` fields and ``prompt_token_ids``), or None when the field is
    not one the client sent (``output_token_ids``, ``kv_transfer_params``: the
    router's own doing, a bug rather than bad input).

    Args:
        input_field: which input the request set (``prompt``, ``token_ids``, ``chat``).
    """
    if exc.field in _SAMPLING_FIELDS:
        return f"sampling.{exc.field}"
    constraint = constraint_field_path(exc.field)
    if constraint is not None:
        return constraint
    if exc.field == "prompt_token_ids":
        return input_field
    return None


# Scalar fields of tandem.v1.SamplingParams, named as in SamplingFields; those
# declared `optional` are None when absent.
_PROTO_OPTIONAL = ("n", "max_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                   "seed", "logprobs", "skip_special_tokens", "prompt_logprobs",
                   "length_penalty")
_PROTO_PLAIN = ("min_p", "presence_penalty", "frequency_penalty", "include_stop_str_in_output",
                "ignore_eos", "min_tokens", "use_beam_search")


def request_from_proto(request: pb.GenerateRequest) -> GenerationRequest:
    """``request`` as the router's :class:`GenerationRequest` (values as sent; the
    validator checks them). An unset ``sampling`` and an unset field of it are the
    defaults, as they are on the wire."""
    sp = request.sampling
    constraint = None
    if (kind := sp.WhichOneof("constraint")) is not None:
        value = getattr(sp, kind)
        constraint = Constraint(CONSTRAINT_FIELDS[kind],
                                tuple(value.choices) if kind == "choice" else value)
    sampling = SamplingFields(
        **{f: getattr(sp, f) for f in _PROTO_PLAIN},
        **{f: getattr(sp, f) for f in _PROTO_OPTIONAL if sp.HasField(f)},
        stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), constraint=constraint)
    inputs: dict = {}
    kind = request.WhichOneof("input")
    if kind == "prompt":
        inputs["prompt"] = request.prompt
    elif kind == "token_ids":
        inputs["prompt_token_ids"] = tuple(request.token_ids.ids)
    elif kind == "chat":
        inputs["messages"] = tuple(ChatMessage(m.role, m.content) for m in request.chat.messages)
    return GenerationRequest(request_id=request.request_id, sampling=sampling,
                             priority=request.priority, stream=request.stream, **inputs)


def to_response(request_id: str, s: SampleStream, text: str, token_ids: list[int],
                logprobs: list[TokenLogprobs], num_prompt_tokens: int) -> pb.GenerateResponse:
    """Build one ``GenerateResponse``; usage and the stop reason ride on the final one,
    prompt logprobs on the first (the one whose ``token_ids`` are all of the sample's
    tokens so far: the first streamed message, or the only one)."""
    resp = pb.GenerateResponse(request_id=request_id, index=s.index, text=text,
                               token_ids=token_ids, finish_reason=FINISH_REASONS[s.finish_reason])
    for lp in logprobs:
        resp.logprobs.append(pb.TokenLogprobs(
            token_id=lp.token_id, logprob=lp.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    if s.prompt_logprobs is not None and token_ids and len(token_ids) == s.num_tokens:
        resp.prompt_logprobs.extend(prompt_logprobs_pb(s.prompt_token_ids, s.prompt_logprobs))
    if s.finished:
        if isinstance(s.stop_reason, str) and s.finish_reason == "stop":
            resp.stop_str = s.stop_reason
        elif isinstance(s.stop_reason, int):
            resp.stop_token_id = s.stop_reason
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=num_prompt_tokens,
                                     completion_tokens=s.num_tokens,
                                     cached_tokens=s.num_cached_tokens))
    return resp


def prompt_logprobs_pb(prompt_token_ids, entries) -> list[pb.PromptLogprob]:
    """``entries`` (None for the first prompt token, then :class:`TokenLogprobs`) as
    ``PromptLogprob`` messages, one per prompt token; the first has no ``logprob``."""
    out = [pb.PromptLogprob(token_id=prompt_token_ids[0])]
    for lp in entries[1:]:
        out.append(pb.PromptLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    return out


class TandemService(pb_grpc.TandemServicer):
    """Implements ``tandem.v1.Tandem`` over an :class:`Orchestrator`.

    Args:
        orchestrator: runs the requests.
        tokenizer: the served model's tokenizer (validation, chat templates).
        model_info: dict with model_name, max_model_len, block_size, dtype, vocab_size.
        metrics: optional recorder (see router.metrics).
    """

    def __init__(self, orchestrator: Orchestrator, tokenizer, model_info: dict, metrics=None,
                 limiter=None):
        self.orchestrator = orchestrator
        self.info = model_info
        self.validator = RequestValidator(tokenizer, model_info["max_model_len"])
        self.metrics = metrics
        self.limiter = limiter

    async def _parse(self, message_class, data: bytes, context):
        """``data`` (a request's bytes) as a ``message_class``; aborts the call with
        ``INVALID_ARGUMENT`` (``"request: ..."``, counted in
        ``tandem:invalid_requests`` with field ``request``) when they are not one, e.g.
        a truncated message, a wrong wire type or a string field holding invalid
        UTF-8. Parsing here rather than in the transport's deserializer is what lets
        the client hear that: grpc.aio answers a deserializer's exception with
        ``UNKNOWN`` and the exception's class and text."""
        try:
            return message_class.FromString(data)
        except DecodeError:
            if self.metrics:
                self.metrics.invalid_request("request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {message_class.DESCRIPTOR.full_name} "
                                "message")

    async def get_model_info_call(self, data: bytes, context):
        """``GetModelInfo`` as the server runs it: from the request's bytes (see
        :func:`add_tandem_service`); an undecodable one is ``INVALID_ARGUMENT``."""
        request = await self._parse(pb.GetModelInfoRequest, data, context)
        return await self.GetModelInfo(request, context)

    async def GetModelInfo(self, request, context):
        i = self.info
        return pb.GetModelInfoResponse(model_name=i["model_name"], max_model_len=i["max_model_len"],
                                       block_size=i["block_size"], dtype=i["dtype"],
                                       vocab_size=i["vocab_size"])

    async def generate_call(self, request_iterator, context) -> None:
        """``Generate`` as the server runs it: from the call's arrival, reading its one
        request's bytes itself (see :func:`add_tandem_service`); bytes that are not a
        ``GenerateRequest`` end the call with ``INVALID_ARGUMENT``
        (``"request: not a valid tandem.v1.GenerateRequest message"``). A client
        that cancels before the request was read is counted as an aborted request;
        like gRPC for a unary request, the call then gets no answer (there is no
        one to answer). Note that a message the transport refuses (larger than
        :data:`MAX_MESSAGE_BYTES`; the client gets ``RESOURCE_EXHAUSTED``) looks
        the same from here and counts the same."""
        try:
            data = await context.read()
        except asyncio.CancelledError:
            self._cancelled_early()
            raise
        if data is grpc.aio.EOF:
            self._cancelled_early()
            raise asyncio.CancelledError()
        request = await self._parse(pb.GenerateRequest, data, context)
        await self.Generate(request, context)

    def _cancelled_early(self) -> None:
        """The client went away before its request reached the orchestrator."""
        if self.metrics:
            self.metrics.request_cancelled("grpc_cancel")

    async def Generate(self, request, context):
        """Serve one ``GenerateRequest``, writing its responses to ``context``; every
        failure ends the call with a status:

        - ``INVALID_ARGUMENT``: ``"<field path>: <why>"`` (the router's validation,
          or a worker refusing a field the client sent);
        - ``RESOURCE_EXHAUSTED``: the API key's rate limit or concurrency cap
          (``"... (retry after <s> s)"``);
        - ``UNAVAILABLE``: no worker can serve it now, or its worker failed (retry);
        - ``FAILED_PRECONDITION``: the cluster cannot serve it as configured;
        - ``INTERNAL``: anything else (a bug), with the request id to quote; the
          traceback is logged, never sent.
        """
        request_id = held = None
        started = False       # the orchestrator has it: it counts how it ends
        try:
            try:
                v = self.validator.validate(request_from_proto(request))
            except InvalidRequestError as exc:
                if self.metrics:
                    self.metrics.invalid_request(exc.field)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            request_id = v.request_id
            if not self.orchestrator.cluster.can_serve:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is alive")
            num_prompt = len(v.prompt_token_ids)
            try:
                # Client request ids may repeat; slots must not.
                held = await admit(self.limiter, current_key_id(), uuid.uuid4().hex,
                                   self.metrics)
            except RateLimitExceeded as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{exc} (retry after {exc.retry_after_seconds} s)")
            events = self.orchestrator.generate(v, "grpc_cancel")
            started = True
            # Closed here on every exit, a cancel included (never left to the GC).
            async with contextlib.aclosing(events):
                async for ev in events:
                    s, upd = ev.sample, ev.update
                    if v.stream:
                        if upd.text or upd.token_ids or s.finished:
                            await context.write(to_response(v.request_id, s, upd.text,
                                                            upd.token_ids, upd.logprobs,
                                                            num_prompt))
                    elif s.finished:
                        await context.write(to_response(v.request_id, s, "".join(s.pieces),
                                                        s.token_ids, s.logprobs, num_prompt))
        except asyncio.CancelledError:
            if not started:                      # during admission
                self._cancelled_early()
            raise
        except grpc.aio.AbortError:
            raise                                # context.abort() above: the call is answered
        except InvalidParameterError as exc:
            path = refused_field_path(exc, request.WhichOneof("input"))
            if path is None:
                await self._internal_error(context, request_id)
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: {exc.message}")
        except RequestFailed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ServiceUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except WorkerError as exc:
            # Its text is the worker's exception, for the operator only.
            logger.warning("request %s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"worker {exc.worker_id} failed while serving request "
                                f"{request_id}; try again")
        except Exception:
            await self._internal_error(context, request_id)
        finally:
            if held is not None:
                await asyncio.shield(held.release())

    @staticmethod
    async def _internal_error(context, request_id: str | None) -> None:
        """Answer ``INTERNAL`` for the exception being handled, which is a bug, not
        the client's doing: logged with its traceback, never sent. Validation may
        not have named the request yet; an error id then ties the answer to the log."""
        request_id = request_id or f"error-{uuid.uuid4().hex}"
        logger.exception("request %s: unexpected error", request_id)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error while serving request {request_id}")


def add_tandem_service(service: TandemService, server) -> None:
    """Register ``tandem.v1.Tandem`` on ``server`` as the generated
    ``add_TandemServicer_to_server`` does, except that ``Generate`` (unary request,
    streamed responses on the wire, unchanged for clients) gets a stream-stream
    handler, :meth:`TandemService.generate_call`, that reads the request itself.
    grpc.aio runs a unary-request handler only once the request has been read and
    silently drops a call cancelled before that: a client that cancels right
    after sending would never reach Tandem's code, and never be counted.

    Both methods take their request as bytes (no request deserializer) and parse
    it in the handler: grpc.aio answers a deserializer that raises with
    ``UNKNOWN`` and ``Unexpected <class '...DecodeError'>: ...``, where the
    handler can answer ``INVALID_ARGUMENT``.

    Raises:
        RuntimeError: the proto has a method this does not register (keep them in step).
    """
    name = pb.DESCRIPTOR.services_by_name["Tandem"].full_name
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            service.generate_call, request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.get_model_info_call, request_deserializer=None,
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
    }
    methods = set(pb.DESCRIPTOR.services_by_name["Tandem"].methods_by_name)
    if methods != set(handlers):
        raise RuntimeError(f"{name}: methods {sorted(methods)}, handlers {sorted(handlers)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


async def start_grpc_server(service: TandemService, host: str, port: int,
                            api_keys: APIKeyStore | None = None, auth_health: bool = False,
                            tls: TLSConfig | None = None):
    """Serve ``service`` with health and reflection on ``host:port`` (0 = any free port).

    Args:
        api_keys: keys every call must present (``authorization: Bearer <key>``),
            except to health and reflection; None or empty = no authentication.
        auth_health: health requires a key too.
        tls: serve over TLS (None = plaintext).

    Returns:
        ``(server, bound_port, health_servicer)``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: a TLS file cannot be read.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from tandem.router.grpc_security import APIKeyInterceptor, open_methods, server_credentials

    interceptors = []
    if api_keys is not None and api_keys.enabled:
        interceptors.append(APIKeyInterceptor(api_keys, open_methods(auth_health)))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_metadata_size", MAX_METADATA_BYTES)],
                             interceptors=interceptors)
    add_tandem_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Tandem"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, server_credentials(tls)) if tls is not None \
        else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    return server, bound, health_servicer
