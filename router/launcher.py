"""Starts a Tandem cluster: the cluster state (Redis), Ray actors for the workers, KV
channels between them, supervision, the router; and extra routers over it.

``tandem serve`` and the tests use :class:`TandemServer`. With no Ray address an
embedded Ray cluster is started on this machine (``ray.init()``); with no Redis
URL an embedded ``redis-server`` (:class:`~tandem.control.redis_server.EmbeddedRedis`).
The default is one prefill and one decode actor and the router on
127.0.0.1:50051. ``tandem router`` runs a :class:`RouterServer`: one more router
over the same workers, found in Redis.

Redis is supervised like a worker: the embedded ``redis-server`` is started again
(same port, empty) when it dies, and workers and routers re-assert the cluster
state as after a flush. An external Redis (``redis_url``) that goes away leaves
every router on its last view of the workers; requests are still served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from tandem.control.planner import PlannerConfig
from tandem.engine.config import EngineConfig
from tandem.router.auth import APIKeyStore
from tandem.router.registry import WorkerHandle
from tandem.control.rate_limits import RateLimits
from tandem.router.tls import TLSConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How to run a cluster.

    Attributes:
        mode: ``disaggregated`` (prefill and decode workers) or ``colocated``
            (one kind of worker that does both; the baseline).
        host, port: the router's gRPC address (port 0 = any free port).
        num_prefill, num_decode: worker counts (colocated uses ``num_decode``).
        engine: the workers' engine config.
        prefill_engine: a different config for prefill workers (None = ``engine``);
            their KV layout must match the decode workers'.
        kv_transport: ``gloo`` (CPU) or ``nccl``.
        cpu_affinity: pin prefill and decode workers to disjoint cores (the
            colocated worker gets them all), torch threads to match.
            A worker of ``tensor_parallel_size`` N ranks (``engine``) is one group:
            its ranks 1.. are subprocesses of its actor and share its cores, each
            rank running 1/N of the worker's torch threads.
        lend_idle_cores: disaggregated on one machine (an embedded Ray), the
            initial workers are not pinned: each steps on its share of the cores
            (as ``cpu_affinity`` would size it) plus the shares of the workers
            that are idle at that moment
            (:mod:`~tandem.engine.runtime.core_lending`). Workers of one rank only.
        metrics_port: HTTP port for ``/metrics`` and ``/health`` (None = off, 0 = any).
        http_port: the OpenAI-compatible HTTP API's port (None = off, 0 = any free
            port); it also serves ``/metrics`` and ``/health``.
        ray_address: an existing Ray cluster, or None for an embedded one.
        transfer_timeout_s: seconds a KV transfer may take before it counts as failed.
        routing_policy: ``prefix_aware`` (longest cached prefix unless overloaded) or
            ``least_loaded`` (see :mod:`tandem.router.routing`).
        max_prefill_queue_tokens: disaggregated: a request is prefilled on its
            decode worker when the prefill worker picked for it already has this
            many prompt tokens in flight (conditional disaggregation; None: always
            remote). See :class:`~tandem.router.orchestrator.Orchestrator`.
        prefer_local_prefill: disaggregated: a request whose decode worker has
            no decode batch (and fewer prompt tokens in flight than a busy
            prefill worker), or holds all of its prompt but one block in its
            prefix cache, is prefilled there (no decode step waits behind its
            prompt, its KV cache does not move); see the
            :class:`~tandem.router.orchestrator.Orchestrator`.
        redis_url: the cluster state; None starts an embedded ``redis-server``.
        namespace: the cluster's key prefix in Redis (and its Ray actor names).
        lease_ttl_s: a worker's lease (seconds): a worker silent this long is dead.
        supervise: replace workers that die (pools keep their size).
        api_keys: the keys clients must present (``authorization: Bearer <key>``);
            None or an empty store = no authentication. Health and reflection
            stay open unless ``auth_health``.
        auth_health: the health service requires a key too.
        tls: serve the router's gRPC port and its HTTP API over TLS (None = plaintext).
        rate_limits: per-API-key request rate and concurrency limits, kept in the
            cluster state (shared by every router; off by default).
        autoscale: run a planner (:mod:`tandem.control.planner`) that sizes the
            prefill and decode pools separately, between its bounds (None = fixed
            pools of ``num_prefill`` / ``num_decode``). Disaggregated mode only.
        drain_timeout_s: seconds a worker being scaled down may take to finish its
            requests before the rest are migrated to other workers.
        worker_wait_timeout_s: seconds a request whose decode worker died waits for
            one to take it over when no other decode worker is alive (the
            supervisor's replacement), before it ends with ``UNAVAILABLE``.
        engine_nice: how much lower the workers' engine threads run than the
            threads that deliver their outputs (Linux nice, 0-19; see
            :meth:`~tandem.engine.runtime.engine_loop.EngineLoop.build`). On a
            machine with no core to spare (the 2-core CPU one) 5 keeps the token
            stream smooth; 0 leaves the engine at the process's priority.
        enable_auto_tool_choice, tool_call_parser: ``tool_choice="auto"`` on the HTTP
            API, tool calls read from the output by the named parser
            (:data:`~tandem.router.tool_parsers.TOOL_PARSERS`: ``hermes``,
            ``llama3_json``); both are needed, as in vLLM.
    """

    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 50051
    num_prefill: int = 1
    num_decode: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill_engine: EngineConfig | None = None
    kv_transport: str = "gloo"
    cpu_affinity: bool = False
    lend_idle_cores: bool = False
    metrics_port: int | None = None
    http_port: int | None = None
    ray_address: str | None = None
    transfer_timeout_s: float = 60.0
    routing_policy: str = "prefix_aware"
    max_prefill_queue_tokens: int | None = None
    prefer_local_prefill: bool = False
    redis_url: str | None = None
    namespace: str = "tandem"
    lease_ttl_s: float = 10.0
    supervise: bool = True
    api_keys: APIKeyStore | None = None
    auth_health: bool = False
    tls: TLSConfig | None = None
    rate_limits: RateLimits = field(default_factory=RateLimits)
    autoscale: PlannerConfig | None = None
    drain_timeout_s: float = 30.0
    worker_wait_timeout_s: float = 60.0
    engine_nice: int = 5
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode: expected disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError("num_prefill/num_decode: need at least one worker of each kind")
        from tandem.router.routing import ROUTING_POLICIES

        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy: unknown {self.routing_policy!r}, expected one "
                             f"of {', '.join(ROUTING_POLICIES)}")
        if self.max_prefill_queue_tokens is not None:
            if self.max_prefill_queue_tokens < 1:
                raise ValueError(f"max_prefill_queue_tokens: must be at least 1, got "
                                 f"{self.max_prefill_queue_tokens}")
            if self.mode != "disaggregated":
                raise ValueError("max_prefill_queue_tokens: chooses between a prefill worker "
                                 "and the decode worker; it needs mode=disaggregated")
        if self.prefer_local_prefill and self.mode != "disaggregated":
            raise ValueError("prefer_local_prefill: chooses between a prefill worker "
                             "and the decode worker; it needs mode=disaggregated")
        if self.auth_health and not (self.api_keys is not None and self.api_keys.enabled):
            raise ValueError("auth_health: health can require a key only when API keys are set")
        if self.autoscale is not None:
            if self.mode != "disaggregated":
                raise ValueError("autoscale: the planner sizes prefill and decode pools; "
                                 "it needs mode=disaggregated")
            for pool, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                lo, hi = self.autoscale.bounds(pool)
                if not lo <= n <= hi:
                    raise ValueError(f"num_{pool}: {n} is outside the planner's bounds "
                                     f"[{lo}, {hi}]")
        if self.lend_idle_cores:
            if self.mode != "disaggregated":
                raise ValueError("lend_idle_cores: lends cores between prefill and decode "
                                 "workers; it needs mode=disaggregated")
            if self.ray_address is not None:
                raise ValueError("lend_idle_cores: its workers share one machine's cores; "
                                 "it needs the embedded Ray (no ray_address)")
            if self.cpu_affinity:
                raise ValueError("lend_idle_cores: the workers are not pinned while they "
                                 "lend cores; drop cpu_affinity")
            for engine in (self.engine, self.prefill_engine or self.engine):
                if engine.tensor_parallel_size != 1:
                    raise ValueError("lend_idle_cores: needs tensor_parallel_size 1 "
                                     f"(got {engine.tensor_parallel_size})")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice: must be in [0, 19], got {self.engine_nice}")
        for name in ("drain_timeout_s", "worker_wait_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.tool_call_parser is not None:
            from tandem.router.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)        # an unknown name: ValueError
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser to be set")


def _plan_cpus(cfg: ServeConfig) -> tuple[list[list[int] | None], list[list[int] | None], int]:
    """Cores per prefill and decode worker, and torch threads each (0: as many as the
    worker's cores); a worker's ranks share them (:func:`_rank_threads`)."""
    cores = sorted(os.sched_getaffinity(0))
    n_workers = cfg.num_decode + (cfg.num_prefill if cfg.mode == "disaggregated" else 0)
    if not (cfg.cpu_affinity or cfg.lend_idle_cores) or cfg.mode == "colocated" or len(cores) < 2:
        threads = max(1, len(cores) // n_workers)
        return [None] * cfg.num_prefill, [None] * cfg.num_decode, threads
    # Prefill workers on the first half of the cores, decode workers on the second half.
    half = len(cores) // 2
    pre, dec = cores[:half], cores[half:]

    def split(pool: list[int], n: int) -> list[list[int]]:
        per = max(1, len(pool) // n)
        return [pool[(i * per) % len(pool):(i * per) % len(pool) + per] for i in range(n)]
    return split(pre, cfg.num_prefill), split(dec, cfg.num_decode), 0


def _lending_slots(cfg: ServeConfig) -> dict[str, int]:
    """``lend_idle_cores``: each initial worker's share of the cores (threads),
    by worker id, in board slot order (decode workers, then prefill workers): the
    cores :func:`_plan_cpus` would pin it to."""
    pre, dec, _ = _plan_cpus(cfg)
    shares = {f"decode-{i}": len(c or [0]) for i, c in enumerate(dec)}
    shares.update({f"prefill-{i}": len(c or [0]) for i, c in enumerate(pre)})
    return shares


def _rank_threads(worker_threads: int | None, tensor_parallel_size: int) -> int | None:
    """Torch threads per rank of a worker given ``worker_threads`` for the whole
    worker (None: torch's default, which a lone rank keeps): its ranks share them
    evenly, at least one each."""
    if tensor_parallel_size == 1:
        return worker_threads
    if worker_threads is None:
        return None          # the group sizes them from the worker's CPU affinity
    return max(1, worker_threads // tensor_parallel_size)


EMBEDDED_NODE_IP = "127.0.0.2"
"""The embedded cluster's node address: one machine, so its traffic stays on loopback."""


def init_ray(address: str | None = None) -> None:
    """Connect to Ray (or start an embedded one) unless already connected."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="tandem", log_to_driver=True)
    else:
        # Ray starts worker processes at nice 15 (its ``worker_niceness``), below the
        # router, raylet, GCS and Redis: on a small machine the process doing the real
        # work (the engine) then loses every contention for a core. Same priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # The workers inherit this environment through the raylet. Not a job
        # runtime_env: with one, Ray does not hand its pre-started worker processes
        # to actors, and every worker (re)start pays for a new Python process and
        # Ray's import (0.5-0.7 s measured, against 0.1-0.3 s from the pool).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # On a loopback alias: Ray replaces 127.0.0.1 itself by the machine's outbound
        # address, and workers listen for KV on their node's address.
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace="tandem",
                 _node_ip_address=EMBEDDED_NODE_IP,
                 object_store_memory=200 * 1024 * 1024, log_to_driver=True)


def actor_options(role: str, engine: EngineConfig, require_resource: bool = False) -> dict:
    """Ray placement for a worker: on a cluster whose nodes advertise a ``prefill`` /
    ``decode`` custom resource (deploy/ray, deploy/kubernetes) each worker takes one
    unit of its kind, and on CUDA one GPU per tensor-parallel rank (its ranks share
    the actor's node); an embedded cluster has no such resources and any node will do.

    Args:
        require_resource: ask for the unit even if no node has it now (autoscaling:
            the pending actor makes the Ray autoscaler add a node of that type).
    """
    import ray

    opts: dict = {"num_cpus": 0}
    kind = "prefill" if role == "prefill" else "decode"
    if require_resource or ray.cluster_resources().get(kind, 0) > 0:
        opts["resources"] = {kind: 1}
    if engine.device.startswith("cuda"):
        # Rank r of a tensor-parallel group runs on GPU i + r of the actor's node.
        opts["num_gpus"] = engine.tensor_parallel_size
    return opts


def _resolve_actor(record) -> object:
    """The Ray actor of a worker record (raises ValueError when it is gone)."""
    import ray

    return ray.get_actor(record.actor_name, namespace="tandem")


class RouterServer:
    """One router over the workers registered in the cluster state: the gRPC front
    end, the orchestrator, output pumps (as subscriber :attr:`router_id`), the
    Redis-backed registry, reservations and request journal, and the KV event
    reader feeding prefix-aware routing. Starts no worker.

    Args:
        config: ``host``, ``port``, ``metrics_port``, ``http_port``, ``routing_policy``,
            ``redis_url`` (required here), ``namespace``, ``ray_address``,
            ``engine.model`` (the tokenizer), ``api_keys``, ``auth_health`` and
            ``tls`` are used.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.state = None
        self.registry = None
        self.cluster = None
        self.orchestrator = None
        self.server = None
        self.port: int | None = None
        self.metrics = None
        self.metrics_port: int | None = None
        self.health = None
        self.http = None               # the OpenAI-compatible front end, if any
        self.limiter = None            # per-key rate limits, if configured
        self.http_port: int | None = None
        self._kv_reader_stop = threading.Event()
        self._kv_reader: threading.Thread | None = None
        self._reporter: asyncio.Task | None = None

    def _connect_state(self, url: str) -> None:
        from tandem.control.state import ClusterState
        from tandem.router.redis_registry import RedisRegistry

        self.state = ClusterState(url, self.config.namespace)
        self.registry = RedisRegistry(self.state, _resolve_actor,
                                      flush_grace_s=2 * self.config.lease_ttl_s)

    async def start(self) -> "RouterServer":
        """Join the cluster state and the Ray cluster, find the workers, serve.

        Raises:
            ValueError: no ``redis_url``.
            ClusterStateUnavailable: Redis does not answer (checked before Ray).
            RuntimeError: no decode worker is registered within 60 s.
        """
        if not self.config.redis_url:
            raise ValueError("redis_url: a router joins an existing cluster state")
        self._connect_state(self.config.redis_url)
        await asyncio.to_thread(self.state.check, "a router joins the cluster through it")
        address = self.config.ray_address or await asyncio.to_thread(self._ray_address)
        if not address:
            raise RuntimeError("ray_address: the cluster state names no Ray cluster (is "
                               "`tandem serve` running on it?); pass --ray-address")
        init_ray(address)
        deadline = time.monotonic() + 60
        while True:
            await self.registry.refresh()
            if self.registry.alive("decode"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no decode worker is registered in the cluster state")
            await asyncio.sleep(0.5)
        await self._start_router()
        return self

    def _ray_address(self) -> str | None:
        return self.state.redis.get(self.state.key("ray_address"))

    async def _start_router(self) -> None:
        from grpc_health.v1 import health_pb2

        from tandem.control.journal import RedisJournal
        from tandem.control.reservations import RedisReservations
        from tandem.engine.model.model_files import resolve_model
        from tandem.engine.text.tokenizer import Tokenizer
        from tandem.router.cluster import Cluster
        from tandem.router.metrics import Metrics
        from tandem.router.orchestrator import Orchestrator
        from tandem.router.routing import make_routing_policy
        from tandem.router.server import TandemService, start_grpc_server

        tokenizer = await asyncio.to_thread(Tokenizer, resolve_model(self.config.engine.model))
        first = self.registry.alive("decode")[0].info
        model_info = {k: first[k] for k in ("model_name", "max_model_len", "block_size", "dtype")}
        model_info["vocab_size"] = first["model_vocab_size"]
        self.metrics = Metrics(model_info["model_name"])
        self.metrics.follow(self.registry)
        from tandem.control.load_reports import LoadReporter

        self.metrics.load_reporter = LoadReporter(self.state, self.router_id)
        self._reporter = asyncio.ensure_future(self._report_load(self.metrics.load_reporter))
        self.cluster = Cluster(self.registry, make_routing_policy(self.config.routing_policy),
                               on_step=self.metrics.worker_step, on_health=self._set_health,
                               reservations=RedisReservations(self.state),
                               router_id=self.router_id, kv_events_from_steps=False)
        self.cluster.start()
        self.metrics.follow_router(lambda: self.cluster.num_active)
        self.registry.start()
        self._start_kv_reader()
        orchestrator = self.orchestrator = Orchestrator(
            self.cluster, tokenizer, self.metrics, journal=RedisJournal(self.state),
            prefill_timeout_s=self.config.transfer_timeout_s + 1,
            worker_wait_timeout_s=self.config.worker_wait_timeout_s,
            max_prefill_queue_tokens=self.config.max_prefill_queue_tokens,
            prefer_local_prefill=self.config.prefer_local_prefill)
        self.limiter = None
        if self.config.rate_limits.enabled:
            from tandem.control.rate_limits import RateLimiter

            self.limiter = RateLimiter(self.state, self.config.rate_limits)
        service = TandemService(orchestrator, tokenizer, model_info, self.metrics, self.limiter)
        self.server, self.port, self.health = await start_grpc_server(
            service, self.config.host, self.config.port, api_keys=self.config.api_keys,
            auth_health=self.config.auth_health, tls=self.config.tls)
        if self.config.http_port is not None:
            self.http = self._http_front_end(orchestrator, tokenizer, model_info)
            self.http_port = await self.http.start(self.config.host, self.config.http_port,
                                                   self.config.tls)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.host, self.config.metrics_port,
                                                       lambda: self.cluster.healthy)
        self._set_health(self.cluster.healthy)
        logger.info("router %s serving on %s:%d (%s)", self.router_id, self.config.host,
                    self.port, self.security_summary)

    async def _report_load(self, reporter, interval_s: float = 1.0) -> None:
        """Write what this router saw to the cluster state, for the planner
        (:mod:`tandem.control.load_reports`), every ``interval_s`` seconds."""
        from tandem.control.load_reports import WorkerLoad

        async def fresh(w):
            # An idle worker sends no step outputs, so the stats of its last step would
            # stand for ever: ask it (a stopped or busy one keeps its last stats).
            try:
                return await asyncio.wait_for(w.client.stats(), interval_s / 2)
            except Exception:
                return w.stats

        while True:
            await asyncio.sleep(interval_s)
            workers = self.registry.alive()
            stats = await asyncio.gather(*(fresh(w) for w in workers))
            loads = {w.worker_id: WorkerLoad(w.role, s.queued_prefill_tokens, s.kv_cache_usage,
                                             s.num_running, s.num_waiting)
                     for w, s in zip(workers, stats) if s is not None}
            try:
                await asyncio.to_thread(reporter.flush, loads)
            except Exception as exc:       # Redis down: kept for the next flush
                logger.debug("load report failed: %s", exc)

    def _http_front_end(self, orchestrator, tokenizer, model_info: dict):
        """The OpenAI-compatible front end, behind the same API keys as the gRPC one
        (``/metrics`` open, ``/health`` open unless ``auth_health``)."""
        from tandem.router.openai_api import OpenAIServer

        open_paths = ("/metrics",) if self.config.auth_health else ("/health", "/metrics")
        return OpenAIServer(orchestrator, tokenizer, model_info, self.metrics,
                            healthy=lambda: self.cluster.healthy, api_keys=self.config.api_keys,
                            limiter=self.limiter, open_paths=open_paths,
                            tool_call_parser=self.config.tool_call_parser
                            if self.config.enable_auto_tool_choice else None)

    @property
    def security_summary(self) -> str:
        """``"TLS, 2 API keys"``, ``"plaintext, no API key"``, ...: for banners and logs."""
        cfg = self.config
        n = len(cfg.api_keys) if cfg.api_keys is not None else 0
        transport = "plaintext" if cfg.tls is None else \
            "TLS, client certificates required" if cfg.tls.require_client_cert else "TLS"
        keys = "no API key" if n == 0 else f"{n} API key{'s' if n > 1 else ''}"
        return f"{transport}, {keys}"

    def _start_kv_reader(self) -> None:
        """A thread reading the workers' KV event streams into the routing policy
        (on the router's loop)."""
        from tandem.control.kv_events import KVEventReader

        loop = asyncio.get_running_loop()
        cluster = self.cluster
        reader = KVEventReader(
            self.state,
            on_events=lambda wid, evs: loop.call_soon_threadsafe(cluster.feed_kv_events, wid, evs),
            on_reset=lambda wid: loop.call_soon_threadsafe(cluster.policy.forget_worker, wid))

        def run() -> None:
            while not self._kv_reader_stop.is_set():
                ids = [w.worker_id for w in list(self.registry.workers())]
                try:
                    if not ids or not reader.read(ids, block_ms=500):
                        self._kv_reader_stop.wait(0.05)
                except Exception as exc:   # Redis down: try again
                    logger.debug("KV event read failed: %s", exc)
                    self._kv_reader_stop.wait(1.0)
        self._kv_reader = threading.Thread(target=run, name="kv-events", daemon=True)
        self._kv_reader.start()

    def _set_health(self, ok: bool) -> None:
        from grpc_health.v1 import health_pb2

        if self.health is None:
            return
        status = health_pb2.HealthCheckResponse.SERVING if ok else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "tandem.v1.Tandem"):
            asyncio.ensure_future(self.health.set(name, status))

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
            self._reporter = None
        if self.cluster is not None and self.cluster.stop_requests():
            # Requests in flight end with UNAVAILABLE ("shutting down"; an error frame
            # over HTTP) rather than a cut connection: give the front ends a moment
            # (bounded) to send that before the servers stop.
            deadline = time.monotonic() + grace_s
            while self.cluster.num_active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.orchestrator is not None:
            try:      # the finished requests' journal entries, bounded by Redis's timeouts
                await asyncio.wait_for(self.orchestrator.journal_writer.close(), 5)
            except Exception as exc:
                logger.warning("request journal: final writes failed: %s", exc)
        if self.cluster is not None:
            await self.cluster.stop()
        if self.registry is not None:
            await self.registry.stop()
        self._kv_reader_stop.set()
        if self._kv_reader is not None:
            await asyncio.to_thread(self._kv_reader.join, 5)
        if self.metrics is not None:
            self.metrics.close()
        if self.state is not None:
            self.state.close()


def worker_config_error(exc: BaseException) -> str | None:
    """The message of the ``ValueError`` a Ray worker raised in its constructor (its
    engine refusing the configuration), read from the ``ActorDiedError`` the driver
    gets (Ray keeps the creation task's error only as text); None for any other
    error."""
    from ray.exceptions import RayActorError

    if not isinstance(exc, RayActorError) or not getattr(exc, "actor_init_failed", False):
        return None
    causes = [line.strip()[len("ValueError: "):] for line in str(exc).splitlines()
              if line.strip().startswith("ValueError: ")]
    return causes[-1] if causes else None


def worker_state_error(exc: BaseException) -> str | None:
    """The :class:`~tandem.control.state.ClusterStateUnavailable` message a Ray worker's
    constructor raised (it could not register in Redis), read from the
    ``ActorDiedError`` the driver gets; None for any other error."""
    from ray.exceptions import RayActorError

    from tandem.control.state import ClusterStateUnavailable

    if not isinstance(exc, RayActorError) or not getattr(exc, "actor_init_failed", False):
        return None
    for line in str(exc).splitlines():
        at = line.find(ClusterStateUnavailable.PREFIX)
        if at >= 0:
            return line[at:].strip()
    return None


class TandemServer(RouterServer):
    """A running cluster: cluster state, workers, KV channels, supervision, the router
    and (optionally) metrics.

    Use ``await start()`` / ``await stop()`` inside an event loop, or
    :class:`BackgroundServer` to run it on a thread.
    """

    def __init__(self, config: ServeConfig):
        super().__init__(config)
        self.actors: dict[str, object] = {}
        self.redis = None              # the embedded redis-server, if any
        self.supervisor = None
        self.planner = None            # the planner candidate (autoscale), if any
        self.pool_controller = None
        self._spawned = 0
        self.core_board: str | None = None     # lend_idle_cores: the board's file
        self._announcer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV

        # Every KV pair's sender proves this secret to its receiver; set
        # TANDEM_CLUSTER_SECRET to share one across `tandem serve` processes.
        self.cluster_secret = os.environ.get(CLUSTER_SECRET_ENV) or secrets.token_hex(32)

    def _spawn(self, worker_id: str):
        """Start the Ray actor of ``worker_id`` (``prefill-i``, ``decode-i``, ``colocated-i``)
        with its cores, threads, engine config, placement and control-plane config."""
        import ray

        from tandem.control.worker_control import ControlConfig
        from tandem.decode_worker.worker import DecodeWorker
        from tandem.prefill_worker.worker import PrefillWorker

        cfg = self.config
        role, index = worker_id.rsplit("-", 1)
        pre_cpus, dec_cpus, threads = _plan_cpus(cfg)
        planned = pre_cpus if role == "prefill" else dec_cpus
        # A worker added by the planner beyond the initial pools is not pinned.
        cpus = planned[int(index)] if int(index) < len(planned) else None
        lending = None
        if self.core_board is not None:
            # Not pinned: its share of threads, more while its peers are idle.
            slots = _lending_slots(cfg)
            if worker_id in slots:
                from tandem.engine.runtime.core_lending import CoreLendingConfig

                lending = CoreLendingConfig(self.core_board, list(slots).index(worker_id),
                                            tuple(slots.values()),
                                            max_threads=len(os.sched_getaffinity(0)))
                threads, cpus = slots[worker_id], None
        engine = (cfg.prefill_engine or cfg.engine) if role == "prefill" else cfg.engine
        if role == "prefill":       # only decode steps speculate: no draft model to load there
            engine = dataclasses.replace(engine, speculative=None)
        engine = dataclasses.replace(engine, num_threads=_rank_threads(
            (threads or len(cpus or [])) or None, engine.tensor_parallel_size))
        self._spawned += 1
        name = f"{cfg.namespace}:{worker_id}:{self._spawned}"
        try:        # a replacement outranks its predecessor even if Redis lost the counter
            floor = self.registry.get(worker_id).generation + 1
        except KeyError:
            floor = 0
        control = ControlConfig(self.state_url, cfg.namespace, name, cfg.lease_ttl_s,
                                max(0.1, cfg.lease_ttl_s / 3.3), floor, self.cluster_secret)
        opts = {**actor_options(role, engine, require_resource=cfg.autoscale is not None),
                "name": name, "namespace": "tandem"}
        if role == "prefill":
            return ray.remote(PrefillWorker).options(**opts).remote(
                worker_id, engine, cpus, cfg.kv_transport, cfg.transfer_timeout_s, control,
                engine_nice=cfg.engine_nice, core_lending=lending)
        return ray.remote(DecodeWorker).options(**opts).remote(
            worker_id, engine, role, cpus, cfg.kv_transport, cfg.transfer_timeout_s, control,
            engine_nice=cfg.engine_nice, core_lending=lending)
    def _worker_ids(self) -> list[str]:
        cfg = self.config
        if cfg.mode == "colocated":
            return [f"colocated-{i}" for i in range(cfg.num_decode)]
        return ([f"decode-{i}" for i in range(cfg.num_decode)]
                + [f"prefill-{i}" for i in range(cfg.num_prefill)])

    @staticmethod
    async def _wire_kv(prefill: WorkerHandle, decode: WorkerHandle) -> None:
        """Open ``decode``'s KV channel for this incarnation of ``prefill`` and connect
        ``prefill`` to it (the layouts are checked first: KVLayoutMismatchError names
        the fields). The channel accepts only transfers carrying ``prefill``'s
        generation (KV fencing)."""
        rdv = await decode.client.open_kv_channel(prefill.worker_id, prefill.generation,
                                                  prefill.info["kv_layout"])
        await prefill.client.connect_kv(decode.worker_id, rdv, decode.info["kv_layout"],
                                        prefill.generation)

    async def _start_worker(self, worker_id: str) -> WorkerHandle:
        """Spawn a worker and wait for its first answer.

        Raises:
            ValueError: the worker's engine refused the configuration (the message of
                the ``ValueError`` its constructor raised, e.g. ``activation_quantization``
                int8 on a dense model), instead of Ray's ``ActorDiedError``.
            ClusterStateUnavailable: the worker could not register because Redis is
                unreachable (the message names Redis, not the worker).
        """
        from ray.exceptions import RayActorError

        from tandem.control.state import ClusterStateUnavailable

        actor = self._spawn(worker_id)
        self.actors[worker_id] = actor
        try:
            info = await actor.info.remote()
        except RayActorError as exc:
            unreachable = worker_state_error(exc)
            if unreachable is not None:
                raise ClusterStateUnavailable(self.state.address,
                                              f"worker {worker_id} cannot register") from None
            cause = worker_config_error(exc)
            if cause is None:
                raise
            raise ValueError(cause) from None
        return WorkerHandle(worker_id, info["role"], actor, info,
                            generation=info.get("generation", 0))

    async def start(self) -> "TandemServer":
        """Start everything; returns once the router answers and health is SERVING.

        Raises:
            KVLayoutMismatchError: prefill and decode caches disagree (message names
                each differing field with both values).
            RuntimeError: redis-server cannot be started.
            ClusterStateUnavailable: the ``redis_url`` Redis does not answer (checked
                before Ray starts), or a worker could not register in it.
        """
        from tandem.control.redis_server import EmbeddedRedis
        from tandem.control.state import ClusterState
        from tandem.router.supervisor import Supervisor

        url = self.config.redis_url
        if url:
            probe = ClusterState(url, self.config.namespace)
            try:
                await asyncio.to_thread(probe.check, "tandem serve keeps the cluster state there")
            finally:
                probe.close()
        init_ray(self.config.ray_address)
        if not url:
            # On an existing Ray cluster the workers may run on other machines: listen on
            # this node's address (no auth: use --redis-url for a managed Redis).
            import ray

            host = ray.util.get_node_ip_address() if self.config.ray_address else "127.0.0.1"
            self.redis = await asyncio.to_thread(EmbeddedRedis(host=host).start)
            url = self.redis.url
            loop = asyncio.get_running_loop()
            # Supervised like a worker: restarted on the same port when it dies.
            self.redis.supervise(on_restart=lambda rec: loop.call_soon_threadsafe(
                self._redis_restarted, rec))
        self.state_url = url
        self._connect_state(url)
        if self.config.lend_idle_cores:
            from tandem.engine.runtime.core_lending import create_board

            self.core_board = create_board(len(_lending_slots(self.config)))
        try:
            handles = await asyncio.gather(*(self._start_worker(w) for w in self._worker_ids()))
            prefill = [h for h in handles if h.role == "prefill"]
            decode = [h for h in handles if h.role != "prefill"]
            # KV channels: every prefill worker to every decode worker.
            for d in decode:
                for p in prefill:
                    await self._wire_kv(p, d)
        except BaseException:
            await self._kill_actors()
            self._stop_redis()
            self._remove_core_board()
            raise
        import ray

        self._ray_gcs = ray.get_runtime_context().gcs_address
        self.state.redis.set(self.state.key("ray_address"), self._ray_gcs)
        self._announcer = asyncio.ensure_future(self._announce())
        for h in decode + prefill:
            self.registry.add(h)
        await self._start_router()
        if self.config.autoscale is not None:
            self._start_planner()
        if self.config.supervise:
            self.supervisor = Supervisor(self.registry, self.restart_worker,
                                         on_restarted=lambda r: self.metrics.worker_restarted(
                                             r.worker_id))
            self.supervisor.start()
        logger.info("tandem serving on %s:%d (%s, %d prefill, %d decode)", self.config.host,
                    self.port, self.config.mode, len(prefill), len(decode))
        return self

    async def restart_worker(self, worker_id: str) -> None:
        """Start a fresh worker in place of ``worker_id`` (e.g. after it died), wire its
        KV channels and put it back in service; health returns to SERVING when both
        kinds are alive again."""
        import ray

        old = self.actors.pop(worker_id, None)
        if old is not None:
            try:
                ray.kill(old)
            except Exception as exc:   # already gone: that is why we restart it
                logger.debug("kill %s: %s", worker_id, exc)
        await self._bring_up(worker_id)

    async def _bring_up(self, worker_id: str) -> WorkerHandle:
        """Start ``worker_id``'s actor, wire its KV channels to the live workers of the
        other kind, put it in service. On failure its actor (if any) is killed."""
        import ray

        self.registry.starting.add(worker_id)
        try:
            handle = await self._start_worker(worker_id)
            if handle.role == "prefill":
                for d in self.cluster.decode:
                    if d.alive:
                        await self._wire_kv(handle, d)
            else:
                for p in self.cluster.prefill:
                    if p.alive:
                        await self._wire_kv(p, handle)
            self.cluster.replace(handle)
            return handle
        except BaseException:
            actor = self.actors.pop(worker_id, None)
            if actor is not None:
                try:
                    ray.kill(actor)
                except Exception as exc:
                    logger.debug("kill %s: %s", worker_id, exc)
            raise
        finally:
            self.registry.starting.discard(worker_id)

    async def add_worker(self, role: str) -> WorkerHandle:
        """Scale up: start one more ``prefill`` or ``decode`` worker, under the first
        free id of its pool, and put it in service once its KV channels are wired.

        Its actor asks for the pool's Ray resource when the cluster autoscales, so
        it stays pending (this call waits) until the Ray autoscaler has added a node.

        Raises:
            ValueError: ``role`` is neither ``prefill`` nor ``decode``.
            ray.exceptions.RayError: the actor could not be started.
        """
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: expected prefill or decode, got {role!r}")
        taken = {w.worker_id for w in self.registry.workers()} | set(self.actors) \
            | self.registry.starting
        index = next(i for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        return await self._bring_up(f"{role}-{index}")

    async def retire_worker(self, worker_id: str, drain_timeout_s: float | None = None) -> int:
        """Scale down: take ``worker_id`` out of service without failing a request.

        The worker is marked draining in the cluster state (every router stops
        sending it requests within a registry refresh); its requests may finish
        for up to ``drain_timeout_s`` (default: the config's). Decode requests
        still running then are migrated to other decode workers (they resume from
        their journal, token-exact); a prefill still running is retried elsewhere
        by the router that sent it. Then the worker deregisters and its actor is
        killed, and Ray's autoscaler may remove its idle node.

        Returns:
            How many of its requests were still in flight when it went (migrated).

        Raises:
            KeyError: no such worker.
            ValueError: it is the last live worker of its pool.
        """
        import ray

        w = self.registry.get(worker_id)
        pool = "prefill" if w.role == "prefill" else "decode"
        if not [o for o in self.registry.alive(pool) if o.worker_id != worker_id]:
            raise ValueError(f"worker_id: {worker_id} is the last live {pool} worker")
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await asyncio.to_thread(self.state.set_draining, worker_id, w.generation)
        w.draining = True
        deadline = time.monotonic() + timeout
        left = await self._in_flight(w)
        # Other routers see the flag on their next refresh (about a second).
        settle = time.monotonic() + min(timeout, 2.0)
        while time.monotonic() < deadline and (left or time.monotonic() < settle):
            await asyncio.sleep(0.25)
            left = await self._in_flight(w)
        logger.info("retiring %s: %d requests left after draining", worker_id, left)
        self.registry.retiring.add(worker_id)
        try:
            self.registry.remove(worker_id)    # this router's requests on it migrate now
            actor = self.actors.pop(worker_id, None)
            if actor is not None:
                try:           # deregisters: every other router migrates its requests too
                    await asyncio.wait_for(actor.shutdown.remote(), 10)
                except Exception as exc:
                    logger.debug("%s shutdown: %s", worker_id, exc)
                ray.kill(actor)
            await asyncio.to_thread(self._forget, worker_id)
        finally:
            self.registry.retiring.discard(worker_id)
        return left

    async def _in_flight(self, w: WorkerHandle) -> int:
        """Requests ``w`` still has: running or waiting in its engine, reserved on it
        by any router (decode), or sent to it by this router (prefill)."""
        try:
            stats = await w.client.stats()
            running = stats.num_running + stats.num_waiting + stats.num_swapped
        except Exception as exc:       # gone already: nothing left to wait for
            logger.debug("stats of %s: %s", w.worker_id, exc)
            return 0
        if w.role == "prefill":
            return running + (1 if w.inflight_prefill_tokens else 0)
        try:
            reserved = (await asyncio.to_thread(
                self.cluster.reservations.inflight, "decode", [w.worker_id]))[w.worker_id]
        except Exception:
            reserved = 0
        return max(running, reserved)

    def _forget(self, worker_id: str) -> None:
        from tandem.control.load_reports import LoadReader

        try:
            self.state.clear_draining(worker_id)
            LoadReader(self.state).forget_workers([worker_id])
        except Exception as exc:
            logger.warning("clearing %s from the cluster state failed: %s", worker_id, exc)

    def _start_planner(self) -> None:
        """The planner candidate of this cluster (leader elected in the cluster state)
        and the controller that applies its plans to this server's Ray actors."""
        from tandem.control.election import LeaderElection
        from tandem.control.load_reports import LoadReader
        from tandem.control.planner import Planner
        from tandem.router.autoscaler import RayPoolController

        cfg = self.config.autoscale
        self.pool_controller = RayPoolController(self)
        self.planner = Planner(cfg, LoadReader(self.state), self.pool_controller,
                               LeaderElection(self.state, "planner", cfg.leader_ttl_s),
                               on_interval=lambda sizes, ds: self.metrics.pools(
                                   sizes, {d.pool: d.target for d in ds}))
        self.planner.start()

    async def reconnect_kv(self, prefill_id: str, decode_id: str) -> None:
        """(Re-)create the KV pair between two live workers."""
        p = next(w for w in self.cluster.prefill if w.worker_id == prefill_id)
        d = next(w for w in self.cluster.decode if w.worker_id == decode_id)
        await self._wire_kv(p, d)

    async def _announce(self, interval_s: float = 2.0) -> None:
        """Keep the Ray address in the cluster state (Redis may restart empty), so
        `tandem router` can always join."""
        while True:
            await asyncio.sleep(interval_s)
            await self._announce_once()

    async def _announce_once(self) -> None:
        try:
            await asyncio.to_thread(self.state.redis.set, self.state.key("ray_address"),
                                    self._ray_gcs)
        except Exception as exc:
            logger.debug("announcing the Ray address failed: %s", exc)

    def _redis_restarted(self, rec) -> None:
        """The supervised embedded Redis came back empty (on the router's loop): what
        this process writes (the Ray address) is written again now rather than at its
        next period. The workers re-assert their records and leases at their next
        renewal, and every router's registry, seeing the new epoch at its next
        refresh (about a second), gives them the grace to."""
        logger.warning("cluster state: redis-server pid %d died (exit code %s) and was "
                       "restarted as pid %d in %.2f s; the cluster state is re-asserted",
                       rec.old_pid, rec.exit_code, rec.new_pid, rec.down_s)
        if self._announcer is None:       # still starting: start() announces it
            return
        self._background_task(self._announce_once())

    def _background_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.planner is not None:
            await self.planner.stop()
        if self.pool_controller is not None:
            await self.pool_controller.stop()
        if self._announcer is not None:
            self._announcer.cancel()
        if self.supervisor is not None:
            await self.supervisor.stop()
        await super().stop(grace_s)
        await self._kill_actors()
        self._stop_redis()
        self._remove_core_board()

    def _stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def _remove_core_board(self) -> None:
        if self.core_board is not None:
            from tandem.engine.runtime.core_lending import remove_board

            remove_board(self.core_board)
            self.core_board = None

    async def _kill_actors(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to shut down, all at once and for at most ``timeout_s``
        seconds together (a busy worker finishes its step first), then kill them: a
        stop under load stays bounded, whatever the number of workers."""
        import ray

        actors, self.actors = list(self.actors.values()), {}
        results = await asyncio.gather(
            *(asyncio.wait_for(a.shutdown.remote(), timeout_s) for a in actors),
            return_exceptions=True)
        for a, res in zip(actors, results):
            if isinstance(res, BaseException):
                logger.debug("worker shutdown: %r", res)
            ray.kill(a)


class BackgroundServer:
    """Runs a :class:`TandemServer` on its own thread and event loop (tests, benchmarks).

    Raises (from the constructor):
        whatever start-up raised (e.g. a KV layout mismatch).
    """

    def __init__(self, config: ServeConfig, start_timeout_s: float = 300.0):
        self.loop = asyncio.new_event_loop()
        self.server = TandemServer(config)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="tandem-router")
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(start_timeout_s)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            raise

    @property
    def address(self) -> str:
        return f"{self.server.config.host}:{self.server.port}"

    def run(self, awaitable, timeout_s: float = 120.0):
        """Await ``awaitable`` (a coroutine, or a Ray ObjectRef) on the server's loop."""
        async def wait():
            return await awaitable
        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout_s)

    def stop(self) -> None:
        try:
            self.run(self.server.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
