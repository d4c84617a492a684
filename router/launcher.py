"""Starts a Tandem cluster: Ray actors for the workers, KV channels between them, the router.

``tandem serve`` and the tests use :class:`TandemServer`. With no Ray address an
embedded cluster is started on this machine (``ray.init()``); the default is one
prefill and one decode actor and the router on 127.0.0.1:50051.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field

from tandem.engine.config import EngineConfig

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
        metrics_port: HTTP port for ``/metrics`` and ``/health`` (None = off, 0 = any).
        ray_address: an existing Ray cluster, or None for an embedded one.
        transfer_timeout_s: seconds a KV transfer may take before it counts as failed.
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
    metrics_port: int | None = None
    ray_address: str | None = None
    transfer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode: expected disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError("num_prefill/num_decode: need at least one worker of each kind")


def _plan_cpus(cfg: ServeConfig) -> tuple[list[list[int] | None], list[list[int] | None], int]:
    """Cores per prefill and decode worker, and torch threads each."""
    cores = sorted(os.sched_getaffinity(0))
    n_workers = cfg.num_decode + (cfg.num_prefill if cfg.mode == "disaggregated" else 0)
    if not cfg.cpu_affinity or cfg.mode == "colocated" or len(cores) < 2:
        threads = max(1, len(cores) // n_workers)
        return [None] * cfg.num_prefill, [None] * cfg.num_decode, threads
    # Prefill workers on the first half of the cores, decode workers on the second half.
    half = len(cores) // 2
    pre, dec = cores[:half], cores[half:]

    def split(pool: list[int], n: int) -> list[list[int]]:
        per = max(1, len(pool) // n)
        return [pool[(i * per) % len(pool):(i * per) % len(pool) + per] for i in range(n)]
    return split(pre, cfg.num_prefill), split(dec, cfg.num_decode), 0


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
        # On a loopback alias: Ray replaces 127.0.0.1 itself by the machine's outbound
        # address, and workers listen for KV on their node's address.
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace="tandem",
                 _node_ip_address=EMBEDDED_NODE_IP,
                 object_store_memory=200 * 1024 * 1024, log_to_driver=True,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"],
                                           "TOKENIZERS_PARALLELISM": "false"}})


def actor_options(role: str, engine: EngineConfig) -> dict:
    """Ray placement for a worker: on a cluster whose nodes advertise a ``prefill`` /
    ``decode`` custom resource (deploy/ray, deploy/kubernetes) each worker takes one
    unit of its kind, and a GPU when it runs on CUDA; an embedded cluster has no such
    resources and any node will do.
    """
    import ray

    opts: dict = {"num_cpus": 0}
    kind = "prefill" if role == "prefill" else "decode"
    if ray.cluster_resources().get(kind, 0) > 0:
        opts["resources"] = {kind: 1}
    if engine.device.startswith("cuda"):
        opts["num_gpus"] = 1
    return opts


class TandemServer:
    """A running cluster: workers, KV channels, router and (optionally) metrics.

    Use ``await start()`` / ``await stop()`` inside an event loop, or
    :class:`BackgroundServer` to run it on a thread.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        self.actors: dict[str, object] = {}
        self.cluster = None
        self.server = None
        self.port: int | None = None
        self.metrics = None
        self.metrics_port: int | None = None
        self.health = None

    def _engine_config(self, cfg: EngineConfig, threads: int) -> EngineConfig:
        return dataclasses.replace(cfg, num_threads=threads or None)

    def _spawn_workers(self):
        import ray

        from tandem.decode_worker.worker import DecodeWorker
        from tandem.prefill_worker.worker import PrefillWorker

        cfg = self.config
        pre_cpus, dec_cpus, threads = _plan_cpus(cfg)
        role = "decode" if cfg.mode == "disaggregated" else "colocated"
        decode = {}
        for i in range(cfg.num_decode):
            wid = f"{role}-{i}"
            t = threads or len(dec_cpus[i] or [])
            decode[wid] = ray.remote(DecodeWorker).options(**actor_options(role, cfg.engine)).remote(
                wid, self._engine_config(cfg.engine, t), role, dec_cpus[i], cfg.kv_transport,
                cfg.transfer_timeout_s)
        prefill = {}
        if cfg.mode == "disaggregated":
            pcfg = cfg.prefill_engine or cfg.engine
            for i in range(cfg.num_prefill):
                wid = f"prefill-{i}"
                t = threads or len(pre_cpus[i] or [])
                prefill[wid] = ray.remote(PrefillWorker).options(
                    **actor_options("prefill", pcfg)).remote(
                    wid, self._engine_config(pcfg, t), pre_cpus[i], cfg.kv_transport,
                    cfg.transfer_timeout_s)
        return prefill, decode

    async def start(self) -> "TandemServer":
        """Start everything; returns once the router answers and health is SERVING.

        Raises:
            KVLayoutMismatchError: prefill and decode caches disagree (message names
                each differing field with both values).
        """
        from grpc_health.v1 import health_pb2

        from tandem.engine.model_files import resolve_model
        from tandem.engine.tokenizer import Tokenizer
        from tandem.router.cluster import Cluster, WorkerHandle
        from tandem.router.metrics import Metrics
        from tandem.router.server import TandemService, start_grpc_server

        init_ray(self.config.ray_address)
        prefill, decode = self._spawn_workers()
        self.actors = {**prefill, **decode}
        try:
            infos = await asyncio.gather(*(a.info.remote() for a in self.actors.values()))
            info = dict(zip(self.actors, infos))
            # KV channels: every prefill worker to every decode worker; layouts checked first.
            for did, dactor in decode.items():
                for pid, pactor in prefill.items():
                    rdv = await dactor.open_kv_channel.remote(pid)
                    await pactor.connect_kv.remote(did, rdv, info[did]["kv_layout"])
        except BaseException:
            await self._kill_actors()
            raise
        tokenizer = await asyncio.to_thread(Tokenizer, resolve_model(self.config.engine.model))
        first = info[next(iter(decode))]
        model_info = {k: first[k] for k in ("model_name", "max_model_len", "block_size", "dtype")}
        model_info["vocab_size"] = first["model_vocab_size"]
        self.metrics = Metrics(model_info["model_name"])
        for wid, winfo in info.items():
            self.metrics.register_worker(wid, winfo["role"])
        role = "decode" if prefill else "colocated"
        self.cluster = Cluster(
            [WorkerHandle(w, "prefill", a, info[w]) for w, a in prefill.items()],
            [WorkerHandle(w, role, a, info[w]) for w, a in decode.items()],
            call=lambda method, *args: method.remote(*args),
            on_step=self.metrics.worker_step, on_health=self._set_health)
        self.cluster.start()
        service = TandemService(self.cluster, tokenizer, model_info, self.metrics)
        self.server, self.port, self.health = await start_grpc_server(
            service, self.config.host, self.config.port)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.host, self.config.metrics_port,
                                                       lambda: self.cluster.healthy)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("tandem.v1.Tandem", health_pb2.HealthCheckResponse.SERVING)
        logger.info("tandem serving on %s:%d (%s, %d prefill, %d decode)", self.config.host,
                    self.port, self.config.mode, len(prefill), len(decode))
        return self

    async def restart_worker(self, worker_id: str) -> None:
        """Start a fresh worker in place of ``worker_id`` (e.g. after it died), wire its
        KV channels and put it back in service; health returns to SERVING when both
        kinds are alive again."""
        import ray

        from tandem.decode_worker.worker import DecodeWorker
        from tandem.prefill_worker.worker import PrefillWorker
        from tandem.router.cluster import WorkerHandle

        cfg = self.config
        old = self.actors.pop(worker_id, None)
        if old is not None:
            try:
                ray.kill(old)
            except Exception as exc:   # already gone: that is why we restart it
                logger.debug("kill %s: %s", worker_id, exc)
        pre_cpus, dec_cpus, threads = _plan_cpus(cfg)
        index = int(worker_id.rsplit("-", 1)[1])
        if worker_id.startswith("prefill"):
            t = threads or len(pre_cpus[index] or [])
            pcfg = cfg.prefill_engine or cfg.engine
            actor = ray.remote(PrefillWorker).options(**actor_options("prefill", pcfg)).remote(
                worker_id, self._engine_config(pcfg, t),
                pre_cpus[index], cfg.kv_transport, cfg.transfer_timeout_s)
            role = "prefill"
        else:
            t = threads or len(dec_cpus[index] or [])
            role = "decode" if cfg.mode == "disaggregated" else "colocated"
            actor = ray.remote(DecodeWorker).options(**actor_options(role, cfg.engine)).remote(
                worker_id, self._engine_config(cfg.engine, t), role, dec_cpus[index],
                cfg.kv_transport, cfg.transfer_timeout_s)
        info = await actor.info.remote()
        self.actors[worker_id] = actor
        pairs = ([(worker_id, actor, w.worker_id, w.actor, w.info) for w in self.cluster.decode
                  if w.alive] if role == "prefill" else
                 [(w.worker_id, w.actor, worker_id, actor, info) for w in self.cluster.prefill
                  if w.alive])
        for pid, pactor, did, dactor, dinfo in pairs:
            rdv = await dactor.open_kv_channel.remote(pid)
            await pactor.connect_kv.remote(did, rdv, dinfo["kv_layout"])
        self.cluster.replace(WorkerHandle(worker_id, role, actor, info))

    async def reconnect_kv(self, prefill_id: str, decode_id: str) -> None:
        """(Re-)create the KV pair between two live workers."""
        p = next(w for w in self.cluster.prefill if w.worker_id == prefill_id)
        d = next(w for w in self.cluster.decode if w.worker_id == decode_id)
        rdv = await d.actor.open_kv_channel.remote(prefill_id)
        await p.actor.connect_kv.remote(decode_id, rdv, d.info["kv_layout"])

    def _set_health(self, ok: bool) -> None:
        from grpc_health.v1 import health_pb2

        if self.health is None:
            return
        status = health_pb2.HealthCheckResponse.SERVING if ok else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "tandem.v1.Tandem"):
            asyncio.ensure_future(self.health.set(name, status))

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.cluster is not None:
            await self.cluster.stop()
        if self.metrics is not None:
            self.metrics.close()
        await self._kill_actors()

    async def _kill_actors(self) -> None:
        import ray

        for a in self.actors.values():
            try:
                await asyncio.wait_for(a.shutdown.remote(), 10)
            except Exception as exc:
                logger.debug("worker shutdown: %s", exc)
            ray.kill(a)
        self.actors = {}


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
