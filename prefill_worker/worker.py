"""The prefill worker: runs prompts and streams their KV, layer by layer, to decode workers.

Prompts are batched under the engine's token budget (chunked prefill); prefix
blocks this worker already caches are not computed again. In the step that
computes a request's last prompt chunk, every layer's KV blocks (those the decode
side does not already hold) are handed to the KV sender as soon as the layer is
done, so the transfer of layer ``l`` overlaps the compute of layer ``l + 1``.
The first token is sampled here (that is the TTFT) and returned. The request's
blocks are freed once the transfer is acknowledged; its full blocks stay in the
prefix cache.

A plain class with async methods: Ray makes it an actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Future

from tandem.engine.config import EngineConfig
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestDelta, WorkerStats
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.threads import apply_thread_settings
from tandem.engine.worker_common import block_counts, kv_layout_of, model_info, pin_cpus

logger = logging.getLogger(__name__)


class PrefillLoop(EngineLoop):
    """Engine loop whose step sends finished prompts' KV while the layers compute."""

    def __init__(self, engine: LLMEngine, worker_id: str, transfer_timeout_s: float):
        super().__init__(engine, worker_id, "prefill")
        self.transfer_timeout_s = transfer_timeout_s
        self.pending: dict[str, tuple[object, object, Future]] = {}   # rid -> (ticket, sender, result)
        self.kv_transfer_bytes = 0

    def step(self) -> None:
        eng = self.engine
        out = eng.scheduler.schedule()
        if out.is_empty:
            return
        kv = eng.kv_cache_manager
        sending = []
        for s in out.scheduled:
            rid = s.request.request_id
            if s.samples and rid in self.pending:
                ticket, sender, _ = self.pending[rid]
                src = kv.get_block_ids(rid)
                sending.append((rid, ticket, sender, [src[i] for i in ticket.sent_block_indices()]))
        failed: dict[str, BaseException] = {}

        def after_layer(layer: int) -> None:
            for rid, ticket, sender, src in sending:
                if rid in failed:
                    continue
                try:
                    sender.send_layer(ticket, layer, src, eng.kv_cache.tensor)
                except Exception as exc:
                    failed[rid] = exc

        sampled = eng.runner.execute(out, after_layer if sending else None)
        for rid, ticket, sender, _ in sending:
            # finish() even after a failed send_layer: it releases the ticket's buffers.
            try:
                sender.finish(ticket, self.transfer_timeout_s)
                if rid not in failed:
                    self.kv_transfer_bytes += ticket.bytes_per_layer * ticket.layout.num_layers
            except Exception as exc:
                failed.setdefault(rid, exc)
        for r in eng.scheduler.update(out, sampled):
            if r.is_finished:
                eng.runner.sampler.free(r.request_id)
            self._resolve(r, failed.get(r.request_id))

    def _fail_all(self, exc: BaseException) -> None:
        super()._fail_all(exc)
        for _, _, fut in self.pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"prefill worker {self.worker_id} failed: {exc}"))
        self.pending.clear()

    def _resolve(self, r: Request, error: BaseException | None) -> None:
        entry = self.pending.pop(r.request_id, None)
        if entry is None:
            return
        fut = entry[2]
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(self.delta(r))


class PrefillWorker:
    """Prefill worker around one :class:`LLMEngine`.

    Args:
        worker_id: e.g. ``prefill-0``.
        config: engine configuration; its KV layout must equal the decode workers'.
        cpus: cores to pin this process to (None: leave as is).
        kv_transport: transport config string (``gloo``, ``nccl``).
        transfer_timeout_s: seconds to wait for a transfer to drain.
    """

    def __init__(self, worker_id: str, config: EngineConfig, cpus: list[int] | None = None,
                 kv_transport: str = "gloo", transfer_timeout_s: float = 60.0):
        self.worker_id, self.config = worker_id, config
        self.cpus = pin_cpus(cpus)
        apply_thread_settings(config)     # this actor is its process's entry point
        self.engine = LLMEngine(config)
        self.loop = PrefillLoop(self.engine, worker_id, transfer_timeout_s).start()
        self.kv_transport = kv_transport
        self._senders: dict[str, object] = {}

    async def info(self) -> dict:
        import os

        return {**model_info(self.engine, self.config), "kv_layout": kv_layout_of(self.engine),
                "worker_id": self.worker_id, "role": "prefill", "pid": os.getpid(),
                "cpus": self.cpus}

    async def connect_kv(self, peer_id: str, rendezvous: dict, decode_layout: dict) -> None:
        """Join decode worker ``peer_id``'s KV channel.

        Raises:
            KVLayoutMismatchError: the two caches disagree (block size, dtype, heads,
                ...); the message names each field with both values.
        """
        from tandem.kvtransfer.base import get_transport
        from tandem.kvtransfer.layout import KVLayout, check_compatible

        check_compatible(KVLayout.from_dict(kv_layout_of(self.engine)),
                         KVLayout.from_dict(decode_layout))
        sender = await asyncio.to_thread(get_transport(self.kv_transport).sender.connect,
                                         rendezvous)
        old = self._senders.pop(peer_id, None)
        if old is not None:
            old.close()
        self._senders[peer_id] = sender

    async def close_kv_channel(self, peer_id: str) -> bool:
        """Close the pair to decode worker ``peer_id`` (e.g. before re-creating a broken
        one). Requests for that peer then fail with ``KVTransferError`` until
        :meth:`connect_kv` runs again. Returns whether there was a pair."""
        sender = self._senders.pop(peer_id, None)
        if sender is not None:
            await asyncio.to_thread(sender.close)
        return sender is not None

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      ticket: dict, peer_id: str, priority: int = 0) -> RequestDelta:
        """Run the prompt, stream its KV to ``peer_id``, sample the first token.

        Returns:
            The first token's :class:`RequestDelta` (``finish_reason`` set if that
            token already ends the request, e.g. EOS).

        Raises:
            KVLayoutMismatchError: the ticket's layout is not this worker's.
            KVTransferError: the transfer failed or timed out (blocks are freed).
        """
        from tandem.kvtransfer.layout import KVLayout, KVTransferTicket, check_compatible

        from tandem.kvtransfer.base import KVTransferError

        t = KVTransferTicket.from_dict(ticket)
        check_compatible(KVLayout.from_dict(kv_layout_of(self.engine)), t.layout)
        sender = self._senders.get(peer_id)
        if sender is None:
            raise KVTransferError(f"{self.worker_id}: no KV channel to {peer_id}")
        first = dataclasses.replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                    stop=())
        fut: Future = Future()

        def add() -> None:
            self.engine.add_request(list(prompt_token_ids), first, request_id, priority)
            self.loop.pending[request_id] = (t, sender, fut)

        await asyncio.wrap_future(self.loop.call(add))
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> bool:
        def abort() -> bool:
            entry = self.loop.pending.pop(request_id, None)
            if entry is not None and not entry[2].done():
                entry[2].cancel()
            return self.engine.abort_request(request_id)
        return await asyncio.wrap_future(self.loop.call(abort))

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(
            lambda: self.engine.stats(self.worker_id, "prefill")))

    async def check_invariants(self) -> dict:
        """Run the engine's invariant checks; return block and queue counts and the KV
        bytes sent so far (tests)."""
        def check():
            return {**block_counts(self.engine), "kv_transfer_bytes": self.loop.kv_transfer_bytes}
        return await asyncio.wrap_future(self.loop.call(check))

    async def shutdown(self) -> None:
        self.loop.shutdown()
        for s in self._senders.values():
            s.close()
