"""The gRPC front door (grpc.aio): ``tandem.v1.Tandem`` plus health and reflection.

Each ``Generate`` call: validate (``INVALID_ARGUMENT`` naming the field), pick
workers, then either

* disaggregated: reserve blocks on the decode worker -> prefill on the prefill
  worker (KV streams worker-to-worker) -> first token to the client -> the decode
  worker admits the request once the KV landed; or
* colocated (also n > 1, or when the KV transfer failed): the decode/colocated
  worker prefills and decodes the request itself;

and stream text deltas back as the worker's step outputs arrive. A client that
cancels or disconnects gets its request aborted on the workers; every exit path
frees the request's blocks there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from tandem.engine.outputs import RequestDelta
from tandem.router.cluster import Cluster, WorkerHandle
from tandem.router.stream import SampleStream, new_sample_streams, to_response
from tandem.router.validation import InvalidRequestError, RequestValidator, ValidatedRequest
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request could not be served (worker failure after fallbacks)."""


class TandemService(pb_grpc.TandemServicer):
    """Implements ``tandem.v1.Tandem`` over a :class:`Cluster`.

    Args:
        cluster: the workers.
        tokenizer: the served model's tokenizer.
        model_info: dict with model_name, max_model_len, block_size, dtype, vocab_size.
        metrics: optional recorder with ``request_*`` hooks (see router.metrics).
    """

    def __init__(self, cluster: Cluster, tokenizer, model_info: dict, metrics=None):
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.info = model_info
        self.validator = RequestValidator(tokenizer, model_info["max_model_len"])
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

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
        if not self.cluster.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill or no decode worker is alive")
            return
        try:
            async for resp in self._generate(v):
                yield resp
        except RequestFailed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:
            if _is_no_room(exc):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise

    # -- one request --------------------------------------------------------------------------
    async def _generate(self, v: ValidatedRequest):
        rid = uuid.uuid4().hex                # internal id: never collides with a client's
        params = v.sampling_params
        prompt = list(v.prompt_token_ids)
        samples = new_sample_streams(self.tokenizer, prompt, params, v.skip_special_tokens)
        decode = self.cluster.pick_decode()
        queue = self.cluster.register(rid, decode)
        trace = self.metrics.request_started(v, decode.worker_id) if self.metrics else None
        prefill: list[WorkerHandle] = []
        try:
            if self.cluster.disaggregated and params.n == 1:
                first = await self._remote_prefill(rid, v, decode, trace, prefill)
                if first is not None:
                    for resp in self._emit(v, samples, first, trace):
                        yield resp
                    if samples[0].finished:
                        await self.cluster.call(decode.actor.release, rid)
                        return
                    await self.cluster.call(
                        decode.actor.start_decode, rid, prompt, params, first.new_token_ids[0],
                        first.new_logprobs[0] if first.new_logprobs else None, v.priority,
                        first.num_cached_tokens)
            else:
                await self.cluster.call(decode.actor.add_request, rid, prompt, params, v.priority)
                if trace is not None:
                    trace.dispatched = time.monotonic()
            while not all(s.finished for s in samples):
                delta: RequestDelta = await queue.get()
                if delta.finish_reason == "error" and "#" not in delta.request_id:
                    # The worker failed: every sample of the request ends with ``error``.
                    for s in samples:
                        if s.fail("error", delta.stop_reason) is not None and v.stream:
                            yield to_response(v.request_id, s, "", [], [], len(prompt))
                        elif not v.stream and s.finished:
                            yield to_response(v.request_id, s, "".join(s.pieces), s.token_ids,
                                              s.logprobs, len(prompt))
                    break
                for resp in self._emit(v, samples, delta, trace):
                    yield resp
        finally:
            self.cluster.unregister(rid)
            unfinished = [s for s in samples if not s.finished]
            if unfinished:
                # Client went away (or we failed): stop it on the workers, in the background
                # because this task may be cancelled. Aborting a request a worker has not
                # seen yet is safe (it leaves a tombstone there).
                self._spawn(self._abort(rid, decode, prefill, unfinished))
            if self.metrics and trace is not None:
                self.metrics.request_finished(trace, samples, aborted=bool(unfinished))

    async def _remote_prefill(self, rid: str, v: ValidatedRequest, decode: WorkerHandle, trace,
                              used: list[WorkerHandle]):
        """Reserve on ``decode``, prefill on a prefill worker (appended to ``used``).
        Returns the first token's delta, or None when the decode worker prefills the
        request itself instead."""
        from tandem.kvtransfer.layout import KVLayoutMismatchError

        prefill = self.cluster.pick_prefill()
        used.append(prefill)
        prompt = list(v.prompt_token_ids)
        ticket = await self.cluster.call(decode.actor.reserve, rid, prompt, prefill.worker_id)
        if trace is not None:
            trace.dispatched = time.monotonic()
        prefill.inflight_prefill_tokens += len(prompt)
        t0 = time.perf_counter()
        try:
            first = await self.cluster.call(prefill.actor.prefill, rid, prompt, v.sampling_params,
                                            ticket, decode.worker_id, v.priority)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.cluster.call(decode.actor.release, rid)
            if _is_layout_mismatch(exc, KVLayoutMismatchError):
                raise RequestFailed(str(exc)) from exc
            logger.warning("request %s: remote prefill failed (%s); prefilling on %s",
                           rid, exc, decode.worker_id)
            if self.metrics:
                self.metrics.kv_transfer_failed(prefill.worker_id)
            if _actor_died(exc):
                self.cluster.mark_dead(prefill, exc)
            await self.cluster.call(decode.actor.add_request, rid, prompt, v.sampling_params,
                                    v.priority)
            return None
        finally:
            prefill.inflight_prefill_tokens -= len(prompt)
        if self.metrics and trace is not None:
            self.metrics.kv_transferred(trace, prefill.worker_id, ticket, time.perf_counter() - t0)
        if first.finish_reason == "length" and v.sampling_params.max_tokens > 1:
            # The prefill worker always stops after one token; the request goes on.
            first = RequestDelta(first.request_id, first.new_token_ids, first.new_logprobs, None,
                                 None, first.num_prompt_tokens, first.num_cached_tokens, 1)
        return first

    def _emit(self, v: ValidatedRequest, samples: list[SampleStream], delta: RequestDelta, trace):
        """Responses for one delta (streaming: at once; else one message per finished sample)."""
        index = int(delta.request_id.split("#", 1)[1]) if "#" in delta.request_id else 0
        s = samples[index]
        upd = s.add(delta)
        if upd is None:
            return
        if self.metrics and trace is not None:
            self.metrics.tokens(trace, index, len(upd.token_ids))
        if upd.needs_abort:
            self._spawn(self._abort_sample(delta.request_id))
        if v.stream:
            if upd.text or upd.token_ids or s.finished:
                yield to_response(v.request_id, s, upd.text, upd.token_ids, upd.logprobs,
                                  len(v.prompt_token_ids))
        elif s.finished:
            yield to_response(v.request_id, s, "".join(s.pieces), s.token_ids, s.logprobs,
                              len(v.prompt_token_ids))

    # -- aborts --------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, rid: str, decode: WorkerHandle, prefill: list[WorkerHandle],
                     unfinished: list[SampleStream]) -> None:
        if self.metrics:
            self.metrics.request_aborted()
        for w in prefill:
            try:
                await self.cluster.call(w.actor.abort, rid)
            except Exception as exc:
                logger.warning("abort of %s on %s failed: %s", rid, w.worker_id, exc)
        try:
            await self.cluster.call(decode.actor.abort, rid)
            for s in unfinished:
                if s.index:
                    await self.cluster.call(decode.actor.abort, f"{rid}#{s.index}")
        except Exception as exc:
            logger.warning("abort of %s on %s failed: %s", rid, decode.worker_id, exc)

    async def _abort_sample(self, sample_rid: str) -> None:
        base = sample_rid.split("#", 1)[0]
        for w in self.cluster.decode:
            if w.alive:
                try:
                    await self.cluster.call(w.actor.abort, sample_rid)
                except Exception as exc:
                    logger.warning("abort of %s failed: %s", base, exc)


def _is_layout_mismatch(exc: BaseException, cls) -> bool:
    cause = getattr(exc, "cause", None) or exc.__cause__
    return isinstance(exc, cls) or isinstance(cause, cls) or "KV layout mismatch" in str(exc)


def _is_no_room(exc: BaseException) -> bool:
    return "NoRoomError" in type(exc).__name__ or "no KV room" in str(exc)


def _actor_died(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("RayActorError", "ActorDiedError", "ActorUnavailableError")


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
