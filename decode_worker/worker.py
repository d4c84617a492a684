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
from tandem.engine.threads import apply_thread_settings
from tandem.engine.worker_common import block_counts, kv_layout_of, model_info, pin_cpus

logger = logging.getLogger(__name__)


class NoRoomError(RuntimeError):
    """The KV pool could not fit the prompt before the reservation timeout."""


class RequestAbortedError(RuntimeError):
    """The request was aborted while a call for it was on its way."""


class _Tombstones:
    """Ids of requests aborted before they arrived; bounded, oldest forgotten first."""

    def __init__(self, capacity: int = 100_000):
        self._ids: dict[str, None] = {}
        self.capacity = capacity

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        if len(self._ids) > self.capacity:
            del self._ids[next(iter(self._ids))]

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids


@dataclass
class _Transfer:
    """A reservation. Its fields change only on the engine loop thread."""

    ticket: object
    peer_id: str
    landed: Future = field(default_factory=Future)   # result None, or the transfer's error
    outcome_known: bool = False
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
        apply_thread_settings(config)     # this actor is its process's entry point
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(self.engine, worker_id, role).start()
        self.kv_transport = kv_transport
        self.transfer_timeout_s = transfer_timeout_s
        self.reserve_timeout_s = reserve_timeout_s
        self._receivers: dict[str, object] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._transfer_ids = itertools.count()
        self._tombstones = _Tombstones()

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
        layout = KVLayout.from_cache(self.engine.kv_cache.tensor)
        prompt = list(prompt_token_ids)

        def try_reserve() -> dict | None:
            # On the loop thread: an abort that overtook this call leaves a tombstone.
            if request_id in self._tombstones:
                self._tombstones.discard(request_id)
                raise RequestAbortedError(f"{request_id} was aborted before its reservation")
            got = self.engine.reserve(request_id, prompt)
            if got is None:
                return None
            ticket = KVTransferTicket(request_id, next(self._transfer_ids), tuple(got[0]),
                                      got[1], len(prompt), layout)
            transfer = _Transfer(ticket, peer_id)
            self._transfers[request_id] = transfer
            threading.Thread(target=self._receive, args=(receiver, transfer), daemon=True,
                             name=f"kv-recv-{request_id}").start()
            return ticket.to_dict()

        deadline = time.monotonic() + self.reserve_timeout_s
        delay = 0.005
        while True:
            ticket = await asyncio.wrap_future(self.loop.call(try_reserve))
            if ticket is not None:
                return ticket
            if time.monotonic() > deadline:
                raise NoRoomError(f"{self.worker_id}: no KV room for {len(prompt)} "
                                  f"prompt tokens within {self.reserve_timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _receive(self, receiver, transfer: _Transfer) -> None:
        """Receive thread: land every layer, then report the outcome to the loop thread."""
        error = None
        try:
            receiver.receive(transfer.ticket, self.engine.kv_cache.tensor, self.transfer_timeout_s)
        except Exception as exc:   # KVTransferError and friends: the request falls back
            logger.warning("KV transfer for %s failed: %s", transfer.ticket.request_id, exc)
            error = exc
        self.loop.call(self._landed, transfer, error)

    def _landed(self, transfer: _Transfer, error: BaseException | None) -> None:
        transfer.outcome_known = True
        if transfer.released:   # released while layers could still land: free only now
            self.engine.release(transfer.ticket.request_id)
        if error is None:
            transfer.landed.set_result(None)
        else:
            transfer.landed.set_exception(error)

    async def start_decode(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, first_token_id: int,
                           first_logprobs: TokenLogprobs | None = None, priority: int = 0,
                           num_cached_tokens: int = 0) -> bool:
        """Admit a prefilled request once all its layers landed.

        Returns:
            True if it decodes from the transferred KV; False if the transfer failed
            and the request is prefilled again here (recompute) instead.
        """
        transfer = self._transfers.get(request_id)
        if transfer is None:
            raise RequestAbortedError(f"{request_id}: no reservation (aborted?)")
        req = Request(request_id, list(prompt_token_ids), params,
                      eos_token_id=self.engine.tokenizer.eos_token_id, priority=priority)
        req.output_token_ids.append(first_token_id)
        if first_logprobs is not None:
            req.output_logprobs.append(first_logprobs)
        req.num_cached_tokens = num_cached_tokens
        try:
            await asyncio.wrap_future(transfer.landed)
            ok = True
        except Exception:
            ok = False
        return await asyncio.wrap_future(self.loop.call(self._admit, transfer, req, ok))

    def _admit(self, transfer: _Transfer, req: Request, landed_ok: bool) -> bool:
        """Loop thread: decode from the landed KV, or (transfer failed) prefill here."""
        rid = req.request_id
        if self._transfers.get(rid) is not transfer or transfer.released:
            raise RequestAbortedError(f"{rid} was aborted before it started decoding")
        del self._transfers[rid]
        if landed_ok:
            self.engine.add_prefilled_request(req)
        else:
            self.engine.release(rid)
            self.engine.runner.sampler.skip_first_draw(req, self.engine.model_config.vocab_size)
            self.engine.scheduler.add_request(req)
        self.loop.mark_published(rid, 1)
        return landed_ok

    async def release(self, request_id: str) -> bool:
        """Drop a reservation (the request ends without decoding here). Returns
        whether there was one."""
        return await asyncio.wrap_future(self.loop.call(self._release, request_id))

    def _release(self, request_id: str) -> bool:
        transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return False
        transfer.released = True
        if transfer.outcome_known:
            self.engine.release(request_id)
        else:
            # Layers may still land in these blocks: free them when the receive ends.
            self._receivers[transfer.peer_id].discard(transfer.ticket.transfer_id)
        return True

    # -- colocated / local requests ------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, priority: int = 0) -> None:
        """Prefill and decode a request here (colocated mode, n > 1, or a fallback)."""
        def add() -> None:
            if request_id in self._tombstones:     # aborted while this call was on its way
                self._tombstones.discard(request_id)
                raise RequestAbortedError(f"{request_id} was aborted before it was added")
            self.engine.add_request(list(prompt_token_ids), params, request_id, priority)

        await asyncio.wrap_future(self.loop.call(add))

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (reserved, waiting, running); frees its blocks.

        An abort that arrives before the request does leaves a tombstone, so a
        reservation racing with it is freed as soon as it is made.
        """
        return await asyncio.wrap_future(self.loop.call(self._abort, request_id))

    def _abort(self, request_id: str) -> bool:
        if self._release(request_id) or self.engine.abort_request(request_id):
            return True
        self._tombstones.add(request_id)
        return False

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
        """Run the engine's invariant checks; return block and queue counts (tests)."""
        def check():
            return {**block_counts(self.engine), "num_reserved": len(self._transfers)}
        return await asyncio.wrap_future(self.loop.call(check))

    async def shutdown(self) -> None:
        self.loop.shutdown()
        for r in self._receivers.values():
            r.close()
