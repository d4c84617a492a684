"""Prometheus metrics for the whole cluster, served by the router.

Names follow vLLM's (``vllm:num_requests_running`` -> ``tandem:num_requests_running``)
where one exists; the disaggregation-specific ones (KV transfer) are added.
Workers send their stats with every step output, so one scrape of the router's
``/metrics`` sees the cluster. Each :class:`Metrics` owns its registry, so two
servers can live in one process.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.control.load_reports import RequestSample

logger = logging.getLogger("tandem.requests")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Engine steps and their delivery: from 0.1 ms (a delivery on one host) to seconds (a long prefill).
_STEP_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125,
                 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
                 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _finish_reasons() -> tuple[str, ...]:
    from tandem.engine.scheduling.request import RequestStatus

    return tuple(s.finish_reason for s in RequestStatus if s.finished)


def _request_fields() -> tuple[str, ...]:
    from tandem.v1 import tandem_pb2 as pb

    d = pb.GenerateRequest.DESCRIPTOR
    return tuple(f.name for f in d.fields) + tuple(o.name for o in d.oneofs) + ("request",)


# Closed label sets. Their series exist at 0 from start-up, as in vLLM, so that
# dashboards and rate() see them before the first event.
FINISH_REASONS = _finish_reasons()
"""``finished_reason`` values of ``tandem:request_success``: stop, length, abort, error."""
PREEMPTION_KINDS = ("swap", "recompute")
"""``kind`` values of ``tandem:num_preemptions``."""
REQUEST_FIELDS = _request_fields()
"""``field`` values of ``tandem:invalid_requests``: the top-level fields (and the
``input`` oneof) of ``GenerateRequest``, which is what a refusal's field path starts with,
and ``request`` for bytes that are no request message at all."""
RATE_LIMIT_REASONS = ("rate", "concurrency")
"""``reason`` values of ``tandem:requests_rate_limited``."""
ABORT_SOURCES = ("grpc_cancel", "http_disconnect", "worker")
"""``source`` values of ``tandem:request_aborts``: who ended the request early.

- ``grpc_cancel``: the gRPC client cancelled the call, disconnected or let its
  deadline pass, at any point from the call's arrival (before its request
  message was read, during admission, prefill, KV transfer or decoding);
- ``http_disconnect``: the OpenAI HTTP client went away (streaming or not);
  one count per prompt of a batched completion;
- ``worker``: a worker's delta ended it as aborted without the router asking.
  No worker sends one today (a worker that drops a silent router's requests,
  ``EngineLoop(subscriber_timeout_s)``, no longer talks to that router): the
  value keeps every ``request_success{finished_reason="abort"}`` counted here too.

There is no Abort RPC: a client aborts by cancelling. The requests of a router
that died are aborted by the workers and counted nowhere (the router that would
count them is gone).
"""
WORKER_WAIT_OUTCOMES = ("resumed", "timed_out", "abandoned")
"""How a wait for a decode worker to take a request over ended (abandoned: its
client went away meanwhile)."""


@dataclass
class RequestTrace:
    """Timestamps (``time.monotonic`` seconds) of one request in the router."""

    request_id: str
    num_prompt_tokens: int
    decode_worker: str
    arrival: float = field(default_factory=time.monotonic)
    dispatched: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prefill_worker: str | None = None
    num_output_tokens: int = 0


class Metrics:
    """The router's metric set and its request hooks.

    Args:
        model_name: value of the ``model_name`` label.
        log_prompts: (unused by metrics) kept with the request log settings.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.load_reporter = None
        """A :class:`tandem.control.load_reports.LoadReporter` told of every request's
        arrival and end (for the planner), or None."""
        self.registry = r = CollectorRegistry()
        m, w = ["model_name"], ["model_name", "worker", "role"]
        # Worker-side gauges (latest step's snapshot).
        self.num_requests_running = Gauge("tandem:num_requests_running",
                                          "Requests in a worker's running batch.", w, registry=r)
        self.num_requests_waiting = Gauge("tandem:num_requests_waiting",
                                          "Requests waiting in a worker's queue.", w, registry=r)
        self.num_requests_swapped = Gauge("tandem:num_requests_swapped",
                                          "Requests swapped out to host memory.", w, registry=r)
        self.kv_cache_usage_perc = Gauge("tandem:kv_cache_usage_perc",
                                         "Fraction of KV blocks in use (0..1).", w, registry=r)
        # This router's own load (what scales the router Deployment).
        self.router_active_requests = Gauge(
            "tandem:router_active_requests", "Requests this router is serving now.", m, registry=r)
        # The planner's view of the pools (only in the process that runs the planner).
        self.pool_workers = Gauge(
            "tandem:pool_workers", "Workers per pool (prefill, decode) and state (ready, "
            "pending, draining; target: the planner's last decision).",
            ["model_name", "pool", "state"], registry=r)
        # Counters.
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished or "
                                     "aborted requests.", m, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens",
                                         "Generated tokens streamed to clients.", m, registry=r)
        self.request_success = Counter("tandem:request_success", "Finished requests.",
                                       m + ["finished_reason"], registry=r)
        self.num_preemptions = Counter("tandem:num_preemptions", "Preemptions.",
                                       w + ["kind"], registry=r)
        self.prefix_cache_queries = Counter("tandem:prefix_cache_queries",
                                            "Tokens looked up in the prefix cache.", w, registry=r)
        self.prefix_cache_hits = Counter("tandem:prefix_cache_hits",
                                         "Tokens found in the prefix cache.", w, registry=r)
        self.spec_decode_num_drafts = Counter(
            "tandem:spec_decode_num_drafts",
            "Speculative decoding: verification steps of requests that had drafts.", w, registry=r)
        self.spec_decode_num_draft_tokens = Counter(
            "tandem:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
            w, registry=r)
        self.spec_decode_num_accepted_tokens = Counter(
            "tandem:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.", w, registry=r)
        self.structured_output_compiles = Counter(
            "tandem:structured_output_compiles",
            "Structured outputs: grammars compiled (not answered from the cache).", w, registry=r)
        self.structured_output_cache_hits = Counter(
            "tandem:structured_output_cache_hits",
            "Structured outputs: grammar compiles answered from the compiled-grammar cache.",
            w, registry=r)
        self.structured_output_compile_seconds = Counter(
            "tandem:structured_output_compile_seconds",
            "Structured outputs: wall time spent compiling grammars (seconds).", w, registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0: first).",
            w + ["position"], registry=r)
        self.kv_transfer_bytes = Counter("tandem:kv_transfer_bytes",
                                         "KV bytes moved from prefill to decode workers.",
                                         m + ["worker"], registry=r)
        self.kv_transfer_failures = Counter("tandem:kv_transfer_failures",
                                            "KV transfers that failed or timed out.",
                                            m + ["worker"], registry=r)
        self.local_prefills = Counter(
            "tandem:local_prefills",
            "Disaggregated requests prefilled on their decode worker because their prefill "
            "worker's queue was full (--max-prefill-queue-tokens).", m, registry=r)
        self.request_aborts = Counter(
            "tandem:request_aborts",
            "Requests that ended early, aborted, by who ended them (grpc_cancel, "
            "http_disconnect, worker); each one also counts in "
            "request_success{finished_reason=\"abort\"}.", m + ["source"], registry=r)
        self.request_migrations = Counter(
            "tandem:request_migrations",
            "Requests moved to another decode worker after theirs failed, by the failed worker.",
            m + ["worker"], registry=r)
        self.requests_waiting_for_worker = Gauge(
            "tandem:requests_waiting_for_worker",
            "Requests whose decode worker died, waiting for one to take them over (no "
            "other was alive).", m, registry=r)
        self.request_worker_waits = Counter(
            "tandem:request_worker_waits",
            "Requests that waited for a decode worker to take them over, by outcome "
            "(resumed, timed_out, abandoned).", m + ["outcome"], registry=r)
        self.request_worker_wait_seconds = Histogram(
            "tandem:request_worker_wait_seconds",
            "How long a request waited for a decode worker to take it over.", m,
            registry=r, buckets=_LATENCY_BUCKETS)
        self.worker_restarts = Counter("tandem:worker_restarts",
                                       "Workers replaced after they died or were fenced.",
                                       m + ["worker"], registry=r)
        self.invalid_requests = Counter("tandem:invalid_requests",
                                        "Requests refused with INVALID_ARGUMENT.",
                                        m + ["field"], registry=r)
        self.requests_rate_limited = Counter(
            "tandem:requests_rate_limited",
            "Requests refused by their API key's rate limit or concurrency cap (429 / "
            "RESOURCE_EXHAUSTED).", m + ["reason"], registry=r)
        # Histograms.
        lat = dict(registry=r, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token.", m, **lat)
        self.itl = Histogram("tandem:inter_token_latency_seconds",
                             "Time between streamed tokens.", m, **lat)
        self.tpot = Histogram("tandem:request_time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (output tokens - 1).", m, **lat)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "End-to-end latency.", m,
                             registry=r, buckets=_LATENCY_BUCKETS + (160.0, 320.0))
        self.queue_time = Histogram("tandem:request_queue_time_seconds",
                                    "Arrival to dispatch (KV blocks reserved).", m, **lat)
        self.prefill_time = Histogram("tandem:request_prefill_time_seconds",
                                      "Dispatch to first token.", m, **lat)
        self.decode_time = Histogram("tandem:request_decode_time_seconds",
                                     "First token to last token.", m, **lat)
        self.kv_transfer_seconds = Histogram("tandem:kv_transfer_seconds",
                                             "Remote prefill + KV transfer of one request.",
                                             m + ["worker"], **lat)
        tok = dict(registry=r, buckets=_TOKEN_BUCKETS)
        self.request_prompt_tokens = Histogram("tandem:request_prompt_tokens",
                                               "Prompt tokens per request.", m, **tok)
        self.request_generation_tokens = Histogram("tandem:request_generation_tokens",
                                                   "Generated tokens per request.", m, **tok)
        self.iteration_tokens = Histogram("tandem:iteration_tokens_total",
                                          "Tokens run per engine step.", w, **tok)
        step = dict(registry=r, buckets=_STEP_BUCKETS)
        self.engine_step_seconds = Histogram(
            "tandem:engine_step_seconds", "Wall time of a worker's engine steps that ran tokens.",
            w, **step)
        self.step_delivery_seconds = Histogram(
            "tandem:step_delivery_seconds",
            "End of a worker's engine step to its outputs reaching the router (worker and "
            "router clocks; exact on one host).", w, **step)
        self._worker_totals: dict[str, dict[str, int]] = {}
        """Step-stat totals of each worker whose series are exposed (alive)."""
        self._roles: dict[str, str] = {}
        """Role of each registered worker, alive or dead (not yet removed)."""
        self._http: ThreadingHTTPServer | None = None
        # labels() creates a child at 0: every model-level series, and each value of
        # the closed label sets, is exposed from the first scrape.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft,
                       self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time,
                       self.decode_time, self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in RATE_LIMIT_REASONS:
            self.requests_rate_limited.labels(model_name, reason)
        for source in ABORT_SOURCES:
            self.request_aborts.labels(model_name, source)
        for outcome in WORKER_WAIT_OUTCOMES:
            self.request_worker_waits.labels(model_name, outcome)
        self.requests_waiting_for_worker.labels(model_name)
        self.request_worker_wait_seconds.labels(model_name)
        self.local_prefills.labels(model_name)
        for name in REQUEST_FIELDS:
            self.invalid_requests.labels(model_name, name)

    def register_worker(self, worker_id: str, role: str) -> None:
        """Create every series of one worker at 0 (call it when the worker starts).

        Gauges (running, waiting, swapped, KV cache usage), preemptions of each kind,
        prefix-cache queries and hits and the iteration-tokens histogram for any
        role; the KV transfer series for a ``prefill`` worker, which is what they
        are labelled by. A worker registered again without going down in between
        keeps its counters (they must never go down); its own totals start again
        from zero, so its step stats are counted from there. After
        :meth:`worker_down` its series start again from zero (a new series, as
        Prometheus expects of a restarted target).

        Args:
            worker_id: e.g. ``decode-0``.
            role: ``prefill``, ``decode`` or ``colocated``.
        """
        labels = (self.model_name, worker_id, role)
        for gauge in (self.num_requests_running, self.num_requests_waiting,
                      self.num_requests_swapped, self.kv_cache_usage_perc):
            gauge.labels(*labels).set(0)
        for kind in PREEMPTION_KINDS:
            self.num_preemptions.labels(*labels, kind)
        for metric in (self.prefix_cache_queries, self.prefix_cache_hits, self.iteration_tokens,
                       self.engine_step_seconds, self.step_delivery_seconds,
                       *self._structured_output_counters,
                       *(self._spec_counters if role != "prefill" else ())):
            metric.labels(*labels)
        self.worker_restarts.labels(self.model_name, worker_id)
        if role == "prefill":
            for metric in (self.kv_transfer_bytes, self.kv_transfer_failures,
                           self.kv_transfer_seconds):
                metric.labels(self.model_name, worker_id)
        else:
            self.request_migrations.labels(self.model_name, worker_id)
        self._worker_totals[worker_id] = {}
        self._roles[worker_id] = role

    @property
    def _spec_counters(self) -> tuple:
        return (self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                self.spec_decode_num_accepted_tokens)

    @property
    def _structured_output_counters(self) -> tuple:
        """Every role compiles: a prefill worker samples a constrained first token."""
        return (self.structured_output_compiles, self.structured_output_cache_hits,
                self.structured_output_compile_seconds)

    def follow(self, registry) -> None:
        """Keep the workers' series in step with ``registry`` (a
        :class:`~tandem.router.registry.WorkerRegistry`): created at 0 for each
        worker in it now and each one put in service later (a replacement under the
        same id included), dropped when one dies, is replaced or is removed."""
        for h in registry.workers():
            self.register_worker(h.worker_id, h.role)
            if not h.alive:
                self.worker_down(h.worker_id)

        def down(worker_id: str) -> None:
            try:
                registry.get(worker_id)        # dead or being replaced: still registered
            except KeyError:
                self.worker_down(worker_id, removed=True)
            else:
                self.worker_down(worker_id)

        registry.add_worker_up_listener(lambda h: self.register_worker(h.worker_id, h.role))
        registry.add_worker_down_listener(down)

    def worker_down(self, worker_id: str, removed: bool = False) -> None:
        """Drop a dead, replaced or removed worker's series from the exposition, so that
        no gauge keeps its last value (KV usage, running and waiting requests) and
        no series of a worker that is gone lingers; :meth:`register_worker` creates
        them again, at 0, for its replacement. Stats that still arrive from the dead
        incarnation are ignored.

        What counts the worker's failures stays while it is registered (they are
        counted as it fails, and read by alerts): ``worker_restarts``,
        ``request_migrations``, ``kv_transfer_failures``. They go too when it is
        ``removed`` (scale-down). Unknown ids and repeated calls are no-ops.
        """
        role = self._roles.get(worker_id)
        if role is None:
            return
        totals = self._worker_totals.pop(worker_id, None) or {}
        labels = (self.model_name, worker_id, role)
        for metric in (self.num_requests_running, self.num_requests_waiting,
                       self.num_requests_swapped, self.kv_cache_usage_perc,
                       self.prefix_cache_queries, self.prefix_cache_hits, self.iteration_tokens,
                       self.engine_step_seconds, self.step_delivery_seconds,
                       *self._spec_counters, *self._structured_output_counters):
            _remove(metric, *labels)
        for pos in range(len(totals.get("spec_per_pos", ()))):
            _remove(self.spec_decode_num_accepted_tokens_per_pos, *labels, str(pos))
        for kind in PREEMPTION_KINDS:
            _remove(self.num_preemptions, *labels, kind)
        for metric in (self.kv_transfer_bytes, self.kv_transfer_seconds):
            _remove(metric, self.model_name, worker_id)
        if removed:
            del self._roles[worker_id]
            for metric in (self.worker_restarts, self.request_migrations,
                           self.kv_transfer_failures):
                _remove(metric, self.model_name, worker_id)

    # -- request hooks (router event loop) -----------------------------------------------------
    def follow_router(self, active: Callable[[], int]) -> None:
        """Export ``active()`` (requests in flight in this router) as
        ``tandem:router_active_requests``, read at each scrape."""
        self.router_active_requests.labels(self.model_name).set_function(active)

    def pools(self, sizes: dict, targets: dict[str, int]) -> None:
        """The planner's pools: ``sizes`` (pool -> PoolSize) and its ``targets``."""
        for pool, size in sizes.items():
            for state in ("ready", "pending", "draining"):
                self.pool_workers.labels(self.model_name, pool, state).set(getattr(size, state))
        for pool, n in targets.items():
            self.pool_workers.labels(self.model_name, pool, "target").set(n)

    def invalid_request(self, field_name: str) -> None:
        self.invalid_requests.labels(self.model_name, field_name.split(".")[0]).inc()

    def request_started(self, v, decode_worker: str) -> RequestTrace:
        if self.load_reporter is not None:
            self.load_reporter.arrival(len(v.prompt_token_ids))
        return RequestTrace(v.request_id, len(v.prompt_token_ids), decode_worker)

    def kv_transferred(self, trace: RequestTrace, prefill_worker: str, ticket: dict,
                       seconds: float) -> None:
        trace.prefill_worker = prefill_worker
        if prefill_worker not in self._worker_totals:     # went down meanwhile
            return
        from tandem.kvtransfer.layout import KVTransferTicket

        t = KVTransferTicket.from_dict(ticket)
        self.kv_transfer_bytes.labels(self.model_name, prefill_worker).inc(
            t.bytes_per_layer * t.layout.num_layers)
        self.kv_transfer_seconds.labels(self.model_name, prefill_worker).observe(seconds)

    def prefilled_locally(self) -> None:
        self.local_prefills.labels(self.model_name).inc()

    def kv_transfer_failed(self, prefill_worker: str) -> None:
        if prefill_worker in self._roles:
            self.kv_transfer_failures.labels(self.model_name, prefill_worker).inc()

    def tokens(self, trace: RequestTrace, index: int, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if trace.dispatched is None:
            trace.dispatched = trace.arrival
        if trace.first_token is None:
            trace.first_token = now
            self.ttft.labels(self.model_name).observe(now - trace.arrival)
        elif index == 0 and trace.last_token is not None:
            self.itl.labels(self.model_name).observe(now - trace.last_token)
        if index == 0:
            trace.last_token = now
        trace.num_output_tokens += n
        self.generation_tokens.labels(self.model_name).inc(n)

    def worker_wait_started(self) -> None:
        """A request began waiting for a decode worker to take it over."""
        self.requests_waiting_for_worker.labels(self.model_name).inc()

    def worker_wait_ended(self, outcome: str, seconds: float) -> None:
        """It stopped waiting: ``resumed`` on a worker, ``timed_out``, or ``abandoned``
        (its client went away)."""
        self.requests_waiting_for_worker.labels(self.model_name).dec()
        self.request_worker_waits.labels(self.model_name, outcome).inc()
        self.request_worker_wait_seconds.labels(self.model_name).observe(seconds)

    def request_migrated(self, worker_id: str) -> None:
        if worker_id in self._roles:
            self.request_migrations.labels(self.model_name, worker_id).inc()

    def worker_restarted(self, worker_id: str) -> None:
        if worker_id in self._roles:
            self.worker_restarts.labels(self.model_name, worker_id).inc()

    def request_rate_limited(self, reason: str) -> None:
        self.requests_rate_limited.labels(self.model_name, reason).inc()

    def _aborted(self, source: str) -> None:
        """The one place ``tandem:request_aborts`` counts: once per aborted request."""
        if source not in ABORT_SOURCES:
            raise ValueError(f"source: unknown {source!r}, expected one of {ABORT_SOURCES}")
        self.request_aborts.labels(self.model_name, source).inc()

    def request_cancelled(self, source: str) -> None:
        """A client went away before its request reached the orchestrator (before
        its request message was read, or while it was admitted): one aborted
        request, with no tokens and no latencies."""
        self._aborted(source)
        self.request_success.labels(self.model_name, "abort").inc()

    def request_finished(self, trace: RequestTrace, samples,
                         aborted_by: str | None = None) -> None:
        """A request the orchestrator ran is over (called once per request).

        Args:
            samples: its sample streams, every one finished (stop, length, abort, error).
            aborted_by: the :data:`ABORT_SOURCES` value when it ended aborted, else None.
        """
        now = time.monotonic()
        m = self.model_name
        if aborted_by is not None:
            self._aborted(aborted_by)
        self.prompt_tokens.labels(m).inc(trace.num_prompt_tokens)
        self.request_prompt_tokens.labels(m).observe(trace.num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(trace.num_output_tokens)
        self.e2e.labels(m).observe(now - trace.arrival)
        reasons = [s.finish_reason or "error" for s in samples]
        for reason in reasons:
            self.request_success.labels(m, reason).inc()
        if trace.first_token is not None:
            dispatched = trace.dispatched or trace.arrival
            self.queue_time.labels(m).observe(dispatched - trace.arrival)
            self.prefill_time.labels(m).observe(trace.first_token - dispatched)
            self.decode_time.labels(m).observe((trace.last_token or now) - trace.first_token)
            n0 = samples[0].num_tokens
            if n0 > 1:
                self.tpot.labels(m).observe(((trace.last_token or now) - trace.first_token) / (n0 - 1))
        ttft = None if trace.first_token is None else trace.first_token - trace.arrival
        tpot = None
        if trace.first_token is not None and samples[0].num_tokens > 1:
            tpot = ((trace.last_token or now) - trace.first_token) / (samples[0].num_tokens - 1)
        if self.load_reporter is not None:
            self.load_reporter.finished(RequestSample(
                isl=trace.num_prompt_tokens, osl=trace.num_output_tokens, ttft_s=ttft, itl_s=tpot,
                prefill=trace.prefill_worker or "", decode=trace.decode_worker,
                ok=aborted_by is None and all(r in ("stop", "length") for r in reasons)))
        logger.info(
            "request finished id=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d "
            "ttft_s=%s tpot_s=%s e2e_s=%.4f finish_reason=%s prefill_worker=%s decode_worker=%s",
            trace.request_id, trace.num_prompt_tokens, trace.num_output_tokens,
            max(s.num_cached_tokens for s in samples), _fmt(ttft), _fmt(tpot), now - trace.arrival,
            ",".join(reasons), trace.prefill_worker or "-", trace.decode_worker)

    # -- worker stats (router event loop) -------------------------------------------------------
    def worker_step(self, worker, step) -> None:
        s = step.stats
        last = self._worker_totals.get(s.worker_id)
        if last is None:         # a dead incarnation's last words: its series are gone
            return
        labels = (self.model_name, s.worker_id, s.role)
        self.num_requests_running.labels(*labels).set(s.num_running)
        self.num_requests_waiting.labels(*labels).set(s.num_waiting)
        self.num_requests_swapped.labels(*labels).set(s.num_swapped)
        self.kv_cache_usage_perc.labels(*labels).set(s.kv_cache_usage)
        if s.num_step_tokens or step.deltas:
            self.iteration_tokens.labels(*labels).observe(s.num_step_tokens)
        if s.num_step_tokens and step.step_time_s:
            self.engine_step_seconds.labels(*labels).observe(step.step_time_s)
        if step.finished_at:
            self.step_delivery_seconds.labels(*labels).observe(
                max(0.0, time.time() - step.finished_at))
        for name, value, counter, extra in (
                ("preempt_swap", s.num_swap_preemptions, self.num_preemptions, ("swap",)),
                ("preempt_recompute", s.num_recompute_preemptions, self.num_preemptions,
                 ("recompute",)),
                ("queries", s.prefix_cache_queries, self.prefix_cache_queries, ()),
                ("hits", s.prefix_cache_hits, self.prefix_cache_hits, ()),
                ("spec_drafts", s.spec_decode_num_drafts, self.spec_decode_num_drafts, ()),
                ("spec_draft_tokens", s.spec_decode_num_draft_tokens,
                 self.spec_decode_num_draft_tokens, ()),
                ("spec_accepted", s.spec_decode_num_accepted_tokens,
                 self.spec_decode_num_accepted_tokens, ()),
                ("so_compiles", s.structured_output_compiles,
                 self.structured_output_compiles, ()),
                ("so_hits", s.structured_output_cache_hits, self.structured_output_cache_hits, ()),
                ("so_seconds", s.structured_output_compile_seconds,
                 self.structured_output_compile_seconds, ())):
            diff = value - last.get(name, 0)
            if diff > 0:
                counter.labels(*labels, *extra).inc(diff)
            last[name] = value
        per_pos = s.spec_decode_num_accepted_tokens_per_pos
        if per_pos:
            seen = last.get("spec_per_pos", ())
            for pos, value in enumerate(per_pos):
                diff = value - (seen[pos] if pos < len(seen) else 0)
                counter = self.spec_decode_num_accepted_tokens_per_pos.labels(*labels, str(pos))
                if diff > 0:
                    counter.inc(diff)
            last["spec_per_pos"] = tuple(per_pos)

    # -- exposition -----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int, healthy: Callable[[], bool]) -> int:
        """Serve ``/metrics`` and ``/health`` (200 when serving, 503 when not).

        Returns:
            The bound port.
        """
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, code, ctype = metrics.render(), 200, CONTENT_TYPE_LATEST
                elif path == "/health":
                    ok = healthy()
                    body, code, ctype = (b"ok\n" if ok else b"not serving\n"), (200 if ok else 503), \
                        "text/plain"
                else:
                    body, code, ctype = b"not found\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):   # scrapes are not worth a log line each
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="metrics-http").start()
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _remove(metric, *labelvalues: str) -> None:
    """``metric.remove(*labelvalues)``, a no-op when that series does not exist."""
    try:
        metric.remove(*labelvalues)
    except KeyError:
        pass


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
