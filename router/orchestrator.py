"""A request's lifecycle in the router, on internal types: validated request in,
sample updates out.

Front ends (the gRPC service in :mod:`tandem.router.server`; an HTTP one beside
it) convert their wire format to a :class:`ValidatedRequest` and the
:class:`SampleEvent` stream back. Per request the orchestrator

1. picks a decode worker (and, disaggregated, a prefill worker);
2. adds the request to the decode worker, which reserves its blocks in queue
   order (disaggregated) or computes it itself (colocated, ``n > 1``);
3. disaggregated: sends the request to the prefill worker at the same time. The
   two workers do their handshake on the KV channel they share (SGLang's
   bootstrap, Dynamo's shape): the decode worker posts its ticket there once the
   blocks are reserved, the prefill worker computes the prompt, streams its KV
   layer by layer into those blocks, and hands the first token back on the
   channel, so the decode worker decodes on without a word from the router,
   which streams that token from the prefill worker's answer. Both workers get
   the request on the router's output stream to them and answer there (a Ray
   call only when that stream broke first). Only when the
   prefill fails does the router step in: the decode worker computes the prompt
   itself;
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
from typing import AsyncIterator, Awaitable, Callable

from tandem.control.journal import InProcessJournal, JournalWriter, RequestJournal
from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.runtime.output_stream import OutputStreamError
from tandem.engine.runtime.outputs import RequestDelta, WorkerRequest
from tandem.kvtransfer.base import KVTransferError
from tandem.kvtransfer.layout import KVLayoutMismatchError
from tandem.engine.runtime.worker_common import WorkerFencedError
from tandem.router.cluster import Cluster, ServerStopping, WorkerHandle, WorkerLost
from tandem.router.stream import SampleStream, SampleUpdate, new_sample_streams
from tandem.router.validation import ValidatedRequest
from tandem.router.worker_client import WorkerDiedError, WorkerError, as_raised

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request cannot be served as configured (e.g. the KV layouts of its workers
    disagree); front ends answer FAILED_PRECONDITION."""


class ServiceUnavailable(Exception):
    """No worker can take the request now (none alive, or every attempt lost its
    worker); front ends answer UNAVAILABLE. The message names no internals."""


def _raise_if_lost(item) -> None:
    """Raise for a queue item that ends the attempt: :class:`_WorkerLost` for a lost
    decode worker, :class:`ServiceUnavailable` for a router shutting down."""
    if isinstance(item, WorkerLost):
        raise _WorkerLost(item.worker_id)
    if isinstance(item, ServerStopping):
        raise ServiceUnavailable("the server is shutting down; retry the request")


class _WorkerLost(Exception):
    """The attempt's decode worker is gone: migrate the request."""

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self.worker_id = worker_id


def _ignore_result(fut: asyncio.Future) -> None:
    """Done callback of an abandoned call: retrieve its outcome (no "never retrieved")."""
    if not fut.cancelled():
        fut.exception()


MAX_MIGRATIONS = 3
"""Times a request may move to another decode worker after losing its own."""

ADD_ANSWER_TIMEOUT_S = 10.0
"""Seconds a request sent on a worker's output stream waits for the worker's answer
before the router asks by call (which the worker matches with the frame, so the
request is added once; an engine in a long step answers both after it)."""

FAIL_WITH_SIBLINGS = "fail"
"""``Task.cancel(FAIL_WITH_SIBLINGS)`` of a task running :meth:`Orchestrator.generate`:
the request ends because another request of the same front-end call failed (a
batched completion), which counts as an error, not as an abort by the client."""


@dataclass(frozen=True)
class SampleEvent:
    """One change to one sample: ``update`` is what was added, ``sample`` the sample's
    whole state so far (text pieces, ids, usage, finish reason)."""

    sample: SampleStream
    update: SampleUpdate


@dataclass
class _Attempt:
    """One try at running a request: its workers and the call that added it."""

    number: int
    decode: WorkerHandle
    prefill: WorkerHandle | None
    added: asyncio.Future | None = None
    prefilled: asyncio.Future | None = None    # the prefill worker's call


class Orchestrator:
    """Runs requests on a :class:`Cluster`.

    Args:
        cluster: the workers, their output pumps and the routing.
        tokenizer: the served model's tokenizer (detokenization).
        metrics: optional :class:`~tandem.router.metrics.Metrics`.
        journal: where each request's parameters and emitted tokens are recorded
            (:class:`~tandem.control.journal.RequestJournal`; default in-process);
            a migrated request resumes from it.
        prefill_timeout_s: seconds a prefill worker may go without progress (no
            step output) while a remote prefill waits on it before the decode worker
            computes the prompt itself; about the KV transfer timeout, which the
            router extends on the decode side while the prefill worker progresses
            (time queued behind other prompts does not count).
        worker_wait_timeout_s: seconds a request whose decode worker died waits for
            a decode worker to take it over when no other is alive (the
            supervisor's replacement of a single-worker pool); past it the request
            ends with ``UNAVAILABLE``.
        max_prefill_queue_tokens: conditional disaggregation (after NVIDIA
            Dynamo's disaggregated router, which prefills locally past a prefill
            queue length; vLLM's and SGLang's always send the prompt away): a
            request whose least-loaded prefill worker already has this many
            prompt tokens in flight (sent, first token not back) is prefilled
            on its decode worker instead, as a colocated one would be, unless
            that worker has as many prompt tokens of its own in flight (then
            the prefill worker's queue is no longer the longer one). None: every
            eligible request is prefilled remotely.
        prefer_local_prefill: conditional disaggregation's other half: a
            request is prefilled on its decode worker where that delays no
            decode step by more than a block's tokens: while the worker has no
            decode batch (nothing on it but prompts whose first token is not
            back, :meth:`_decode_idle`: no decode step waits, and the KV
            handoff, the whole difference between disaggregated and colocated
            TTFT at one stream, is skipped) and the prefill worker has no prompt
            in flight or more prompt tokens in flight than the decode worker
            computes itself, or when the worker's prefix cache holds all of
            the prompt but at most one block (:meth:`_cached_on`; NVIDIA
            Dynamo's rule, which weighs the prompt's uncached part): sending it
            away would recompute it and move KV the worker has already.
    """

    def __init__(self, cluster: Cluster, tokenizer, metrics=None,
                 journal: RequestJournal | None = None, prefill_timeout_s: float = 60.0,
                 worker_wait_timeout_s: float = 60.0,
                 max_prefill_queue_tokens: int | None = None,
                 prefer_local_prefill: bool = False):
        if max_prefill_queue_tokens is not None and max_prefill_queue_tokens < 1:
            raise ValueError(f"max_prefill_queue_tokens: must be at least 1 (or None), "
                             f"got {max_prefill_queue_tokens}")
        self.cluster = cluster
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.prefer_local_prefill = prefer_local_prefill
        self.prefill_timeout_s = prefill_timeout_s
        self.worker_wait_timeout_s = worker_wait_timeout_s
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.journal = journal if journal is not None else InProcessJournal()
        self._journaled: dict[str, tuple[dict, list[SampleStream]]] = {}
        # Journal writes leave the event loop: batched, one round trip in flight.
        self.journal_writer = JournalWriter(self.journal, cluster.router_id, self._journal_entry)
        self._background: set[asyncio.Task] = set()

    async def generate(self, v: ValidatedRequest,
                       abort_source: str = "grpc_cancel") -> AsyncIterator[SampleEvent]:
        """Serve ``v``; yields a :class:`SampleEvent` whenever a sample changes.

        How the request ended is decided here, once, for every exit: it ran to
        its end (each sample stop, length or error); it raised (its unfinished
        samples end with ``error``); or its consumer stopped it before then,
        cancelled or closed (unfinished samples end with ``abort``, counted in
        ``tandem:request_aborts{source=abort_source}``; a sample the worker
        aborted on its own counts as ``source="worker"``). A request whose
        samples all finished is never an abort, however late its consumer
        stops. Front ends must close this generator when they stop early
        (``contextlib.aclosing``): left to the garbage collector, the abort
        would be late on the workers and in the metrics.

        If the decode worker dies mid-request (or is retired), the request moves
        to another decode worker (request migration, as in Dynamo); when no other
        is alive (a pool of one, as in the default deployment) it waits up to
        ``worker_wait_timeout_s`` for the supervisor's replacement. It is added
        there with the tokens it emitted so far (``n == 1``: checked against the
        journal), whose KV that worker recomputes, and continues; the client sees
        no gap and no duplicate, and a greedy or seeded stream equals the
        no-failure run. Each unfinished sample of an ``n > 1`` request resumes as
        a request of its own that draws from that sample's seed stream.

        Args:
            abort_source: what a stop by the consumer means (the front end's
                client went away): ``grpc_cancel`` or ``http_disconnect``; a
                cancel with the message :data:`FAIL_WITH_SIBLINGS` means an error.

        Raises:
            RequestFailed: the request cannot be served as configured.
            InvalidParameterError: a worker refused it (field named).
            ServiceUnavailable: no decode worker is alive, the request lost its
                worker more than :data:`MAX_MIGRATIONS` times, or none took it over
                within ``worker_wait_timeout_s``.
        """
        rid = uuid.uuid4().hex                # internal id: never collides with a client's
        params = v.sampling_params
        samples = new_sample_streams(self.tokenizer, list(v.prompt_token_ids), params,
                                     v.skip_special_tokens)
        cluster = self.cluster
        try:
            decode = cluster.reserve_decode(rid, v.prompt_token_ids)
        except RuntimeError:
            raise ServiceUnavailable("no decode worker is alive") from None
        queue = cluster.register(rid, decode)
        att = _Attempt(0, decode, self._pick_prefill(v, decode, rid))
        trace = self.metrics.request_started(v, decode.worker_id) if self.metrics else None
        record = {"prompt_token_ids": list(v.prompt_token_ids), "priority": v.priority,
                  "sampling_params": dataclasses.asdict(params)}
        self._journaled[rid] = (record, samples)
        self.journal_writer.submit("begin", rid, cluster.router_id, record)
        stopped_by: str | None = "error"     # how it ends unless it runs to its end
        try:
            while True:
                try:
                    async for ev in self._run(v, rid, att, samples, queue, trace):
                        yield ev
                    break
                except _WorkerLost:
                    att = await self._migrate(v, rid, att, samples)
            stopped_by = None
        except (asyncio.CancelledError, GeneratorExit) as exc:
            # The consumer stopped: its client went away (or a sibling failed).
            failed = isinstance(exc, asyncio.CancelledError) and FAIL_WITH_SIBLINGS in exc.args
            stopped_by = "error" if failed else abort_source
            raise
        finally:
            cluster.unregister(rid)
            self.journal_writer.submit("finish", rid)
            self._journaled.pop(rid, None)
            unfinished = [s for s in samples if not s.finished]
            aborted_by = None
            if unfinished:
                # Stop it on the workers, in the background because this task may be
                # cancelled.
                self._spawn(self._abort(rid, att, unfinished))
                reason = "error" if stopped_by in (None, "error") else "abort"
                for s in unfinished:
                    s.fail(reason)
                if reason == "abort":
                    aborted_by = stopped_by
            elif any(s.finish_reason == "abort" for s in samples):
                aborted_by = "worker"
            if self.metrics and trace is not None:
                self.metrics.request_finished(trace, samples, aborted_by)

    def _pick_prefill(self, v: ValidatedRequest, decode: WorkerHandle,
                      request_id: str | None = None) -> WorkerHandle | None:
        """The prefill worker of a disaggregated ``n == 1`` request going to ``decode``;
        None when the decode worker computes the prompt itself (colocated, ``n > 1``,
        prompt logprobs, no prefill worker alive: degraded, not refused; or the
        prefill worker picked has ``max_prefill_queue_tokens`` in flight already,
        more than ``decode`` has; or ``prefer_local_prefill`` and ``decode`` has no
        decode batch, :meth:`_decode_idle`, while the prefill worker has no prompt
        in flight or more prompt tokens than ``decode`` computes itself; or
        ``decode`` holds the prompt, :meth:`_cached_on`; ``request_id``, the
        request's internal id, already registered on ``decode``, is not counted
        there).

        The idle rule in steps: a burst that reaches idle workers is prefilled on
        the decode worker whole, as a colocated worker would (with core lending it
        steps on the idle prefill worker's cores too); once the prefill worker has
        prompts in flight, further ones go to whichever of the two has fewer prompt
        tokens in flight, so that a burst arriving just after one prompt was sent
        away is shared between the two instead of queued behind it.

        Prompt logprobs come from the logits of every prompt position, which only
        the engine that runs the prompt has; the KV transfer carries KV and the
        first token alone. So such a request is prefilled on its decode worker,
        like a colocated one, and the KV transfer protocol is unchanged."""
        cluster = self.cluster
        params = v.sampling_params
        if not cluster.disaggregated or params.n != 1 or params.prompt_logprobs is not None \
                or params.use_beam_search:
            return None
        try:
            prefill = cluster.pick_prefill(v.prompt_token_ids)
        except RuntimeError:
            return None
        limit, queued = self.max_prefill_queue_tokens, prefill.inflight_prefill_tokens
        if (limit is not None and queued >= limit and decode.inflight_prefill_tokens < queued) \
                or (self.prefer_local_prefill
                    and ((self._decode_idle(decode, request_id)
                          and (not queued or decode.inflight_prefill_tokens < queued))
                         or self._cached_on(decode, v.prompt_token_ids))):
            if self.metrics:
                self.metrics.prefilled_locally()
            return None
        return prefill

    def _decode_idle(self, decode: WorkerHandle, request_id: str | None) -> bool:
        """``decode`` has no decode batch: every other request of this router on it
        is a prompt whose first token is not back, computed there or waiting for
        its KV cache from a prefill worker, and its latest step output reports no
        more requests running, waiting or swapped than those (other routers'
        included). A request that only missed the worker's latest step output
        counts through this router's own count."""
        local = decode.inflight_local_prefills + decode.inflight_remote_prefills
        if self.cluster.num_requests_on(decode.worker_id, besides=request_id) != local:
            return False
        s = decode.stats
        return s is None or s.num_running + s.num_waiting + s.num_swapped <= local

    def _cached_on(self, decode: WorkerHandle, prompt_token_ids) -> bool:
        """``decode``'s prefix cache holds all of the prompt but at most one block
        (as the routing policy's index of its KV events says; False for a policy
        without one): computing the rest there is a few tokens in a decode step."""
        cached = getattr(self.cluster.policy, "cached_prefix_tokens", None)
        if cached is None or decode.block_size is None:
            return False
        hit = cached([decode], prompt_token_ids)[decode.worker_id]
        return hit > 0 and len(prompt_token_ids) - hit <= decode.block_size

    async def _migrate(self, v: ValidatedRequest, rid: str, att: _Attempt,
                       samples: list[SampleStream]) -> _Attempt:
        """The next attempt after ``att.decode`` went away.

        Raises:
            ServiceUnavailable: too many migrations, or no decode worker took the
                request over within ``worker_wait_timeout_s``.
        """
        lost_id = att.decode.worker_id
        if att.number >= MAX_MIGRATIONS:
            raise ServiceUnavailable(f"the request's decode worker {lost_id} failed")
        if att.prefill is not None and att.prefill.alive:
            self._spawn(self._try(att.prefill.client.abort(rid)))   # never prefill for the dead
        decode = await self._reserve_successor(v, rid, att.decode)
        logger.warning("request %s: decode worker %s lost after %d tokens; migrating to %s",
                       rid, lost_id, len(samples[0].token_ids), decode.worker_id)
        if self.metrics:
            self.metrics.request_migrated(lost_id)
        return _Attempt(att.number + 1, decode, None)

    async def _reserve_successor(self, v: ValidatedRequest, rid: str,
                                 lost: WorkerHandle) -> WorkerHandle:
        """Reserve a decode worker other than the ``lost`` incarnation, waiting for
        one to come into service while none is alive (at most
        ``worker_wait_timeout_s``; counted in ``tandem:request_worker_waits``).

        Raises:
            ServiceUnavailable: none came within the bound.
        """
        cluster, t0 = self.cluster, None
        try:
            while True:
                try:
                    decode = cluster.reserve_decode(rid, v.prompt_token_ids, exclude=(lost,))
                except RuntimeError:
                    pass
                else:
                    if t0 is not None:
                        waited, t0 = time.monotonic() - t0, None
                        logger.warning("request %s: %s took over after %.1f s", rid,
                                       decode.worker_id, waited)
                        if self.metrics:
                            self.metrics.worker_wait_ended("resumed", waited)
                    return decode
                now = time.monotonic()
                if t0 is None:
                    t0 = now
                    logger.warning("request %s: decode worker %s lost and no other is alive; "
                                   "waiting up to %g s for one", rid, lost.worker_id,
                                   self.worker_wait_timeout_s)
                    if self.metrics:
                        self.metrics.worker_wait_started()
                remaining = t0 + self.worker_wait_timeout_s - now
                if remaining <= 0:
                    waited, t0 = now - t0, None
                    if self.metrics:
                        self.metrics.worker_wait_ended("timed_out", waited)
                    raise ServiceUnavailable(
                        f"the request's decode worker {lost.worker_id} failed and no decode "
                        f"worker took it over within {self.worker_wait_timeout_s:g} s")
                # Woken by any worker coming up; re-checked each second in case one
                # came back without an event.
                await cluster.wait_worker_up(min(remaining, 1.0))
        finally:
            if t0 is not None and self.metrics:      # its client went away meanwhile
                self.metrics.worker_wait_ended("abandoned", time.monotonic() - t0)

    async def _run(self, v: ValidatedRequest, rid: str, att: _Attempt,
                   samples: list[SampleStream], queue: asyncio.Queue,
                   trace) -> AsyncIterator[SampleEvent]:
        """One attempt: add the request to ``att.decode`` (resuming after the tokens
        emitted so far), prefill remotely if ``att.prefill``, relay deltas.

        Raises:
            _WorkerLost: the decode worker died (or was replaced) meanwhile.
        """
        cluster, params = self.cluster, v.sampling_params
        if att.number:
            # What is still queued came from the lost incarnation: its deltas are
            # recomputed from the samples' tokens, and a replacement under the same
            # id was announced as that id going down. Not this attempt's.
            while not queue.empty():
                queue.get_nowait()
            # Each unfinished sample resumes after its own tokens (as sample i: its
            # own seed stream); an n == 1 request's tokens are checked against the journal.
            if params.n == 1:
                entry = await self._journal_load(rid)
                if entry is not None and list(entry.token_ids) != samples[0].token_ids:
                    raise RuntimeError(
                        f"request {rid}: the journal's tokens disagree with the stream")
            if params.use_beam_search:
                # The beams arrive together at the end: nothing was emitted, so the
                # search restarts whole on the new worker.
                reqs = [WorkerRequest(rid, v.prompt_token_ids, params, v.priority,
                                      router_id=cluster.router_id, attempt=att.number)]
            else:
                reqs = [self._resumed_sample(v, rid, s, cluster.router_id, att.number)
                        for s in samples if not s.finished]
        else:
            kv = (KVTransferParams(att.prefill.worker_id, attempt=att.number,
                                   peer_generation=att.prefill.generation)
                  if att.prefill is not None else None)
            reqs = [WorkerRequest(rid, v.prompt_token_ids, params, v.priority, kv,
                                  router_id=cluster.router_id)]
        self.journal_writer.submit("assign", rid, att.decode.worker_id, att.number)
        # The decode worker computes the prompt: its in-flight prefill tokens until the
        # first token (conditional disaggregation weighs them, _pick_prefill).
        local = 0 if att.prefill is not None else len(v.prompt_token_ids)
        att.decode.inflight_prefill_tokens += local
        att.decode.inflight_local_prefills += bool(local)
        # The decode worker waits for this prompt's KV: no decode batch of it yet
        # (prefer_local_prefill weighs that, _decode_idle).
        remote = att.prefill is not None
        att.decode.inflight_remote_prefills += remote
        try:
            att.added = asyncio.ensure_future(self._add(att.decode, reqs))
            if att.prefill is not None:          # the first attempt: reqs is the one request
                # At once: the prefill worker takes the decode worker's ticket from their
                # KV channel.
                att.prefilled = self._start_prefill(reqs[0], att)
            try:
                await asyncio.shield(att.added)
            except (WorkerDiedError, WorkerFencedError) as exc:
                self._lost(att.decode, exc)
            if att.prefill is None and trace is not None and trace.dispatched is None:
                trace.dispatched = time.monotonic()
            if att.prefill is not None:
                async for ev in self._remote_prefill(reqs[0], att, samples, queue, trace):
                    yield ev
                # Its prefill is over, remote or (after a failed transfer) on the
                # decode worker: from here on it is decoded.
                att.decode.inflight_remote_prefills -= remote
                remote = False
            while not all(s.finished for s in samples):
                item = await queue.get()
                _raise_if_lost(item)
                events = self._consume(v, rid, samples, item, trace)
                if events and local:
                    att.decode.inflight_prefill_tokens -= local
                    att.decode.inflight_local_prefills -= 1
                    local = 0
                for ev in events:
                    yield ev
        finally:
            att.decode.inflight_prefill_tokens -= local
            att.decode.inflight_local_prefills -= bool(local)
            att.decode.inflight_remote_prefills -= remote

    @staticmethod
    def _resumed_sample(v: ValidatedRequest, rid: str, s: SampleStream, router_id: str,
                        attempt: int) -> WorkerRequest:
        """Sample ``s`` of a request as an ``n == 1`` request of its own, resuming
        after the tokens it emitted (its deltas name the request and ``s.index``, so
        they reach the same sample stream)."""
        params = v.sampling_params
        lps = tuple(s.logprobs) if params.logprobs is not None and s.token_ids else ()
        return WorkerRequest(rid, v.prompt_token_ids,
                             dataclasses.replace(params, n=1), v.priority,
                             output_token_ids=tuple(s.token_ids), output_logprobs=lps,
                             router_id=router_id, attempt=attempt, sample_index=s.index)

    async def _add(self, w: WorkerHandle, reqs: list[WorkerRequest]) -> None:
        """Add ``reqs`` to ``w``; all or none: if one is refused, those added are
        aborted and the first error is raised."""
        results = await asyncio.gather(*(self._add_one(w, r) for r in reqs),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r, res in zip(reqs, results):
                if not isinstance(res, BaseException):
                    await self._try(w.client.abort(r.request_id, r.sample_index))
            raise errors[0]

    async def _add_one(self, w: WorkerHandle, r: WorkerRequest) -> None:
        """Add ``r`` to ``w`` on its output stream where it has one
        (:meth:`_on_stream`: it reaches the engine in a fraction of a millisecond,
        the ``add_request`` call in 2-3 ms); by call otherwise.

        Raises:
            as :meth:`WorkerClient.add_request`.
        """
        await self._on_stream(w, r, w.client.add_request, ADD_ANSWER_TIMEOUT_S)

    async def _on_stream(self, w: WorkerHandle, r: WorkerRequest,
                         call: Callable[[WorkerRequest], Awaitable], timeout_s: float | None):
        """Send ``r`` to ``w`` on its output stream (:meth:`Cluster.add_on_stream`)
        and return what its answer carries (a prefill worker's first token; None
        from a decode worker); by ``call`` (``w.client.add_request``,
        ``w.client.prefill``) where ``w`` has no stream that takes requests, for a request
        whose grammar must compile first, and when the stream ended, or stayed
        silent ``timeout_s`` seconds (None: no limit), before the answer came: the
        call is then marked ``sent_on_stream`` and the worker matches it with the
        frame it may have read, so the request runs once.

        Raises:
            as ``call``.
        """
        if r.sampling_params.structured_outputs is None:
            ahead = dataclasses.replace(r, sent_on_stream=True)
            answer = self.cluster.add_on_stream(w, ahead)
            if answer is not None:
                try:
                    result = await asyncio.wait_for(asyncio.shield(answer), timeout_s)
                except (OutputStreamError, asyncio.TimeoutError):
                    self.cluster.forget_answer(w, ahead)
                    return await call(ahead)
                if result.error is not None:
                    raise as_raised(w.worker_id, call.__name__, result.error)
                return result.first
        return await call(r)

    def _lost(self, w: WorkerHandle, exc: BaseException):
        """A call to the attempt's decode worker found it gone: raise :class:`_WorkerLost`."""
        if isinstance(exc, WorkerDiedError):
            self.cluster.mark_dead(w, exc)
        raise _WorkerLost(w.worker_id) from exc

    def _start_prefill(self, req: WorkerRequest, att: _Attempt) -> asyncio.Future:
        """Send ``req`` to the attempt's prefill worker, without a ticket: it takes
        the one the decode worker posts on their KV channel. The future's result is
        the first token's delta."""
        prefill = att.prefill
        prefill.inflight_prefill_tokens += len(req.prompt_token_ids)
        # On its output stream, as the decode worker's add; no time limit on the
        # answer: _wait_prefill watches the worker's progress and life.
        call = asyncio.ensure_future(self._on_stream(prefill, dataclasses.replace(
            req, kv_transfer_params=KVTransferParams(att.decode.worker_id, None, att.number)),
            prefill.client.prefill, None))

        def done(fut: asyncio.Future) -> None:
            prefill.inflight_prefill_tokens -= len(req.prompt_token_ids)
            _ignore_result(fut)     # retrieved however this ends (a client may leave mid-prefill)
        call.add_done_callback(done)
        return call

    async def _remote_prefill(self, req: WorkerRequest, att: _Attempt,
                              samples: list[SampleStream], queue: asyncio.Queue,
                              trace) -> AsyncIterator[SampleEvent]:
        """Step 3 of a disaggregated request: wait until the decode worker reserved
        the blocks (its ticket's delta), then for the prefill worker's first token,
        and emit it; the decode worker got the same token on the KV channel and
        decodes on. If the prefill fails, tell the decode worker to compute the
        prompt itself.

        Raises:
            _WorkerLost: the decode worker died meanwhile.
        """
        rid, cluster, decode, prefill = req.request_id, self.cluster, att.decode, att.prefill
        call = att.prefilled
        while True:
            item = await queue.get()
            _raise_if_lost(item)
            if item.kv_transfer_ticket is not None:
                break
            if item.finish_reason is not None:        # the decode worker failed
                self._spawn(self._try(prefill.client.abort(rid)))
                for ev in self._consume(None, rid, samples, item, trace):
                    yield ev
                return
        if trace is not None:
            trace.dispatched = time.monotonic()
        ticket = item.kv_transfer_ticket
        t0 = time.perf_counter()
        # The decode worker's own first delta, if it came while the prompt was
        # prefilled: streamed right after the first token, before anything the queue
        # received after it (putting it back in the queue would reorder the two).
        early: RequestDelta | None = None
        try:
            # The decode worker may die while the prompt is prefilled for it; the prefill
            # worker may die or stall (its KV is useless once the decode side's load
            # timed out).
            lost = asyncio.ensure_future(queue.get())
            prefill_down = cluster.watch_down(prefill)
            try:
                await self._wait_prefill(call, lost, prefill_down, prefill, att.decode, rid)
            finally:
                prefill_down.cancel()
                if not lost.done():
                    lost.cancel()
            if lost.done() and not lost.cancelled():
                early = lost.result()
                _raise_if_lost(early)
            if not call.done():
                self._spawn(self._try(prefill.client.abort(rid)))
                raise WorkerError(prefill.worker_id, "prefill",
                                  "worker gone" if prefill_down.done() and
                                  not prefill_down.cancelled() else "stalled past the KV transfer timeout")
            first: RequestDelta = await call
        except KVLayoutMismatchError as exc:
            raise RequestFailed(str(exc)) from exc
        except (KVTransferError, WorkerError) as exc:
            logger.warning("request %s: remote prefill on %s failed (%s); prefilling on %s",
                           rid, prefill.worker_id, exc, decode.worker_id)
            if self.metrics:
                self.metrics.kv_transfer_failed(prefill.worker_id)
            if isinstance(exc, WorkerDiedError):
                cluster.mark_dead(prefill, exc)
            # The prefill worker may have handed its first token over on the KV
            # channel before its reply was lost: then the decode worker returns it.
            first = await self._call_decode(att, att.decode.client.start_decode(rid, None))
            if first is None:
                for ev in (self._consume(None, rid, samples, early, trace)
                           if early is not None else ()):
                    yield ev
                return
        else:
            if self.metrics and trace is not None:
                self.metrics.kv_transferred(trace, prefill.worker_id, ticket,
                                            time.perf_counter() - t0)
        if first.finish_reason == "length" and req.sampling_params.max_tokens > 1:
            # The prefill worker always stops after one token; the request goes on.
            first = dataclasses.replace(first, finish_reason=None, stop_reason=None)
        for ev in self._consume(None, rid, samples, first, trace):
            yield ev
        if samples[0].finished:      # the first token ended it (EOS, stop string, max_tokens 1)
            await self._call_decode(att, att.decode.client.abort(rid))
        elif early is not None:
            for ev in self._consume(None, rid, samples, early, trace):
                yield ev

    async def _wait_prefill(self, call: asyncio.Future, lost: asyncio.Future,
                            prefill_down: asyncio.Future, prefill: WorkerHandle,
                            decode: WorkerHandle, rid: str) -> None:
        """Wait until the prefill call, the decode worker's queue or the prefill
        worker's death completes, or the prefill worker stalls: no step output for
        ``prefill_timeout_s`` seconds (or three of its latest steps' time, on a
        machine so loaded that one step takes longer). Time the prompt spends
        queued behind others at a busy prefill worker does not count; meanwhile the
        decode side's KV load is kept waiting (``extend_kv_load``), so a queued
        prompt is never prefilled twice. Returns on the first of these, with
        ``call`` still pending if stalled."""
        sent_at = time.monotonic()
        extended_at = sent_at
        while True:
            timeout = max(self.prefill_timeout_s, 3 * prefill.last_step_s)
            progress = max(sent_at, prefill.last_output_at or sent_at)
            left = progress + timeout - time.monotonic()
            if left <= 0:
                return
            done, _ = await asyncio.wait([call, lost, prefill_down], timeout=min(left, timeout / 3),
                                         return_when=asyncio.FIRST_COMPLETED)
            if done:
                return
            now = time.monotonic()
            if (now - extended_at >= self.prefill_timeout_s / 3
                    and now - max(sent_at, prefill.last_output_at or sent_at) < timeout):
                extended_at = now
                # The decode side's own timeout (the transfer timeout, about ours) must
                # not fire on a prompt that is queued, not stalled.
                self._spawn(self._try(decode.client.extend_kv_load(rid, timeout)))

    async def _call_decode(self, att: _Attempt, call: Awaitable):
        """Await ``call``, a call to the attempt's decode worker
        (``att.decode.client.<method>(...)``); a gone worker raises :class:`_WorkerLost`."""
        try:
            return await call
        except (WorkerDiedError, WorkerFencedError) as exc:
            self._lost(att.decode, exc)

    def _consume(self, v: ValidatedRequest | None, rid: str, samples: list[SampleStream],
                 delta: RequestDelta, trace) -> list[SampleEvent]:
        """Apply one worker delta to its sample (and the journal); the events it makes."""
        index = delta.sample_index
        if delta.finish_reason == "error" and index == 0:
            # The worker failed: every sample of the request ends with ``error``.
            return [SampleEvent(s, upd) for s in samples
                    if (upd := s.fail("error", delta.stop_reason)) is not None]
        s = samples[index]
        upd = s.add(delta)
        if upd is None:
            return []
        if len(samples) == 1 and upd.token_ids:
            self.journal_writer.submit("append_tokens", rid, upd.token_ids)
        if self.metrics and trace is not None:
            self.metrics.tokens(trace, index, len(upd.token_ids))
        if upd.needs_abort:
            self._spawn(self._abort_sample(rid, index))
        return [SampleEvent(s, upd)]

    def _journal_entry(self, rid: str) -> tuple[dict, list[int]] | None:
        """What the journal writer writes again when the cluster state lost a running
        request's entry (Redis restarted): its record and, for ``n == 1``, its tokens."""
        if rid not in self._journaled:
            return None
        record, samples = self._journaled[rid]
        return record, (list(samples[0].token_ids) if len(samples) == 1 else [])

    async def _journal_load(self, rid: str):
        """The request's journal entry once every write of it is applied; ``None`` when
        the cluster state is unreachable (Redis restarting: a migration then resumes
        from the stream) or lost it."""
        try:
            await self.journal_writer.flush()
            return await asyncio.to_thread(self.journal.load, rid)
        except Exception as exc:
            logger.warning("request journal load failed: %s", exc)
            return None

    # -- aborts --------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, rid: str, att: _Attempt, unfinished: list[SampleStream]) -> None:
        if att.added is None:
            return
        try:                  # an abort must not overtake the call that adds the request
            await att.added
        except Exception:     # never added: nothing to abort but a prefill waiting for its ticket
            if att.prefilled is not None and not att.prefilled.done() and att.prefill.alive:
                await self._try(att.prefill.client.abort(rid))
            return
        if att.prefill is not None and att.prefill.alive:
            await self._try(att.prefill.client.abort(rid))
        if not att.decode.alive:
            return
        await self._try(att.decode.client.abort(rid))
        for s in unfinished:
            if s.index:
                await self._try(att.decode.client.abort(rid, s.index))

    async def _abort_sample(self, rid: str, index: int) -> None:
        for w in self.cluster.decode:
            if w.alive:
                await self._try(w.client.abort(rid, index))

    @staticmethod
    async def _try(call: Awaitable) -> None:
        """Await ``call`` (a worker call whose failure changes nothing: an abort, an
        extension), logging a failure (a :class:`WorkerError` names the worker and
        the method)."""
        try:
            await call
        except Exception as exc:
            logger.warning("worker call failed: %s: %s", type(exc).__name__, exc)
