"""A request's lifecycle in the router, on internal types: validated request in,
sample updates out.

Front ends (the gRPC service in :mod:`tandem.router.server`; an HTTP one beside
it) convert their wire format to a :class:`ValidatedRequest` and the
:class:`SampleEvent` stream back. Per request the orchestrator

1. picks a decode worker (and, disaggregated, a prefill worker);
2. adds the request to the decode worker, which reserves its blocks in queue
   order and publishes a KV ticket (disaggregated) or computes it itself
   (colocated, ``n > 1``);
3. disaggregated: hands the ticket to the prefill worker, which computes the
   prompt, streams its KV layer by layer into the reserved blocks and returns
   the first token; the decode worker then decodes it (if the prefill fails,
   the decode worker computes the prompt itself);
4. turns the decode worker's token deltas into text (stop strings, incremental
   UTF-8-safe detokenization) and yields a :class:`SampleEvent` per change;
5. on every exit that leaves a sample unfinished (client gone, error) aborts
   the request on its workers, after the call that added it returned, so an
   abort never overtakes its request; every exit path frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.runtime.outputs import RequestDelta, WorkerRequest
from tandem.kvtransfer.base import KVTransferError
from tandem.kvtransfer.layout import KVLayoutMismatchError
from tandem.router.cluster import Cluster, WorkerHandle
from tandem.router.stream import SampleStream, SampleUpdate, new_sample_streams
from tandem.router.validation import ValidatedRequest
from tandem.router.worker_client import WorkerDiedError, WorkerError

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request cannot be served as configured (e.g. the KV layouts of its workers
    disagree); front ends answer FAILED_PRECONDITION."""


@dataclass(frozen=True)
class SampleEvent:
    """One change to one sample: ``update`` is what was added, ``sample`` the sample's
    whole state so far (text pieces, ids, usage, finish reason)."""

    sample: SampleStream
    update: SampleUpdate


class Orchestrator:
    """Runs requests on a :class:`Cluster`.

    Args:
        cluster: the workers, their output pumps and the routing.
        tokenizer: the served model's tokenizer (detokenization).
        metrics: optional :class:`~tandem.router.metrics.Metrics`.
    """

    def __init__(self, cluster: Cluster, tokenizer, metrics=None):
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def generate(self, v: ValidatedRequest) -> AsyncIterator[SampleEvent]:
        """Serve ``v``; yields a :class:`SampleEvent` whenever a sample changes.

        Raises:
            RequestFailed: the request cannot be served as configured.
            InvalidParameterError: a worker refused it (field named).
            WorkerError: a worker call failed outright.
        """
        rid = uuid.uuid4().hex                # internal id: never collides with a client's
        params = v.sampling_params
        samples = new_sample_streams(self.tokenizer, list(v.prompt_token_ids), params,
                                     v.skip_special_tokens)
        cluster = self.cluster
        decode = cluster.pick_decode(v.prompt_token_ids)
        prefill = (cluster.pick_prefill(v.prompt_token_ids)
                   if cluster.disaggregated and params.n == 1 else None)
        queue = cluster.register(rid, decode)
        trace = self.metrics.request_started(v, decode.worker_id) if self.metrics else None
        req = WorkerRequest(rid, v.prompt_token_ids, params, v.priority,
                            KVTransferParams(prefill.worker_id) if prefill else None)
        added = asyncio.ensure_future(cluster.call(decode, "add_request", req))
        try:
            await asyncio.shield(added)
            if prefill is None and trace is not None:
                trace.dispatched = time.monotonic()
            if prefill is not None:
                async for ev in self._remote_prefill(req, decode, prefill, samples, queue, trace):
                    yield ev
            while not all(s.finished for s in samples):
                delta: RequestDelta = await queue.get()
                for ev in self._consume(v, samples, delta, trace):
                    yield ev
        finally:
            cluster.unregister(rid)
            unfinished = [s for s in samples if not s.finished]
            if unfinished:
                # Client went away (or we failed): stop it on the workers, in the background
                # because this task may be cancelled.
                self._spawn(self._abort(rid, added, decode, prefill, unfinished))
            if self.metrics and trace is not None:
                self.metrics.request_finished(trace, samples, aborted=bool(unfinished))

    async def _remote_prefill(self, req: WorkerRequest, decode: WorkerHandle,
                              prefill: WorkerHandle, samples: list[SampleStream],
                              queue: asyncio.Queue, trace) -> AsyncIterator[SampleEvent]:
        """Steps 2-3 of a disaggregated request: wait for the decode worker's ticket,
        prefill remotely, emit the first token, start decoding."""
        rid, cluster = req.request_id, self.cluster
        while True:
            delta: RequestDelta = await queue.get()
            if delta.kv_transfer_ticket is not None:
                break
            if delta.finish_reason is not None:        # the decode worker failed
                for ev in self._consume(None, samples, delta, trace):
                    yield ev
                return
        if trace is not None:
            trace.dispatched = time.monotonic()
        ticket = delta.kv_transfer_ticket
        prefill.inflight_prefill_tokens += len(req.prompt_token_ids)
        t0 = time.perf_counter()
        try:
            first: RequestDelta = await cluster.call(prefill, "prefill", dataclasses.replace(
                req, kv_transfer_params=KVTransferParams(decode.worker_id, ticket)))
        except KVLayoutMismatchError as exc:
            raise RequestFailed(str(exc)) from exc
        except (KVTransferError, WorkerError) as exc:
            logger.warning("request %s: remote prefill on %s failed (%s); prefilling on %s",
                           rid, prefill.worker_id, exc, decode.worker_id)
            if self.metrics:
                self.metrics.kv_transfer_failed(prefill.worker_id)
            if isinstance(exc, WorkerDiedError):
                cluster.mark_dead(prefill, exc)
            await cluster.call(decode, "start_decode", rid, None)
            return
        finally:
            prefill.inflight_prefill_tokens -= len(req.prompt_token_ids)
        if self.metrics and trace is not None:
            self.metrics.kv_transferred(trace, prefill.worker_id, ticket, time.perf_counter() - t0)
        if first.finish_reason == "length" and req.sampling_params.max_tokens > 1:
            # The prefill worker always stops after one token; the request goes on.
            first = dataclasses.replace(first, finish_reason=None, stop_reason=None)
        for ev in self._consume(None, samples, first, trace):
            yield ev
        if samples[0].finished:      # the first token ended it (EOS, stop string, max_tokens 1)
            await cluster.call(decode, "abort", rid)
            return
        await cluster.call(decode, "start_decode", rid, first.new_token_ids[0],
                           first.new_logprobs[0] if first.new_logprobs else None)

    def _consume(self, v: ValidatedRequest | None, samples: list[SampleStream],
                 delta: RequestDelta, trace) -> list[SampleEvent]:
        """Apply one worker delta to its sample; the events it makes."""
        if delta.finish_reason == "error" and "#" not in delta.request_id:
            # The worker failed: every sample of the request ends with ``error``.
            return [SampleEvent(s, upd) for s in samples
                    if (upd := s.fail("error", delta.stop_reason)) is not None]
        index = int(delta.request_id.split("#", 1)[1]) if "#" in delta.request_id else 0
        s = samples[index]
        upd = s.add(delta)
        if upd is None:
            return []
        if self.metrics and trace is not None:
            self.metrics.tokens(trace, index, len(upd.token_ids))
        if upd.needs_abort:
            self._spawn(self._abort_sample(delta.request_id))
        return [SampleEvent(s, upd)]

    # -- aborts --------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, rid: str, added: asyncio.Future, decode: WorkerHandle,
                     prefill: WorkerHandle | None, unfinished: list[SampleStream]) -> None:
        try:                  # an abort must not overtake the call that adds the request
            await added
        except Exception:     # never added: nothing to abort
            return
        if self.metrics:
            self.metrics.request_aborted()
        if prefill is not None:
            await self._try(prefill, "abort", rid)
        await self._try(decode, "abort", rid)
        for s in unfinished:
            if s.index:
                await self._try(decode, "abort", f"{rid}#{s.index}")

    async def _abort_sample(self, sample_rid: str) -> None:
        for w in self.cluster.decode:
            if w.alive:
                await self._try(w, "abort", sample_rid)

    async def _try(self, w: WorkerHandle, method: str, *args) -> None:
        try:
            await self.cluster.call(w, method, *args)
        except Exception as exc:
            logger.warning("%s of %s on %s failed: %s", method, args[0], w.worker_id, exc)
