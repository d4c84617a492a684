"""The gRPC front end (grpc.aio): ``tandem.v1.Tandem`` plus health and reflection.

A front end converts its wire format to the router's internal types and back;
the request's lifecycle (workers, KV transfer, aborts) is the
:class:`~tandem.router.orchestrator.Orchestrator`'s. Each ``Generate`` call:
validate (``INVALID_ARGUMENT`` naming the field), run it on the orchestrator,
and turn its sample events into ``GenerateResponse`` messages (streaming: one per
change; otherwise one per finished sample). A client that cancels or
disconnects cancels the orchestrator's generator, which aborts the request on
the workers.
"""

from __future__ import annotations

import logging

import grpc

from tandem.engine.scheduling.request import TokenLogprobs
from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.router.orchestrator import Orchestrator, RequestFailed, ServiceUnavailable
from tandem.router.stream import SampleStream
from tandem.router.validation import InvalidRequestError, RequestValidator
from tandem.router.worker_client import WorkerError
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


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

    def __init__(self, orchestrator: Orchestrator, tokenizer, model_info: dict, metrics=None):
        self.orchestrator = orchestrator
        self.info = model_info
        self.validator = RequestValidator(tokenizer, model_info["max_model_len"])
        self.metrics = metrics

    async def GetModelInfo(self, request, context):
        i = self.info
        return pb.GetModelInfoResponse(model_name=i["model_name"], max_model_len=i["max_model_len"],
                                       block_size=i["block_size"], dtype=i["dtype"],
                                       vocab_size=i["vocab_size"])

    async def Generate(self, request, context):
        try:
            v = self.validator.validate(request)
        except InvalidRequestError as exc:
            if self.metrics:
                self.metrics.invalid_request(exc.field)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if not self.orchestrator.cluster.can_serve:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is alive")
            return
        num_prompt = len(v.prompt_token_ids)
        try:
            async for ev in self.orchestrator.generate(v):
                s, upd = ev.sample, ev.update
                if v.stream:
                    if upd.text or upd.token_ids or s.finished:
                        yield to_response(v.request_id, s, upd.text, upd.token_ids,
                                          upd.logprobs, num_prompt)
                elif s.finished:
                    yield to_response(v.request_id, s, "".join(s.pieces), s.token_ids,
                                      s.logprobs, num_prompt)
        except InvalidParameterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ServiceUnavailable, WorkerError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


async def start_grpc_server(service: TandemService, host: str, port: int):
    """Serve ``service`` with health and reflection on ``host:port`` (0 = any free port).

    Returns:
        ``(server, bound_port, health_servicer)``.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_TandemServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Tandem"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server, bound, health_servicer
