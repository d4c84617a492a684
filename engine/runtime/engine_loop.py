"""An engine driven by its own thread, talked to through a command queue.

Every change to the engine's state (adding, reserving, aborting requests) runs
on the loop thread between steps, so the scheduler and the KV cache manager are
never touched by two threads at once and need no locks. Callers on other threads
(a Ray actor's event loop) get a ``concurrent.futures.Future`` for each command.

Each step's token deltas go out as one
:class:`~tandem.engine.runtime.outputs.StepOutput` per subscriber (router), with the
stats and the KV cache events of the step: a request's deltas only to the router
that added it, stats and events to all (:mod:`tandem.engine.runtime.subscribers`;
a prefill worker's carry no deltas: it reads results through
:meth:`EngineLoop.track`). A router that stops polling has its requests aborted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from tandem.engine.parallel.communicator import RankDiedError
from tandem.engine.runtime.core_lending import CoreLending, CoreLendingConfig
from tandem.engine.runtime.llm_engine import LLMEngine
from tandem.engine.runtime.outputs import RequestDelta, StepOutput
from tandem.engine.runtime.subscribers import DEFAULT, Subscribers
from tandem.engine.scheduling.request import Request

logger = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``engine`` in a daemon thread until :meth:`shutdown`.

    Args:
        engine: the engine; only the loop thread uses it after :meth:`start`.
        worker_id, role: reported in stats.
        idle_wait_s: how long an idle loop sleeps before looking again (seconds;
            any command, and any KV load that ends, wakes it at once).
        publish_deltas: put the requests' token deltas in the :class:`StepOutput` s
            that :meth:`poll` returns (False: they carry only stats and KV events,
            and results go to :meth:`track` futures, as on a prefill worker).
        subscriber_timeout_s: seconds a subscriber may go without polling before it
            is dropped and its requests aborted (local monotonic clock).
        on_rank_lost: called on the loop thread when a step fails because a rank of
            the engine's tensor-parallel group died (or, while idle, the loop finds
            one dead: it looks every ``idle_wait_s``)
            (:class:`~tandem.engine.parallel.communicator.RankDiedError`), instead of
            finishing the requests with ``error``: the failure is the worker's, not
            the requests', so a serving worker ends its process there and its
            requests resume on another (the router migrates them). None, or a
            callback that returns: the requests end with ``error`` as after any
            other failure.
        core_lending: this worker's slot on its machine's core board
            (:mod:`~tandem.engine.runtime.core_lending`): before each step the loop
            sizes torch's thread pool to its share of the cores plus its idle
            peers', and a step on borrowed cores gives them back after the layer
            in which a peer claims its share. Build the loop on the thread that
            will run it (:meth:`build`): the thread count is that thread's. None:
            the pool keeps its size.
    """

    def __init__(self, engine: LLMEngine, worker_id: str, role: str, idle_wait_s: float = 0.5,
                 publish_deltas: bool = True, subscriber_timeout_s: float = 15.0,
                 on_rank_lost: Callable[[RankDiedError], None] | None = None,
                 core_lending: CoreLendingConfig | None = None):
        self.engine = engine
        self.core_lending = CoreLending(core_lending) if core_lending is not None else None
        self.worker_id, self.role = worker_id, role
        self.idle_wait_s = idle_wait_s
        self.subscribers = Subscribers(subscriber_timeout_s)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._published: dict[str, int] = {}       # request id -> output tokens already sent
        # A remote prefill's first token that came on the KV channel reached the
        # client from the prefill worker (through the router): not published again.
        engine.on_remote_first_token = lambda rid: self.mark_published(rid, 1)
        self._tracked: dict[str, Future] = {}      # request id -> future of its final delta
        self.publish_deltas = publish_deltas
        self.on_rank_lost = on_rank_lost
        if engine.kv_connector is not None:
            engine.kv_connector.notify = self._wake.set
        self._thread: threading.Thread | None = None   # set by start() or build()
        self.error: BaseException | None = None
        self._last_stats = None
        self.kv_event_sink: Callable[[tuple], None] | None = None
        """Also called with each step's KV cache events, on the loop thread (e.g. to
        append them to the cluster state's stream); must not raise."""

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.worker_id}",
                                        daemon=True)
        self._thread.start()
        return self

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine], worker_id: str, role: str,
              nice: int = 0, **kwargs: Any) -> "EngineLoop":
        """Build the engine on the loop's own thread with ``make_engine()``, then run
        the loop there (started); returns once the engine is built.

        Why: torch's CPU kernels parallelise with OpenMP (libgomp), which keeps a
        thread team per thread that starts parallel work. With more such threads
        in a process than cores (the main thread that loaded the weights, plus the
        loop thread), libgomp cuts its team's spin-waiting to almost nothing, and
        every parallel region of a step then pays a futex wake-up: a decode step
        of the default model took ~1.4x as long (bfloat16, 2 cores;
        benchmarks/README.md, "Serving overhead"). So every torch call of a worker's
        engine, from weight loading on, runs on one thread.

        The loop thread, and the OpenMP threads it starts (they inherit it), can
        run at a lower priority than the process's other threads: ``nice`` > 0
        (Linux per-thread nice; raising it needs no privilege). On a machine with
        no core to spare, the engine's threads spin-wait between parallel
        regions; then the threads that deliver its outputs (the worker's RPC
        threads, the router) must win when they wake, or the client sees tokens
        in bursts behind stalls.

        Args:
            nice: added to the loop thread's nice value (0: unchanged).
            kwargs: as for the constructor.

        Raises:
            whatever ``make_engine`` raised.
        """
        built = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            if nice:
                tid = threading.get_native_id()
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
                except OSError as exc:       # not Linux-like: priorities stay as they are
                    logger.warning("engine loop %s: cannot renice its thread: %s", worker_id, exc)
            try:
                loop = box["loop"] = cls(make_engine(), worker_id, role, **kwargs)
            except BaseException as exc:   # re-raised in the caller's thread
                box["error"] = exc
                built.set()
                return
            loop._thread = threading.current_thread()
            built.set()
            loop._run()

        threading.Thread(target=run, name=f"engine-{worker_id}", daemon=True).start()
        built.wait()
        if "error" in box:
            raise box["error"]
        return box["loop"]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the loop thread before the next step (``fn`` is
        usually an engine method)."""
        fut: Future = Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"engine loop {self.worker_id} failed: {self.error}"))
            return fut
        self._commands.put((fn, args, fut))
        self._wake.set()
        return fut

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        lending = self.core_lending
        runner = self.engine.runner
        try:
            while not self._stop.is_set():
                self._drain_commands()
                self._drop_silent_subscribers()
                if self.engine.has_unfinished_requests():
                    if lending is not None:
                        # Busy only with something to compute: a decode worker that
                        # waits for its prompts' KV (or only reserves blocks for it)
                        # lends its cores to their prefill.
                        sch = self.engine.scheduler
                        if (sch.running or sch.swapped
                                or any(not r.needs_remote_kv for r in sch.waiting)):
                            lending.busy()
                        else:
                            lending.idle()
                        # On borrowed cores, give them back after the layer in which
                        # a peer claims its share, not at the end of the step.
                        runner.between_layers = lending.give_back if lending.borrowing else None
                    if not self.step():
                        # Only remote KV loads pending: wait for one to end (or a command).
                        if lending is not None:
                            lending.idle()
                        self._wake.wait(self.idle_wait_s)
                        self._wake.clear()
                else:
                    if lending is not None:
                        lending.idle()
                    if self.engine.parallel is not None:
                        # No step finds a dead rank while idle: look (raises RankDiedError).
                        self.engine.parallel.check_workers()
                    self._publish_idle_stats()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # the worker reports it; the thread must not die silently
            if isinstance(exc, RankDiedError) and self.on_rank_lost is not None:
                # The designed path for a lost rank: no traceback, the worker ends.
                logger.warning("engine loop %s: %s; ending the worker (its requests "
                               "resume elsewhere)", self.worker_id, exc)
                self.on_rank_lost(exc)
            else:
                logger.exception("engine loop %s failed", self.worker_id)
            self.error = exc
            self._fail_all(exc)
        finally:
            if lending is not None:         # a loop that ended lends its cores
                lending.close()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

    def _drop_silent_subscribers(self) -> None:
        """A router that stopped polling is gone: abort its requests (frees their blocks)."""
        subs, requests = self.subscribers, self.engine.scheduler.requests
        beams = self.engine.beam_search
        if subs.num_owned > len(requests):
            subs.prune(lambda rid: rid in requests or beams.is_result_id(rid))
        for name, request_ids in subs.drop_silent().items():
            if request_ids:
                logger.warning("%s: subscriber %r stopped polling; aborting its %d requests",
                               self.worker_id, name, len(request_ids))
            for rid in request_ids:
                self.untrack(rid)
                self.engine.abort_request(rid)
                self._published.pop(rid, None)

    def step(self) -> bool:
        """One engine step, then publish its deltas. Returns False if the step ran
        nothing (the engine only waits for remote KV, or for room)."""
        t0 = time.perf_counter()
        changed = self.engine.step()
        if self.engine.last_step_ran:      # a step that changed requests always ran
            self.publish(changed, time.perf_counter() - t0)
        return self.engine.last_step_ran

    def poll(self, timeout_s: float, subscriber: str = DEFAULT) -> list[StepOutput]:
        """``subscriber``'s step outputs since its last poll: one per step, with the
        deltas of its own requests and everyone's stats and KV events; waits up to
        ``timeout_s`` seconds for the first (call from any thread but the loop's).
        A first poll makes ``subscriber`` known (it starts with the latest stats).

        Raises:
            RuntimeError: the loop failed (its requests were finished with ``error``).
        """
        if self.error is not None:
            raise RuntimeError(f"{self.worker_id} engine failed: {self.error}")
        return self.subscribers.poll(subscriber, timeout_s)

    def unread(self, subscriber: str, steps: list[StepOutput]) -> None:
        """Give back what :meth:`poll` returned to ``subscriber`` and could not be
        delivered: its next poll returns it first."""
        self.subscribers.unread(subscriber, steps)

    def assign(self, request_id: str, subscriber: str) -> None:
        """``request_id`` (and its samples, for ``n > 1``) belongs to ``subscriber``:
        its deltas go only there, and it is aborted if that subscriber stops polling.
        Call on the loop thread, in the same command that adds the request."""
        req = self.engine.scheduler.requests.get(request_id)
        forks = ([f.request_id for f in req.pending_forks] if req is not None
                 else self.engine.beam_search.sample_ids(request_id))
        self.subscribers.assign([request_id, *forks], subscriber)

    def track(self, request_id: str) -> Future:
        """A future of ``request_id``'s final :class:`RequestDelta` (call on the loop
        thread, e.g. in the same command that adds the request)."""
        fut: Future = Future()
        self._tracked[request_id] = fut
        return fut

    def untrack(self, request_id: str) -> None:
        fut = self._tracked.pop(request_id, None)
        if fut is not None:
            fut.cancel()

    def publish(self, changed: list[Request], step_time_s: float = 0.0) -> None:
        deltas = tuple(self.delta(r) for r in changed)
        for r, d in zip(changed, deltas):
            if d.finish_reason is not None and r.request_id in self._tracked:
                fut = self._tracked.pop(r.request_id)
                if fut.set_running_or_notify_cancel():
                    fut.set_result(d)
        # Tokens run, prompt chunks included (vLLM's iteration_tokens_total), not the
        # tokens sampled: a prefill chunk that ends mid-prompt samples none.
        self._last_stats = self.engine.stats(self.worker_id, self.role, self.engine.last_step_tokens)
        kv_events = self._take_kv_events()
        self.subscribers.publish(StepOutput(
            deltas if self.publish_deltas else (), self._last_stats, step_time_s, kv_events,
            time.time()), [r.request_id for r in changed] if self.publish_deltas else ())

    def _take_kv_events(self) -> tuple:
        kv_events = tuple(self.engine.kv_cache_manager.take_kv_events())
        if kv_events and self.kv_event_sink is not None:
            self.kv_event_sink(kv_events)
        return kv_events

    def _publish_idle_stats(self) -> None:
        """Gauges must settle when the engine goes idle (e.g. after an abort, which
        runs no step): send the stats once more if they changed."""
        stats = self.engine.stats(self.worker_id, self.role)
        # Commands run between steps (a reserve evicts) record KV events too.
        kv_events = self._take_kv_events()
        if stats != self._last_stats or kv_events:
            self._last_stats = stats
            self.subscribers.publish(StepOutput((), stats, kv_events=kv_events))

    def delta(self, r: Request) -> RequestDelta:
        """The request's output tokens not yet published (and its prompt logprobs, with
        the first of them), named as the router knows it: the request's id and the
        sample's index."""
        sent = self._published.get(r.request_id, 0)
        new = tuple(r.output_token_ids[sent:])
        prompt_lps = None
        if new and sent == 0 and r.sampling_params.prompt_logprobs is not None:
            prompt_lps = tuple(r.prompt_logprobs)
        lps = ()
        if new and r.sampling_params.logprobs is not None:
            # The last ones: tokens that reached the client another way (a resumed
            # request's) may have come without their logprobs.
            lps = tuple(r.output_logprobs[-len(new):])
        if r.is_finished:
            self._published.pop(r.request_id, None)
        else:
            self._published[r.request_id] = r.num_output_tokens
        ticket, r.kv_load_ticket = r.kv_load_ticket, None      # published once
        return RequestDelta(r.parent_request_id, new, lps, r.status.finish_reason,
                            r.stop_reason, r.num_prompt_tokens, r.num_cached_tokens,
                            r.num_output_tokens, ticket, prompt_lps, r.sample_index)

    def mark_published(self, request_id: str, num_tokens: int) -> None:
        """Tokens of a request that reached the client another way (the prefill's first token)."""
        self._published[request_id] = num_tokens

    def _fail_all(self, exc: BaseException) -> None:
        """After a crash: finish every request as ``error`` so no stream waits forever."""
        sch = self.engine.scheduler
        deltas, ids = [], []
        for r in [*sch.waiting, *sch.running, *sch.swapped, *sch.remote_kv.requests]:
            deltas.append(RequestDelta(r.parent_request_id, (), (), "error", str(exc)[:200],
                                       r.num_prompt_tokens, r.num_cached_tokens,
                                       r.num_output_tokens, sample_index=r.sample_index))
            ids.append(r.request_id)
        self.subscribers.publish(StepOutput(tuple(deltas),
                                            self.engine.stats(self.worker_id, self.role)), ids)
        for fut in self._tracked.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"engine loop {self.worker_id} failed: {exc}"))
        self._tracked.clear()
        while True:   # refuse pending commands too
            try:
                _, _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            fut.set_exception(RuntimeError(f"engine loop {self.worker_id} failed: {exc}"))
