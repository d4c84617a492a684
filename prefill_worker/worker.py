"""The prefill worker: a thin adapter that puts one :class:`LLMEngine` behind a Ray actor.

Prompts are batched under the engine's token budget (chunked prefill); prefix
blocks this worker already caches are not computed again. The engine's KV
connector streams each layer's blocks (those the decode side does not already
hold) to the decode worker from inside the forward pass of the step that
computes a request's last prompt chunk, so the transfer of layer ``l``
overlaps the compute of layer ``l + 1`` (:mod:`tandem.engine.kv.kv_connector`).
The first token is sampled here (that is the TTFT), handed to the decode worker
on the KV channel and sent to the router. The request's blocks are freed once
the transfer drained; its full blocks stay in the prefix cache.

The router sends a request here and to its decode worker at once: a request
that comes without a ticket waits for the one its decode worker posts on their
KV channel once it reserved the blocks (at most ``ticket_timeout_s``). It comes on
the router's output stream (:mod:`~tandem.engine.runtime.output_stream`), and the
first token goes back there as the answer; by ``prefill`` call only when that
stream broke first (:class:`~tandem.engine.runtime.early_adds.EarlyAdds` runs it
once either way) or the request's grammar must compile first.

A plain class with async methods: Ray makes it an actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Callable

from tandem.control.worker_control import ControlConfig, start_worker_control
from tandem.engine.config import EngineConfig
from tandem.engine.runtime.core_lending import CoreLendingConfig
from tandem.engine.runtime.early_adds import EarlyAdds, portable
from tandem.engine.runtime.engine_worker import EngineWorker
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.runtime.outputs import AddResult, RequestDelta, WorkerRequest
from tandem.engine.runtime.worker_common import node_ip_address

logger = logging.getLogger(__name__)

ABORT_MARK_TTL_S = 60.0
"""Seconds an abort that found its request nowhere here refuses the request if it
arrives after all (see :meth:`PrefillWorker.abort`)."""


def prefill_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` as a prefill worker runs it: without the burst rule
    (``SchedulerConfig.burst_prefill_tokens``), which spreads prompts over steps by
    the sequences decoding beside them; a prefill worker never decodes, so the rule
    would prefill its prompts one by one. Its steps take prompts as the token budget
    allows."""
    if config.scheduler.burst_prefill_tokens is None:
        return config
    return dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, burst_prefill_tokens=None))


class PrefillWorker(EngineWorker):
    """Prefill worker around one :class:`LLMEngine`; what every worker answers the
    same way (``info``, ``fence``, ``poll``, ``stats``, ``abort``, ...) is
    :class:`~tandem.engine.runtime.engine_worker.EngineWorker`'s.

    Args:
        worker_id: e.g. ``prefill-0``.
        config: engine configuration; its KV layout must equal the decode workers'.
        cpus: cores to pin this process to (None: leave as is).
        kv_transport: transport config string (``gloo``, ``nccl``).
        transfer_timeout_s: seconds to wait for a transfer to drain.
        control: the cluster state to register in (lease, KV event stream); None
            for a worker no control plane knows (tests, GPU checks).
        weights_from: an engine in this process whose loaded weights to share (a
            worker driven in-process: tests, GPU checks); None loads them.
        engine_nice: added to the nice value of the engine's threads (its loop and
            OpenMP threads), below this process's RPC threads; see
            :meth:`~tandem.engine.runtime.engine_loop.EngineLoop.build`.
        ticket_timeout_s: seconds a request that came without a ticket waits for its
            decode worker's (which reserves blocks in queue order, so a busy decode
            pool makes it wait); past that it fails like a failed transfer.
        core_lending: this worker's slot on its machine's core board: it steps on
            its idle peers' cores too (:mod:`~tandem.engine.runtime.core_lending`);
            None: on its own.
    """

    def __init__(self, worker_id: str, config: EngineConfig, cpus: list[int] | None = None,
                 kv_transport: str = "gloo", transfer_timeout_s: float = 60.0,
                 control: ControlConfig | None = None, weights_from: LLMEngine | None = None,
                 engine_nice: int = 0, ticket_timeout_s: float = 600.0,
                 core_lending: CoreLendingConfig | None = None):
        config = prefill_engine_config(config)
        self.ticket_timeout_s = ticket_timeout_s
        # request id -> (decode worker id, future of its ticket), while it waits
        self._ticket_waits: dict[str, tuple[str, Future]] = {}
        self.early_prefills = EarlyAdds()
        # request id -> when an abort found it nowhere here (it may still arrive)
        self._aborted_early: dict[str, float] = {}
        super().__init__(worker_id, "prefill", config, cpus, lambda: LLMEngine(
            config, kv_transport=kv_transport, transfer_timeout_s=transfer_timeout_s,
            enable_kv_events=True, weights_from=weights_from), engine_nice,
            publish_deltas=False, core_lending=core_lending)
        self.control = start_worker_control(control, worker_id, "prefill", self._static_info(),
                                            self._fence, self.loop)

    async def connect_kv(self, peer_id: str, rendezvous: dict, decode_layout: dict,
                         generation: int = 0) -> None:
        """Join decode worker ``peer_id``'s KV channel as incarnation ``generation`` of
        this worker (the cluster registry's): a ticket for another generation is
        refused, so a zombie of this worker never writes into reassigned blocks.

        Raises:
            KVLayoutMismatchError: the two caches disagree (block size, dtype, heads,
                ...); the message names each field with both values.
        """
        await asyncio.to_thread(self.engine.kv_connector.connect, peer_id, rendezvous,
                                decode_layout, node_ip_address(), generation)

    async def close_kv_channel(self, peer_id: str) -> bool:
        """Close the pair to decode worker ``peer_id`` (e.g. before re-creating a broken
        one). Requests for that peer then fail with ``KVTransferError`` until
        :meth:`connect_kv` runs again. Returns whether there was a pair."""
        return await self._call(self.engine.kv_connector.close_channel, peer_id)

    async def prefill(self, request: WorkerRequest) -> RequestDelta:
        """Run the prompt, stream its KV to the ticket's decode worker, sample the
        first token.

        Without ``kv_transfer_params.ticket``, first waits for the ticket the decode
        worker posts on the KV channel (see the module's docstring). A request its
        router wrote on the output stream first (``request.sent_on_stream``: the
        stream broke before the answer came) may be prefilling from there already:
        the call then returns that prefill's result.

        Returns:
            The first token's :class:`RequestDelta` (``finish_reason`` ``length``, or
            ``stop`` if that token already ends the request, e.g. EOS).

        Raises:
            KVTransferError: the transfer failed or timed out, no ticket came
                within ``ticket_timeout_s`` (blocks are freed), or an abort for the
                request came before it (:meth:`abort`).
            WorkerFencedError: this worker is fenced (:meth:`fence`).
        """
        if request.sent_on_stream:
            started = self.early_prefills.claim(request)
            if started is not None:
                return await asyncio.wrap_future(started)
        return await self._prefill(request)

    async def _prefill(self, request: WorkerRequest) -> RequestDelta:
        """:meth:`prefill`'s work (on this actor's event loop)."""
        from tandem.kvtransfer.base import KVTransferError

        self._refuse_if_aborted(request.request_id)
        self._fence.check()
        params = request.sampling_params
        await self.compile_constraint(params)
        self._refuse_if_aborted(request.request_id)      # while its grammar compiled
        kv = request.kv_transfer_params
        if kv is not None and kv.ticket is None:
            request = dataclasses.replace(request, kv_transfer_params=dataclasses.replace(
                kv, ticket=await self._wait_ticket(request.request_id, kv.peer_id, kv.attempt)))
        first = dataclasses.replace(params, n=1, max_tokens=1,
                                    min_tokens=min(params.min_tokens, 1), stop=())

        def add():
            self.engine.add_request(list(request.prompt_token_ids), first, request.request_id,
                                    request.priority, request.kv_transfer_params)
            self.loop.assign(request.request_id, request.router_id)   # aborted if it dies
            return self.loop.track(request.request_id)

        delta: RequestDelta = await asyncio.wrap_future(await self._call(add))
        if delta.finish_reason == "error":
            raise KVTransferError(f"{self.worker_id}: {delta.stop_reason}")
        return delta

    def _refuse_if_aborted(self, request_id: str) -> None:
        """Raise ``KVTransferError`` if an abort came for ``request_id`` before it
        (see :meth:`abort`)."""
        from tandem.kvtransfer.base import KVTransferError

        if self._aborted_early.pop(request_id, None) is not None:
            raise KVTransferError(f"{self.worker_id}: request {request_id!r} was aborted "
                                  "before it arrived")

    def _request_from_stream(self) -> Callable[[str, WorkerRequest], None]:
        return self._prefill_from_stream

    def _prefill_from_stream(self, subscriber: str, request: WorkerRequest) -> None:
        """A request router ``subscriber`` wrote on its output stream: prefilled on
        this actor's event loop as :meth:`prefill` would, and answered in that
        router's outbox with an :class:`AddResult` holding the first token's delta
        (or the error the call would raise), unless a call for it came first (runs
        on the stream's reader thread). Its own requests only, and none whose
        grammar must compile first (its call does that)."""
        if (request.router_id != subscriber
                or request.sampling_params.structured_outputs is not None):
            return

        async def prefill() -> RequestDelta:
            try:
                first = await self._prefill(request)
            except BaseException as exc:
                self.loop.subscribers.answer(subscriber, AddResult.to(request, portable(exc)))
                raise
            self.loop.subscribers.answer(subscriber, AddResult.to(request, first=first))
            return first
        self.early_prefills.from_stream(
            request, lambda: asyncio.run_coroutine_threadsafe(prefill(), self._rpc_loop))

    async def _wait_ticket(self, request_id: str, peer_id: str, attempt: int) -> dict:
        """The ticket decode worker ``peer_id`` posts for ``request_id`` (attempt
        ``attempt``) on their KV channel; :meth:`abort` stops the wait.

        Raises:
            KVTransferError: none within ``ticket_timeout_s``, or no channel to ``peer_id``.
            asyncio.CancelledError: the request was aborted meanwhile.
        """
        from tandem.kvtransfer.base import KVTransferError

        connector = self.engine.kv_connector
        fut = connector.ticket_future(peer_id, request_id, attempt)
        self._ticket_waits[request_id] = (peer_id, fut)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.ticket_timeout_s)
        except asyncio.TimeoutError:
            raise KVTransferError(f"{self.worker_id}: no KV ticket for request {request_id!r} "
                                  f"from {peer_id} within {self.ticket_timeout_s:g} s") from None
        finally:
            if self._ticket_waits.pop(request_id, None) is not None and not fut.done():
                connector.forget_ticket(peer_id, request_id)

    async def abort(self, request_id: str, sample_index: int = 0) -> bool:
        """Abort ``request_id`` here, also while it waits for its ticket (the ticket
        that comes later is dropped); see :meth:`EngineWorker.abort`. An abort that
        finds the request nowhere here may have overtaken it (the router sends it on
        the output stream, the abort by call): the request is then refused if it
        comes within :data:`ABORT_MARK_TTL_S` seconds (``KVTransferError``; a router
        aborts a request here only when it no longer wants its prefill)."""
        waiting = self._ticket_waits.pop(request_id, None)
        if waiting is not None:
            peer_id, fut = waiting
            self.engine.kv_connector.forget_ticket(peer_id, request_id)
            fut.cancel()
        found = await super().abort(request_id, sample_index) or waiting is not None
        if not found:
            now = time.monotonic()
            self._aborted_early = {rid: t for rid, t in self._aborted_early.items()
                                   if now - t < ABORT_MARK_TTL_S}
            self._aborted_early[request_id] = now
        return found

    def _invariant_extras(self) -> dict:
        """KV bytes sent so far (``kv_transfer_bytes``) and requests prefilled from a
        router's output stream (``prefills_from_stream``)."""
        return {"kv_transfer_bytes": self.engine.kv_connector.kv_transfer_bytes,
                "prefills_from_stream": self.early_prefills.num_from_stream}
