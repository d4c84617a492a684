"""Rank 0's handle on a tensor-parallel engine's other ranks: it starts them as
worker processes, forms the group with them, and stops them.

Process model (``EngineConfig.tensor_parallel_size`` ``W`` > 1)::

    caller's process = rank 0                      rank r = 1 .. W-1 (subprocesses)
    ------------------------------                 ----------------------------------
    TensorParallelGroup.start(config)  --spawn-->  python -P -m tandem.engine.parallel.worker
      TCPStore on 127.0.0.1:<OS port>  <--join---    (config, rank, port read from stdin)
      process group (Gloo / NCCL)      <-------->    process group
    load_model(comm) -> shard 0                      load_model(comm) -> shard r
    KV cache sized, WorkerSetup        --bcast-->    KV cache of the same blocks
    scheduler, runner, sampler                       follow(): forward, LM head shard
      each step: StepInput, LogitsRequest --bcast--> (tandem.engine.parallel.messages)

Workers are subprocesses started with ``-m`` (not ``multiprocessing`` spawn): a
script that builds ``LLM(tensor_parallel_size=2)`` needs no ``__main__`` guard.
Each worker keeps its stdin pipe from rank 0 open and exits when it closes, so
no worker outlives its engine's process, however that ends.

A worker that dies is seen by rank 0 within moments: its communicator polls the
workers' processes while a shared-memory all-reduce waits and after a Gloo
collective fails, and raises
:class:`~tandem.engine.parallel.communicator.RankDiedError` (the engine's step
raises it; a serving worker then ends its process, see
:class:`~tandem.engine.runtime.engine_worker.EngineWorker`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.parallel.communicator import (RankDiedError, RankHungError,
                                                 TorchDistributedCommunicator)
from tandem.engine.parallel.messages import Shutdown, WorkerSetup
from tandem.engine.parallel.partition import head_partition

STORE_PREFIX = "tandem-tp"
"""The group's keys and process group live under this prefix of the rendezvous store."""

HEARTBEAT_S = 0.25
"""How often (seconds) each rank 1.. counts up its heartbeat key in the group's store."""

HANG_TIMEOUT_S = 30.0
"""A rank whose heartbeat has not moved for this long (seconds) counts as hung: rank 0
kills it and raises :class:`~tandem.engine.parallel.communicator.RankHungError`.
Far above any pause of a healthy rank (its heartbeat thread needs the GIL only
briefly, and a CPU kernel that holds it runs for well under a second), far below the
group's collective timeout (600 s)."""


@dataclass(frozen=True)
class WorkerInit:
    """What a worker process reads from its stdin (pickled, length-prefixed).

    Attributes:
        config: the engine's config.
        rank, world_size: the worker's rank and the group's size.
        host, port: rank 0's rendezvous ``TCPStore``.
        timeout_s: how long startup and each collective may wait.
        cpus: the cores the worker pins itself to (:func:`rank_cpu_sets`); None:
            it keeps the affinity it inherited.
    """

    config: EngineConfig
    rank: int
    world_size: int
    host: str
    port: int
    timeout_s: float
    cpus: tuple[int, ...] | None = None


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for ``cpu``; for ``cuda[:i]``, GPU ``i + rank``."""
    d = torch.device(device)
    if d.type == "cpu":
        return d
    return torch.device(d.type, (d.index or 0) + rank)


def backend_for(device: torch.device) -> str:
    """The collective backend of a device: ``gloo`` on the CPU, ``nccl`` on CUDA."""
    return "gloo" if device.type == "cpu" else "nccl"


def rank_model_config(cfg: ModelConfig, world_size: int, rank: int) -> ModelConfig:
    """``cfg`` with rank ``rank``'s head counts (what its attention layers and its
    KV cache hold; :func:`~tandem.engine.parallel.partition.head_partition`)."""
    heads = head_partition(cfg.num_heads, cfg.num_kv_heads, world_size, rank)
    return dataclasses.replace(cfg, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)


def rank_cpu_sets(world_size: int, device: str) -> list[tuple[int, ...]] | None:
    """One core set per rank on a CPU device: this process's CPU affinity, sorted, cut
    into ``world_size`` contiguous parts of :func:`threads_per_rank` cores each (what
    cores are left over stay unused, as they are by the thread counts).

    Ranks 1.. pin themselves to theirs, so a rank's OpenMP team never shares a core
    with another rank's, whose spinning or preempted thread would hold up its
    parallel regions and the shared-memory all-reduce that every rank waits in
    (vLLM's CPU workers bind each rank's OpenMP threads to its own cores the same
    way). Rank 0 runs in the caller's process, whose affinity is the caller's
    choice (a serving worker's ``--cpu-affinity``), and keeps it.

    Returns:
        ``world_size`` tuples of core ids, or None on a GPU device or when the
        process has fewer cores than ranks (they then share all of them).
    """
    cores = sorted(os.sched_getaffinity(0))
    if torch.device(device).type != "cpu" or len(cores) < world_size:
        return None
    per = threads_per_rank(world_size)
    return [tuple(cores[r * per:(r + 1) * per]) for r in range(world_size)]


def threads_per_rank(world_size: int) -> int:
    """Torch intra-op threads for each rank when none are configured: this process's
    cores (its CPU affinity) shared evenly, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


class TensorParallelGroup:
    """The ranks of one tensor-parallel engine, seen from rank 0 (module docstring).

    Use :meth:`start`; then load rank 0's shard with :attr:`comm`, and call
    :meth:`setup_workers` once the KV cache is sized. :meth:`shutdown` (also run
    when the group is garbage-collected or the process exits) stops the workers.

    Attributes:
        comm: rank 0's :class:`~tandem.engine.parallel.communicator.Communicator`.
        world_size: ranks in the group (``config.tensor_parallel_size``).
    """

    def __init__(self, comm: TorchDistributedCommunicator, store: dist.Store,
                 procs: list[subprocess.Popen], timeout_s: float, watch: RankWatch):
        self.comm, self.world_size = comm, comm.world_size
        self.watch = watch
        """Rank 0's liveness check of ranks 1.. (exits and heartbeats)."""
        self._store, self._procs, self._timeout_s = store, procs, timeout_s
        self._state = {"following": False}
        self._finalizer = weakref.finalize(self, _stop, comm, procs, self._state)

    @classmethod
    def start(cls, config: EngineConfig, timeout_s: float = 600.0) -> "TensorParallelGroup":
        """Start ranks ``1 .. W-1`` as worker processes and form the group with them.

        Returns once every rank joined the process group (the workers then load their
        shards while rank 0 loads its own).

        Raises:
            RuntimeError: a worker exited, or did not join within ``timeout_s``.

        The workers inherit this process's environment; on the CPU each pins itself
        to its own core set (:func:`rank_cpu_sets`). Each runs ``config.num_threads``
        torch threads (default :func:`threads_per_rank`).
        """
        world = config.tensor_parallel_size
        device = rank_device(config.device, 0)
        cpu_sets = rank_cpu_sets(world, config.device)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        procs = []
        try:
            for rank in range(1, world):
                proc = subprocess.Popen([sys.executable, "-P", "-m",
                                         "tandem.engine.parallel.worker"],
                                        stdin=subprocess.PIPE)
                payload = pickle.dumps(WorkerInit(config, rank, world, "127.0.0.1", store.port,
                                                  timeout_s,
                                                  cpu_sets[rank] if cpu_sets else None))
                proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
                proc.stdin.flush()
                procs.append(proc)
            prefixed = dist.PrefixStore(STORE_PREFIX, store)
            _wait_for(prefixed, procs, "joined", "joining the group", timeout_s)
            watch = RankWatch(procs, "127.0.0.1", store.port)
            comm = TorchDistributedCommunicator(prefixed, 0, world, backend_for(device), device,
                                                timeout_s=timeout_s, peer_check=watch)
        except BaseException:
            _stop(None, procs, {"following": False})
            raise
        return cls(comm, store, procs, timeout_s, watch)

    def rank_model_config(self, cfg: ModelConfig) -> ModelConfig:
        """Rank 0's head counts (the most any rank holds: it sizes every rank's KV
        cache blocks); see :func:`rank_model_config`."""
        return rank_model_config(cfg, self.world_size, 0)

    def kv_ranks(self, cfg: ModelConfig):
        """What a KV connector on rank 0 needs of the ranks
        (:class:`~tandem.engine.kv.kv_connector.KVRankGroup`): each rank's KV heads of
        the model ``cfg``, the group's store and a check that the ranks live."""
        from tandem.engine.kv.kv_connector import KVRankGroup

        heads = [head_partition(cfg.num_heads, cfg.num_kv_heads, self.world_size, r)
                 for r in range(self.world_size)]
        return KVRankGroup(tuple((h.kv_start, h.num_kv_heads) for h in heads), "127.0.0.1",
                           self._store.port, self.check_workers)

    def setup_workers(self, num_blocks: int, num_host_blocks: int) -> None:
        """Wait until every worker loaded its shard, then send the KV cache's size;
        the workers then follow each step.

        Raises:
            RuntimeError: a worker failed to load (its error in the message) or exited.
        """
        _wait_for(dist.PrefixStore(STORE_PREFIX, self._store), self._procs, "loaded",
                  "loading its shard", self._timeout_s)
        self.comm.broadcast_object(WorkerSetup(num_blocks, num_host_blocks))
        self._state["following"] = True

    @property
    def worker_exit_codes(self) -> list[int | None]:
        """Ranks 1..'s process exit codes, None while one runs."""
        return [proc.poll() for proc in self._procs]

    @property
    def worker_pids(self) -> list[int]:
        """Ranks 1..'s process ids, in rank order."""
        return [proc.pid for proc in self._procs]

    def check_workers(self) -> None:
        """Raise :class:`~tandem.engine.parallel.communicator.RankDiedError` for the
        first worker whose process has exited, or
        :class:`~tandem.engine.parallel.communicator.RankHungError` for one whose
        heartbeat stood still (:class:`RankWatch`)."""
        self.watch()

    def shutdown(self) -> None:
        """Stop the workers (idempotent): a :class:`~tandem.engine.parallel.messages.Shutdown`
        when they follow steps, then their stdin closed; one still running after 10 s
        is killed."""
        self._finalizer()


class RankWatch:
    """Rank 0's check that ranks 1.. are alive and answering: their processes'
    exit codes and their heartbeats (``hb/<rank>`` in the group's store, counted up
    every :data:`HEARTBEAT_S` by each rank's heartbeat thread). Called by the
    communicator while it waits and by the idle engine loop; heartbeats are read at
    most every :data:`HEARTBEAT_S`.

    Attributes:
        hang_timeout_s: a heartbeat unchanged this long means the rank hangs.
    """

    def __init__(self, procs: list[subprocess.Popen], host: str, port: int):
        self._procs, self._host, self._port = procs, host, port
        self._store: dist.Store | None = None
        self._seen: dict[int, tuple[int, float]] = {}    # rank -> (beat, when it changed)
        self._last_read = 0.0
        self.hang_timeout_s = HANG_TIMEOUT_S

    def __call__(self) -> None:
        """Raises:
            RankDiedError: a rank's process exited.
            RankHungError: a rank's heartbeat stood still for ``hang_timeout_s``
                (the rank is killed first).
        """
        check_workers(self._procs)
        now = time.monotonic()
        if now - self._last_read < HEARTBEAT_S:
            return
        self._last_read = now
        if self._store is None:
            self._store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(
                self._host, self._port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        for rank, proc in enumerate(self._procs, start=1):
            beat = self._store.add(f"hb/{rank}", 0)
            last, since = self._seen.get(rank, (None, now))
            if beat != last:
                self._seen[rank] = (beat, now)
            elif now - since > self.hang_timeout_s:
                proc.kill()
                raise RankHungError(rank, proc.wait(), now - since)


def heartbeat(host: str, port: int, rank: int) -> None:
    """Rank ``rank``'s heartbeat (run on a daemon thread of its process): counts up
    ``hb/<rank>`` in the group's store every :data:`HEARTBEAT_S` seconds, for
    :class:`RankWatch`. Returns when the store is gone."""
    store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=30)))
    while True:
        try:
            store.add(f"hb/{rank}", 1)
        except (RuntimeError, dist.DistError):
            return
        time.sleep(HEARTBEAT_S)


def check_workers(procs: list[subprocess.Popen]) -> None:
    """Raise :class:`~tandem.engine.parallel.communicator.RankDiedError` for the first
    of ranks 1.. (``procs`` in rank order) whose process has exited."""
    for rank, proc in enumerate(procs, start=1):
        code = proc.poll()
        if code is not None:
            raise RankDiedError(rank, code)


def _wait_for(store: dist.Store, procs: list[subprocess.Popen], key: str, what: str,
              timeout_s: float) -> None:
    """Wait until every worker set ``<key>/<rank>`` (``ok``, or an error text)."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, len(procs) + 1))
    while pending:
        for rank in sorted(pending):
            name = f"{key}/{rank}"
            if store.check([name]):
                value = store.get(name).decode()
                if value != "ok":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed {what}: {value}")
                pending.discard(rank)
            elif procs[rank - 1].poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code "
                                   f"{procs[rank - 1].returncode} before {what}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks {sorted(pending)}: no answer after "
                               f"{timeout_s:.0f} s {what}")
        if pending:
            time.sleep(0.02)


def _stop(comm: TorchDistributedCommunicator | None, procs: list[subprocess.Popen],
          state: dict) -> None:
    if comm is not None and state.get("following"):
        state["following"] = False
        try:
            comm.broadcast_object(Shutdown())
        except RuntimeError:     # a worker is gone already: the pipes below end the rest
            pass
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + 10.0
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if comm is not None:
        comm.close()
