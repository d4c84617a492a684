"""What both worker adapters share: one :class:`LLMEngine` on its loop thread behind a
Ray actor's async methods.

:class:`EngineWorker` pins the process, builds the engine on its loop's thread
(:meth:`EngineLoop.build`), and answers the methods every worker has the same way:
``info``, ``fence`` / ``unfence``, ``poll`` / ``open_output_stream``, ``stats``, ``abort``,
``check_invariants``, ``shutdown``. The role adapters
(:class:`~tandem.decode_worker.worker.DecodeWorker`,
:class:`~tandem.prefill_worker.worker.PrefillWorker`) add their own methods and
start their control-plane client (the engine layer does not import the control
plane). The router calls all of them through
:class:`~tandem.router.worker_client.WorkerClient`.

With ``config.tensor_parallel_size`` N > 1 a worker is a group of N ranks: rank 0
is the engine in this (the actor's) process, ranks 1.. its subprocesses
(:mod:`tandem.engine.parallel.group`; they inherit this process's CPU pinning).
The group lives and dies as one worker: a rank that dies makes rank 0's next
collective raise within moments, and then this process ends
(:meth:`EngineWorker._rank_lost`): the router sees the actor gone, moves its
requests as for any dead worker and the supervisor starts a new group. When
this process dies, the other ranks see their stdin pipe close and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from tandem.engine.config import EngineConfig
from tandem.engine.parallel.communicator import RankDiedError
from tandem.engine.runtime.engine_loop import EngineLoop
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.runtime.output_stream import OutputStreamServer
from tandem.engine.runtime.outputs import StepOutput, WorkerRequest, WorkerStats
from tandem.engine.runtime.threads import apply_thread_settings
from tandem.engine.runtime.worker_common import (Fence, block_counts, model_info,
                                                  node_ip_address, pin_cpus)
from tandem.engine.runtime.core_lending import CoreLendingConfig
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import sample_request_id

logger = logging.getLogger(__name__)


class EngineWorker:
    """The part of a worker that does not depend on its role.

    Args:
        worker_id: e.g. ``decode-0``.
        role: ``prefill``, ``decode`` or ``colocated``.
        config: the engine configuration.
        cpus: cores to pin this process to (None: leave as is).
        make_engine: builds the engine (called on the loop's thread).
        engine_nice: added to the nice value of the engine's threads (see
            :meth:`EngineLoop.build`).
        publish_deltas: whether the loop publishes token deltas to pollers (a
            prefill worker returns its one token by call instead).
        core_lending: this worker's slot on its machine's core board (see
            :mod:`~tandem.engine.runtime.core_lending`); None: a fixed thread pool.

    Attributes:
        control: the control-plane client the subclass starts (an object with
            ``generation`` and ``close()``), or None for a worker no cluster state
            knows (tests, GPU checks).
    """

    def __init__(self, worker_id: str, role: str, config: EngineConfig,
                 cpus: list[int] | None, make_engine: Callable[[], LLMEngine],
                 engine_nice: int = 0, publish_deltas: bool = True,
                 core_lending: CoreLendingConfig | None = None):
        self.worker_id, self.role, self.config = worker_id, role, config
        self.cpus = pin_cpus(cpus)
        apply_thread_settings(config)     # this actor is its process's entry point
        # Built on the loop's thread: see EngineLoop.build.
        self.loop = EngineLoop.build(make_engine, worker_id, role,
                                     publish_deltas=publish_deltas, nice=engine_nice,
                                     core_lending=core_lending,
                                     on_rank_lost=self._rank_lost)
        self.engine = self.loop.engine
        self._fence = Fence(worker_id)
        self.control: Any = None
        self._output_stream: OutputStreamServer | None = None
        # The event loop this actor's methods run on (the first open_output_stream
        # call's): where work a stream's reader thread starts must run.
        self._rpc_loop: asyncio.AbstractEventLoop | None = None

    def _rank_lost(self, exc: RankDiedError) -> None:
        """A rank of this worker's tensor-parallel group died: end the whole worker.

        Runs on the engine loop's thread, instead of finishing the requests with
        ``error``: they are not at fault and resume on another worker (the router
        migrates them from its request journal when it sees this actor die). The
        lease is dropped first, so every router sees the worker dead at once
        rather than after its TTL; then the process exits with status 1, which
        closes the other ranks' stdin pipes (they exit too).
        """
        logger.error("%s: %s; ending the worker (its tensor-parallel group is broken)",
                     self.worker_id, exc)
        control = self.control
        if control is not None:
            try:
                control.lease.stop(deregister=False)
                control.state.mark_suspect(self.worker_id, control.generation)
            except Exception as err:     # Redis away: the lease lapses within its TTL
                logger.warning("%s: could not drop the lease: %s", self.worker_id, err)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    async def _call(self, fn, *args):
        """``fn(*args)`` on the engine loop's thread (between steps)."""
        return await asyncio.wrap_future(self.loop.call(fn, *args))

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs``' grammar on a thread of its own (no-op
        without one), so the engine loop keeps stepping while it compiles and the
        request's ``add_request`` then finds it in the cache.

        Raises:
            InvalidParameterError: it does not compile, or not within
                :data:`~tandem.engine.sampling.grammar.COMPILE_TIMEOUT_S`
                (``field`` ``structured_outputs.<kind>``).
        """
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.structured_outputs.compile,
                                    params.structured_outputs)

    # -- control plane ------------------------------------------------------------------------
    async def info(self) -> dict:
        """Model and cache facts (model_name, max_model_len, block_size, dtype, ...)
        plus this worker's KV layout (None without a KV connector), node address,
        pid, cores, ``tensor_parallel_size`` and ``rank_pids`` (the process ids of
        its ranks 1..; empty with one rank), generation (its incarnation in
        the cluster state; 0 without one) and ``output_streams`` (routers that
        read its outputs on an output stream now)."""
        streams = self._output_stream
        return {**self._static_info(),
                "generation": self.control.generation if self.control is not None else 0,
                "output_streams": streams.num_streams if streams is not None else 0}

    def _static_info(self) -> dict:
        connector = self.engine.kv_connector
        return {**model_info(self.engine, self.config), "worker_id": self.worker_id,
                "role": self.role, "pid": os.getpid(), "cpus": self.cpus,
                "node_ip": node_ip_address(),
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "rank_pids": self.engine.parallel.worker_pids
                if self.engine.parallel is not None else [],
                "kv_layout": connector.layout() if connector is not None else None}

    async def fence(self, reason: str) -> None:
        """Take no new requests (e.g. this worker lost its lease): adding one raises
        :class:`~tandem.engine.runtime.worker_common.WorkerFencedError` until
        :meth:`unfence`. Requests it already has keep running."""
        self._fence.fence(reason)

    async def unfence(self) -> None:
        """Take new requests again."""
        self._fence.unfence()

    # -- requests ------------------------------------------------------------------------------
    async def abort(self, request_id: str, sample_index: int = 0) -> bool:
        """Stop sample ``sample_index`` of a request wherever it is (waiting, reserved,
        running, being prefilled; sample 0 with the samples not yet forked from it);
        frees its blocks. Returns whether the engine had it."""
        engine_id = sample_request_id(request_id, sample_index)

        def abort() -> bool:
            self.loop.untrack(engine_id)
            return self.engine.abort_request(engine_id)
        return await self._call(abort)

    # -- outputs and stats ---------------------------------------------------------------------
    async def poll(self, timeout_s: float = 1.0, subscriber: str = "") -> list[StepOutput]:
        """Step outputs since ``subscriber``'s (a router id's) last poll: the token
        deltas of its requests (none on a prefill worker: the first token returns
        by call), every step's stats and KV events; waits up to ``timeout_s``
        seconds for the first. A router that stops polling for the loop's
        subscriber timeout has its requests aborted (see :meth:`EngineLoop.poll`)."""
        return await asyncio.to_thread(self.loop.poll, timeout_s, subscriber)

    async def open_output_stream(self, subscriber: str) -> dict:
        """A one-time rendezvous (``host``, ``port``, ``token``) for a connection on
        which this worker pushes ``subscriber``'s step outputs as :meth:`poll` would
        return them (:mod:`~tandem.engine.runtime.output_stream`; the listener starts
        on the first call).

        Raises:
            RuntimeError: the engine loop failed (as :meth:`poll` does).
        """
        if self.loop.error is not None:
            raise RuntimeError(f"{self.worker_id} engine failed: {self.loop.error}")
        if self._output_stream is None:
            self._rpc_loop = asyncio.get_running_loop()
            self._output_stream = OutputStreamServer(self.loop.poll, node_ip_address(),
                                                     unread=self.loop.unread,
                                                     on_request=self._request_from_stream())
        return self._output_stream.open(subscriber)

    def _request_from_stream(self) -> Callable[[str, WorkerRequest], None] | None:
        """What takes the requests routers send on their output streams instead of
        ``add_request`` or ``prefill`` (``on_request`` of
        :class:`~tandem.engine.runtime.output_stream.OutputStreamServer`); None for a
        role that adds none that way."""
        return None

    async def stats(self) -> WorkerStats:
        return await self._call(self.engine.stats, self.worker_id, self.role)

    async def check_invariants(self) -> dict:
        """Run the engine's invariant checks; return block and queue counts plus the
        role's own counters (:meth:`_invariant_extras`; tests)."""
        return await self._call(lambda: {**block_counts(self.engine),
                                         **self._invariant_extras()})

    def _invariant_extras(self) -> dict:
        return {}

    async def shutdown(self) -> None:
        """Stop the control-plane client, the engine loop, the KV connector and the
        tensor-parallel ranks 1.. (if any)."""
        if self.control is not None:
            self.control.close()
        if self._output_stream is not None:
            self._output_stream.close()
        self.loop.shutdown()
        if self.engine.kv_connector is not None:
            self.engine.kv_connector.close()
        await asyncio.to_thread(self.engine.shutdown)
