"""The decode worker: a thin adapter that puts one :class:`LLMEngine` behind a Ray actor.

Also the colocated worker (``role="colocated"``): the same engine prefills its own
requests (chunked prefill mixed into decode batches), which is both the
single-device deployment and the baseline disaggregation is measured against.

Disaggregation lives in the engine (:mod:`tandem.engine.kv.kv_connector`): a request
added with ``kv_transfer_params`` waits in the scheduler for its blocks, then
for its KV (``WAITING_FOR_REMOTE_KV``); the step that reserved its blocks
publishes the KV ticket in the request's delta, which the router hands to the
prefill worker; the same step posts the ticket on the KV channel, where the
prefill worker takes it without waiting for the router, and the prefill worker
hands the first token back on that channel. :meth:`DecodeWorker.start_decode`
is the router's word, needed only when the prefill failed.

A plain class with async methods: Ray makes it an actor
(``ray.remote(DecodeWorker)``), tests and GPU checks can drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from tandem.control.worker_control import ControlConfig, start_worker_control
from tandem.engine.config import EngineConfig
from tandem.engine.runtime.core_lending import CoreLendingConfig
from tandem.engine.runtime.early_adds import EarlyAdds, portable
from tandem.engine.runtime.engine_worker import EngineWorker
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.runtime.outputs import AddResult, RequestDelta, WorkerRequest
from tandem.engine.runtime.worker_common import node_ip_address
from tandem.engine.scheduling.request import TokenLogprobs

logger = logging.getLogger(__name__)

class DecodeWorker(EngineWorker):
    """Decode (or colocated) worker around one :class:`LLMEngine`; what every worker
    answers the same way (``info``, ``fence``, ``poll``, ``stats``, ``abort``, ...)
    is :class:`~tandem.engine.runtime.engine_worker.EngineWorker`'s.

    Args:
        worker_id: e.g. ``decode-0``.
        config: engine configuration (model, dtype, KV cache, scheduler).
        role: ``decode`` or ``colocated``.
        cpus: cores to pin this process to (None: leave as is).
        kv_transport: transport config string (``gloo``, ``nccl``); None for a
            colocated worker.
        transfer_timeout_s: how long a reserved request may wait for its KV (seconds).
        control: the cluster state to register in (lease, KV event stream); None
            for a worker no control plane knows (tests, GPU checks).
        weights_from: an engine in this process whose loaded weights to share (a
            worker driven in-process: tests, GPU checks); None loads them.
        engine_nice: added to the nice value of the engine's threads (its loop and
            OpenMP threads), below this process's RPC threads; see
            :meth:`~tandem.engine.runtime.engine_loop.EngineLoop.build`.
        core_lending: this worker's slot on its machine's core board: it steps on
            its idle peers' cores too (:mod:`~tandem.engine.runtime.core_lending`);
            None: on its own.
    """

    def __init__(self, worker_id: str, config: EngineConfig, role: str = "decode",
                 cpus: list[int] | None = None, kv_transport: str | None = "gloo",
                 transfer_timeout_s: float = 60.0, control: ControlConfig | None = None,
                 weights_from: LLMEngine | None = None, engine_nice: int = 0,
                 core_lending: CoreLendingConfig | None = None):
        super().__init__(worker_id, role, config, cpus, lambda: LLMEngine(
            config, kv_transport=kv_transport if role == "decode" else None,
            transfer_timeout_s=transfer_timeout_s, enable_kv_events=True,
            weights_from=weights_from), engine_nice, core_lending=core_lending)
        self.early_adds = EarlyAdds()
        self.control = start_worker_control(control, worker_id, role, self._static_info(),
                                            self._fence, self.loop)

    async def open_kv_channel(self, peer_id: str, peer_generation: int = 0,
                              peer_layout: dict | None = None) -> dict:
        """Listen (on this node's address) for prefill worker ``peer_id``'s KV, from its
        incarnation ``peer_generation`` (the cluster registry's), whose KV layout is
        ``peer_layout`` (its ``info()["kv_layout"]``; None: one rank); returns the
        rendezvous to hand it: one pair per (prefill rank, decode rank) whose KV
        heads overlap. A request whose ``kv_transfer_params.peer_generation``
        differs fails its load at once (and is prefilled here if the router says so).

        Raises:
            KVLayoutMismatchError: a KV head this worker holds is on no rank of the peer.
        """
        return await self._call(self.engine.kv_connector.open_channel, peer_id,
                                node_ip_address(), peer_generation, peer_layout)

    # -- requests ------------------------------------------------------------------------------
    async def add_request(self, request: WorkerRequest) -> None:
        """Queue a request: computed here, or (with ``kv_transfer_params``) prefilled
        by a prefill worker, its KV ticket published once blocks are reserved.

        Its deltas go to the poll of ``request.router_id`` only. A resumed request
        (``output_token_ids``, migrated from a worker that died) continues after
        those tokens; they count as published, so its deltas carry only new tokens
        (``num_output_tokens`` counts all). A sample resumed alone
        (``sample_index`` i) runs under its own engine id and its deltas name the
        request and the sample.

        A request the router wrote on its output stream first
        (``request.sent_on_stream``: the stream broke before the answer came) may
        have been added from there already (:class:`EarlyAdds`): the call then
        returns that add's result.

        Raises:
            InvalidParameterError: the engine refuses it (field named).
            WorkerFencedError: this worker is fenced (:meth:`fence`).
        """
        if request.sent_on_stream:
            started = self.early_adds.claim(request)
            if started is not None:
                return await asyncio.wrap_future(started)
        self._fence.check()
        await self.compile_constraint(request.sampling_params)
        await self._call(self._add_now, request)

    def _add_now(self, request: WorkerRequest) -> None:
        """Add ``request`` to the engine (on the loop's thread)."""
        first = self.engine.add_request(
            list(request.prompt_token_ids), request.sampling_params, request.request_id,
            request.priority, request.kv_transfer_params, request.output_token_ids,
            request.output_logprobs, request.sample_index)[0]
        self.loop.assign(first.request_id, request.router_id)
        if request.output_token_ids:      # the client has them already
            self.loop.mark_published(first.request_id, len(request.output_token_ids))

    def _request_from_stream(self) -> Callable[[str, WorkerRequest], None]:
        return self._add_from_stream

    def _add_from_stream(self, subscriber: str, request: WorkerRequest) -> None:
        """A request router ``subscriber`` wrote on its output stream: added on the
        engine loop (fenced as :meth:`add_request` is), and answered with an
        :class:`AddResult` in that router's outbox, unless a call for it came first
        (runs on the stream's reader thread). Its own requests only, and none whose
        grammar must compile first (its call does that)."""
        if (request.router_id != subscriber
                or request.sampling_params.structured_outputs is not None):
            return

        def add() -> None:
            try:
                self._fence.check()
                self._add_now(request)
            except Exception as exc:
                self.loop.subscribers.answer(subscriber, AddResult.to(request, portable(exc)))
                raise
            self.loop.subscribers.answer(subscriber, AddResult.to(request))
        self.early_adds.from_stream(request, lambda: self.loop.call(add))

    async def start_decode(self, request_id: str, first_token_id: int | None,
                           first_logprobs: TokenLogprobs | None = None) -> RequestDelta | None:
        """The router's word on a remote prefill: it returned ``first_token_id``, or
        (None) it failed and the prompt is computed here; see
        :meth:`LLMEngine.start_decode`. The prefill worker's own word, the first
        token on the KV channel, usually came first: then this changes nothing.

        Returns:
            Given None while the prefill worker had already handed its first token
            over on the KV channel (its reply to the router was lost): that token's
            delta, which the router passes on before the deltas that follow it;
            otherwise None.

        Raises:
            KeyError: the request is not waiting for remote KV (aborted).
        """
        def start() -> RequestDelta | None:
            taken = self.engine.start_decode(request_id, first_token_id, first_logprobs)
            if taken is None:
                if first_token_id is not None:
                    self.loop.mark_published(request_id, 1)   # the router sent it already
                return None
            if first_token_id is not None:
                return None
            token_id, logprobs = taken
            req = self.engine.scheduler.requests[request_id]
            return RequestDelta(request_id, (token_id,),
                                (logprobs,) if logprobs is not None else (),
                                num_prompt_tokens=req.num_prompt_tokens,
                                num_cached_tokens=req.num_cached_tokens, num_output_tokens=1)
        return await self._call(start)

    async def extend_kv_load(self, request_id: str, timeout_s: float) -> bool:
        """The router saw the request's prefill worker make progress: its KV load
        may wait ``timeout_s`` more seconds (see :meth:`LLMEngine.extend_kv_load`)."""
        return await self._call(self.engine.extend_kv_load, request_id, timeout_s)

    def _invariant_extras(self) -> dict:
        """Late KV layers dropped so far (``kv_layers_dropped``), requests added from
        a router's output stream ahead of their call (``adds_from_stream``), and where remote
        prefills' first tokens came from: the KV channel (``first_tokens_from_peer``)
        or the router (``first_tokens_from_router``)."""
        connector = self.engine.kv_connector
        return {"kv_layers_dropped": connector.num_dropped_layers if connector is not None else 0,
                "adds_from_stream": self.early_adds.num_from_stream,
                "first_tokens_from_peer": self.engine.num_first_tokens_from_peer,
                "first_tokens_from_router": self.engine.num_first_tokens_from_caller}

