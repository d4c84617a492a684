"""The decode worker: receives prompt KV into its paged cache and runs continuous batching.

Also the colocated worker (``role="colocated"``): the same engine prefills its own
requests (chunked prefill mixed into decode batches), which is both the
single-device deployment and the baseline disaggregation is measured against.

A plain class with async methods: Ray makes it an actor
(``ray.remote(DecodeWorker)``), tests and GPU checks can drive it directly.

Per disaggregated request::

    reserve()       blocks for the prompt (prefix-cache hits reused); returns a
                    KVTransferTicket and starts receiving its layers at once
    start_decode()  once the prefill returned the first token: waits for the
                    last layer, then the request joins the running batch
    release()       the request ended before decoding (error, first token was
                    final): its reservation is freed once no layer can land
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tandem.engine.config import EngineConfig
from tandem.engine.engine_loop import EngineLoop
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import StepOutput, WorkerStats
from tandem.engine.request import Request, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_common import kv_layout_of, model_info, pin_cpus

logger = logging.getLogger(__name__)


class NoRoomError(RuntimeError):
    """The KV pool could not fit the prompt before the reservation timeout."""


@dataclass
class _Transfer:
    ticket: object
    peer_id: str
    landed: Future = field(default_factory=Future)   # result None, or the KVTransferError
    released: bool = False


class DecodeWorker:
    """Decode (or colocated) worker around one :class:`LLMEngine`.

    Args:
        worker_id: e.g. ``decode-0``.
        config: engine configuration (model, dtype, KV cache, scheduler).
        role: ``decode`` or ``colocated``.
        cpus: cores to pin this process to (None: leave as is).
        kv_transport: transport config string (``gloo``, ``nccl``).
        transfer_timeout_s: how long a reserved request may wait for its KV (seconds).
        reserve_timeout_s: how long a reservation may wait for free blocks (seconds).
    """

    def __init__(self, worker_id: str, config: EngineConfig, role: str = "decode",
                 cpus: list[int] | None = None, kv_transport: str = "gloo",
                 transfer_timeout_s: float = 60.0, reserve_timeout_s: float = 120.0):
        self.worker_id, self.role, self.config = worker_id, role, config
        self.cpus = pin_cpus(cpus)
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(self.engine, worker_id, role).start()
        self.kv_transport = kv_transport
        self.transfer_timeout_s = transfer_timeout_s
        self.reserve_timeout_s = reserve_timeout_s
        self._receivers: dict[str, object] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._transfer_ids = itertools.count()
        self._lock = threading.Lock()

    # -- control plane ------------------------------------------------------------------------
    async def info(self) -> dict:
        """Model and cache facts (model_name, max_model_len, block_size, dtype, ...)
        plus this worker's KV layout, pid and cores."""
        import os

        return {**model_info(self.engine, self.config), "kv_layout": kv_layout_of(self.engine),
                "worker_id": self.worker_id, "role": self.role, "pid": os.getpid(),
                "cpus": self.cpus}

    async def open_kv_channel(self, peer_id: str) -> dict:
        """Listen for prefill worker ``peer_id``'s KV; returns the rendezvous to hand it."""
        from tandem.kvtransfer.base import get_transport

        receiver = get_transport(self.kv_transport).receiver.listen("127.0.0.1")
        old = self._receivers.pop(peer_id, None)
        if old is not None:
            old.close()
        self._receivers[peer_id] = receiver
        return receiver.rendezvous

    async def reserve(self, request_id: str, prompt_token_ids: list[int], peer_id: str) -> dict:
        """Reserve blocks for a prompt that prefill worker ``peer_id`` will compute.

        Returns:
            ``KVTransferTicket.to_dict()``; its layers start landing at once.

        Raises:
            NoRoomError: no room within ``reserve_timeout_s``.
            KeyError: no KV channel to ``peer_id``.
        """
        from tandem.kvtransfer.layout import KVLayout, KVTransferTicket

        receiver = self._receivers[peer_id]
        deadline = time.monotonic() + self.reserve_timeout_s
        delay = 0.005
        while True:
            got = await asyncio.wrap_future(self.loop.call(self.engine.reserve, request_id,
                                                           list(prompt_token_ids)))
            if got is not None:
                break
            if time.monotonic() > deadline:
                raise NoRoomError(f"{self.worker_id}: no KV room for {len(prompt_token_ids)} "
                                  f"prompt tokens within {self.reserve_timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        block_ids, num_cached = got
        ticket = KVTransferTicket(request_id, next(self._transfer_ids), tuple(block_ids),
                                  num_cached, len(prompt_token_ids),
                                  KVLayout.from_cache(self.engine.kv_cache.tensor))
        transfer = _Transfer(ticket, peer_id)
        self._transfers[request_id] = transfer
        threading.Thread(target=self._receive, args=(receiver, transfer), daemon=True,
                         name=f"kv-recv-{request_id}").start()
        return ticket.to_dict()

    def _receive(self, receiver, transfer: _Transfer) -> None:
        try:
            receiver.receive(transfer.ticket, self.engine.kv_cache.tensor, self.transfer_timeout_s)
            transfer.landed.set_result(None)
        except Exception as exc:   # KVTransferError and friends: the request falls back
            logger.warning("KV transfer for %s failed: %s", transfer.ticket.request_id, exc)
            transfer.landed.set_exception(exc)
        with self._lock:
            release = transfer.released
        if release:   # released while layers could still land: free the blocks only now
            self._free_reservation(transfer.ticket.request_id)

    async def start_decode(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, first_token_id: int,
                           first_logprobs: TokenLogprobs | None = None, priority: int = 0,
                           num_cached_tokens: int = 0) -> bool:
        """Admit a prefilled request once all its layers landed.

        Returns:
            True if it decodes from the transferred KV; False if the transfer failed
            and the request is prefilled again here (recompute) instead.
        """
        transfer = self._transfers.pop(request_id)
        req = Request(request_id, list(prompt_token_ids), params,
                      eos_token_id=self.engine.tokenizer.eos_token_id, priority=priority)
        req.output_token_ids.append(first_token_id)
        if first_logprobs is not None:
            req.output_logprobs.append(first_logprobs)
        req.num_cached_tokens = num_cached_tokens
        try:
            await asyncio.wrap_future(transfer.landed)
        except Exception:
            await asyncio.wrap_future(self.loop.call(self._requeue, req))
            return False
        await asyncio.wrap_future(self.loop.call(self._admit, req))
        return True

    def _admit(self, req: Request) -> None:
        self.engine.add_prefilled_request(req)
        self.loop.mark_published(req.request_id, 1)

    def _requeue(self, req: Request) -> None:
        """Transfer failed: free the reservation and prefill prompt + first token here."""
        from tandem.engine.sampler import skip_first_draw

        self.engine.release(req.request_id)
        skip_first_draw(req, self.engine.model_config.vocab_size)
        self.engine.scheduler.add_request(req)
        self.loop.mark_published(req.request_id, 1)

    async def release(self, request_id: str) -> None:
        """Drop a reservation (the request ends without decoding here)."""
        transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return
        with self._lock:
            landed = transfer.landed.done()
            transfer.released = True
        if landed:
            await asyncio.wrap_future(self.loop.call(self.engine.release, request_id))
        else:
            # Layers may still land in these blocks: let the receive end first.
            self._receivers[transfer.peer_id].discard(transfer.ticket.transfer_id)

    def _free_reservation(self, request_id: str) -> None:
        self.loop.call(self.engine.release, request_id)

    # -- colocated / local requests ------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, priority: int = 0) -> None:
        """Prefill and decode a request here (colocated mode, n > 1, or a fallback)."""
        await asyncio.wrap_future(self.loop.call(self.engine.add_request, list(prompt_token_ids),
                                                 params, request_id, priority))

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (running, waiting, reserved); frees its blocks."""
        if request_id in self._transfers:
            await self.release(request_id)
            return True
        return await asyncio.wrap_future(self.loop.call(self.engine.abort_request, request_id))

    # -- outputs and stats ---------------------------------------------------------------------
    async def poll(self, timeout_s: float = 1.0) -> list[StepOutput]:
        """Step outputs since the last poll (waits up to ``timeout_s`` for the first)."""
        import queue

        if self.loop.error is not None:
            raise RuntimeError(f"{self.worker_id} engine failed: {self.loop.error}")
        out: list[StepOutput] = []
        try:
            out.append(await asyncio.to_thread(self.loop.outbox.get, True, timeout_s))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.loop.outbox.get_nowait())
            except queue.Empty:
                return out

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.loop.call(self._stats))

    def _stats(self) -> WorkerStats:
        return self.engine.stats(self.worker_id, self.role)

    async def check_invariants(self) -> dict:
        """Run the KV cache manager's invariant check; return block counts (tests)."""
        def check():
            kv = self.engine.kv_cache_manager
            kv.check_invariants()
            return {"num_blocks": kv.num_blocks, "num_free_blocks": kv.num_free_blocks,
                    "num_cached_blocks": kv.block_pool.num_cached_blocks,
                    "num_running": self.engine.scheduler.num_running,
                    "num_waiting": self.engine.scheduler.num_waiting,
                    "num_reserved": len(self._transfers),
                    "num_preemptions": self.engine.num_preemptions}
        return await asyncio.wrap_future(self.loop.call(check))

    async def shutdown(self) -> None:
        self.loop.shutdown()
        for r in self._receivers.values():
            r.close()
