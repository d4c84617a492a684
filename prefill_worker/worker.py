"""The prefill worker: a thin adapter that puts one :class:`LLMEngine` behind a Ray actor.

Prompts are batched under the engine's token budget (chunked prefill); prefix
blocks this worker already caches are not computed again. The engine's KV
connector streams each layer's blocks (those the decode side does not already
hold) to the decode worker from inside the forward pass of the step that
computes a request's last prompt chunk, so the transfer of layer ``l``
overlaps the compute of layer ``l + 1`` (:mod:`tandem.engine.kv.kv_connector`).
The first token is sampled here (that is the TTFT) and returned. The request's
blocks are freed once the transfer drained; its full blocks stay in the prefix
cache.

A plain class with async methods: Ray makes it an actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from tandem.control.worker_control import ControlConfig, start_worker_control
from tandem.engine.config import EngineConfig
from tandem.engine.runtime.engine_loop import EngineLoop
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.runtime.outputs import RequestDelta, StepOutput, WorkerRequest, WorkerStats
from tandem.engine.runtime.threads import apply_thread_settings
from tandem.engine.runtime.worker_common import (Fence, block_counts, model_info,
                                                  node_ip_address, pin_cpus)

logger = logging.getLogger(__name__)


class PrefillWorker:
    """Prefill worker around one :class:`LLMEngine`.

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
    """

    def __init__(self, worker_id: str, config: EngineConfig, cpus: list[int] | None = None,
                 kv_transport: str = "gloo", transfer_timeout_s: float = 60.0,
                 control: ControlConfig | None = None, weights_from: LLMEngine | None = None,
                 engine_nice: int = 0):
        self.worker_id, self.config = worker_id, config
        self.cpus = pin_cpus(cpus)
        apply_thread_settings(config)     # this actor is its process's entry point
        # Built on the loop's thread: see EngineLoop.build.
        self.loop = EngineLoop.build(lambda: LLMEngine(
            config, kv_transport=kv_transport, transfer_timeout_s=transfer_timeout_s,
            enable_kv_events=True, weights_from=weights_from), worker_id, "prefill",
            publish_deltas=False, nice=engine_nice)
        self.engine = self.loop.engine
        self._fence = Fence(worker_id)
        self.control = start_worker_control(control, worker_id, "prefill", self._static_info(),
                                            self._fence, self.loop)

    async def _call(self, fn, *args):
        return await asyncio.wrap_future(self.loop.call(fn, *args))

    async def info(self) -> dict:
        """Model and cache facts plus KV layout, node address, pid, cores and generation
        (its incarnation in the cluster state; 0 without one)."""
        return {**self._static_info(),
                "generation": self.control.generation if self.control is not None else 0}

    def _static_info(self) -> dict:
        return {**model_info(self.engine, self.config),
                "kv_layout": self.engine.kv_connector.layout(), "worker_id": self.worker_id,
                "role": "prefill", "pid": os.getpid(), "cpus": self.cpus,
                "node_ip": node_ip_address()}

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

    async def fence(self, reason: str) -> None:
        """Take no new prefills (e.g. this worker lost its lease): :meth:`prefill` raises
        :class:`WorkerFencedError` until :meth:`unfence`. Prefills already running
        finish."""
        self._fence.fence(reason)

    async def unfence(self) -> None:
        """Take new prefills again."""
        self._fence.unfence()

    async def prefill(self, request: WorkerRequest) -> RequestDelta:
        """Run the prompt, stream its KV to the ticket's decode worker, sample the
        first token.

        Returns:
            The first token's :class:`RequestDelta` (``finish_reason`` ``length``, or
            ``stop`` if that token already ends the request, e.g. EOS).

        Raises:
            KVTransferError: the transfer failed or timed out (blocks are freed).
            WorkerFencedError: this worker is fenced (:meth:`fence`).
        """
        from tandem.kvtransfer.base import KVTransferError

        self._fence.check()
        params = request.sampling_params
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

    async def abort(self, request_id: str) -> bool:
        def abort() -> bool:
            self.loop.untrack(request_id)
            return self.engine.abort_request(request_id)
        return await self._call(abort)

    async def poll(self, timeout_s: float = 1.0, subscriber: str = "") -> list[StepOutput]:
        """Stats and KV cache events since ``subscriber``'s (a router id's) last poll
        (no token deltas: the first token returns from :meth:`prefill`); waits up to
        ``timeout_s`` for the first. A router that stops polling has its prefills
        aborted."""
        return await asyncio.to_thread(self.loop.poll, timeout_s, subscriber)

    async def stats(self) -> WorkerStats:
        return await self._call(self.engine.stats, self.worker_id, "prefill")

    async def check_invariants(self) -> dict:
        """Run the engine's invariant checks; return block and queue counts and the KV
        bytes sent so far (tests)."""
        def check():
            return {**block_counts(self.engine),
                    "kv_transfer_bytes": self.engine.kv_connector.kv_transfer_bytes}
        return await self._call(check)

    async def shutdown(self) -> None:
        if self.control is not None:
            self.control.close()
        self.loop.shutdown()
        self.engine.kv_connector.close()
