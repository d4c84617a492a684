"""The collectives a tensor-parallel group runs, behind one small interface.

A tensor-parallel engine is a group of ranks, each holding a shard of every layer
(:mod:`tandem.engine.parallel.layers`). They meet in three collectives: the
row-parallel layers' **all-reduce** (sum), the vocabulary-parallel LM head's
**gather** of logits to rank 0 (or **all-gather**), and rank 0's **broadcast** of
each step's model input (:mod:`tandem.engine.parallel.worker`). Expert
parallelism's all-to-all dispatch adds the **all-to-all** of rows
(:func:`~tandem.engine.model.moe.dispatched_experts`). A
:class:`Communicator` is that interface; layers and the step loop call it and
never ``torch.distributed`` directly, so the transport is one swappable part:

- :class:`SingleProcessCommunicator`: ``world_size`` 1, every collective the
  identity (what a tensor-parallel layer sees when it runs alone: the unit tests);
- :class:`TorchDistributedCommunicator`: a ``torch.distributed`` process group,
  Gloo on the CPU, NCCL on CUDA. The group is built directly over a
  ``PrefixStore`` of a ``TCPStore`` (no global ``init_process_group``), so two
  engines, or an engine and a KV transport, can live in one process. On the CPU,
  all-reduces of up to :data:`SHM_ALL_REDUCE_BYTES` go through shared memory
  instead of Gloo's sockets (:mod:`tandem.engine.parallel.shm_all_reduce`): the
  ranks of one engine share a machine.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

from tandem.engine.parallel import shm_all_reduce

INLINE_OBJECT_BYTES = 16 << 10
""":meth:`TorchDistributedCommunicator.broadcast_object` sends a pickled object of
up to this many bytes (a decode step's model input is a few hundred) in one
broadcast of a fixed-size buffer; a larger one takes a second broadcast."""

_LENGTH_BYTES = 8

SHM_ALL_REDUCE_BYTES = 4 << 20
"""Largest all-reduce (bytes per rank) the CPU ranks run through shared memory: a
decode step's (``batch x hidden`` activations) and prefill chunks up to 1,820
tokens at SmolLM2's hidden size in float32; larger ones go through Gloo."""

PEER_EXIT_GRACE_S = 2.0
"""After a Gloo collective failed, how long (seconds) rank 0 looks for a rank that
exited before it re-raises Gloo's error as it is: a killed peer's sockets close a
moment before its exit can be reaped."""


class RankDiedError(RuntimeError):
    """A rank of the group is gone (its process exited): the group cannot run another
    collective, and the engine it serves cannot step again.

    Attributes:
        rank: the rank that exited; exit_code: its process's exit status (negative:
            the signal that ended it, as ``subprocess`` reports it).
    """

    def __init__(self, rank: int, exit_code: int, message: str | None = None):
        super().__init__(message or f"tensor-parallel rank {rank} exited with code {exit_code}")
        self.rank, self.exit_code = rank, exit_code


class RankHungError(RankDiedError):
    """A rank's process lives but stopped answering (no heartbeat for ``silent_s``
    seconds: stopped, or stuck outside Python); rank 0 killed it, so the group ends
    as for a rank that died."""

    def __init__(self, rank: int, exit_code: int, silent_s: float):
        super().__init__(rank, exit_code, f"tensor-parallel rank {rank} stopped answering (no "
                                          f"heartbeat for {silent_s:.1f} s); killed it")
        self.silent_s = silent_s


class Communicator(ABC):
    """The collectives of one tensor-parallel group, seen from one rank.

    Every rank must call the same collectives in the same order (they block
    until all ranks arrived); tensors must have the same shape and dtype on every
    rank unless a method says otherwise.
    """

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. Every rank ends
        with the same values, bit for bit.

        Raises:
            RuntimeError: a rank left the group (the transport's error).
        """

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order, on
        every rank (a new tensor)."""

    @abstractmethod
    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order, on rank
        ``dst``; None on the other ranks."""

    @abstractmethod
    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Rows exchanged between every pair of ranks: this rank's ``tensor`` ``[n,
        ...]`` is cut into ``send_counts[d]`` consecutive rows for rank ``d`` (in rank
        order, ``sum(send_counts) == n``); the result is ``[sum(recv_counts), ...]``,
        rank ``s``'s rows for this rank in rank order. Counts may be zero; the
        counts of a pair must agree (rank ``s``'s ``send_counts[d]`` is rank ``d``'s
        ``recv_counts[s]``). Shapes past dim 0 and the dtype equal on every rank."""

    @abstractmethod
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (``obj`` is ignored
        elsewhere; rank ``src`` gets its own object back, not a copy)."""

    def close(self) -> None:
        """Release the transport (idempotent); collectives fail afterwards."""


class SingleProcessCommunicator(Communicator):
    """``world_size`` 1: every collective returns its input."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def all_reduce(self, tensor):
        return tensor

    def all_gather(self, tensor, dim=-1):
        return tensor

    def gather(self, tensor, dst=0, dim=-1):
        return tensor

    def all_to_all(self, tensor, send_counts, recv_counts):
        return tensor

    def broadcast_object(self, obj=None, src=0):
        return obj


class TorchDistributedCommunicator(Communicator):
    """A ``torch.distributed`` process group of ``world_size`` ranks.

    Args:
        store: the group's rendezvous store (a ``TCPStore``, or a ``PrefixStore``
            over one); every rank passes a store of the same name.
        rank, world_size: this rank and the group's size.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors; each rank on its
            own device).
        device: where :meth:`broadcast_object` stages its bytes: ``cpu`` for Gloo,
            this rank's CUDA device for NCCL.
        host: the address Gloo binds on this machine (loopback by default: ranks of
            one engine share a machine).
        timeout_s: how long a collective waits for the other ranks.
        shm_all_reduce_bytes: Gloo: all-reduce CPU tensors of up to this many bytes
            through a shared mapping (every rank on this machine; x86-64); 0: always
            through Gloo.
        peer_check: raises :class:`RankDiedError` when another rank's process has
            exited (rank 0, which started them, passes one). Called while a
            shared-memory all-reduce waits (about every 50 ms) and after a Gloo
            collective fails, so a dead rank is reported within moments instead of
            after ``timeout_s``.

    Blocks until every rank constructed its end.

    Attributes:
        calls, bytes: per collective (``all_reduce``, ``all_gather``, ``gather``,
            ``broadcast``), how many ran on this rank and the bytes of this rank's
            input to them (a broadcast counts its buffer): what
            ``benchmarks/tensor_parallel.py`` reads. Never reset.

    Raises:
        ValueError: an unknown backend, or a rank outside ``[0, world_size)``.
        RuntimeError: the group did not form within ``timeout_s``.
        RankDiedError: (any collective, with ``peer_check``) another rank exited.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str = "gloo",
                 device: torch.device | str = "cpu", host: str = "127.0.0.1",
                 timeout_s: float = 1800.0, shm_all_reduce_bytes: int = SHM_ALL_REDUCE_BYTES,
                 peer_check: Callable[[], None] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} outside [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self._peer_check = peer_check
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            self.group = dist.ProcessGroupGloo(store, rank, world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._buffer = torch.empty(_LENGTH_BYTES + INLINE_OBJECT_BYTES, dtype=torch.uint8,
                                   device=self.device)
        self._shm = None
        if backend == "gloo" and shm_all_reduce_bytes > 0 and shm_all_reduce.available():
            self._shm = self._map_shared_segment(store, shm_all_reduce_bytes, timeout_s)

    def _map_shared_segment(self, store: dist.Store, slot_bytes: int, timeout_s: float):
        """Rank 0 creates the group's file and names it in the store; every rank maps
        it; once all did (a barrier), rank 0 unlinks it (the mappings stay)."""
        path = shm_all_reduce.create_segment(self.world_size, slot_bytes) if self.rank == 0 \
            else None
        try:
            if self.rank == 0:
                store.set("shm_all_reduce/path", path)
            else:
                path = store.get("shm_all_reduce/path").decode()
            shm = shm_all_reduce.SharedMemoryAllReduce(path, self.rank, self.world_size,
                                                       slot_bytes, timeout_s, self._peer_check)
            self.group.barrier().wait()
        finally:
            if self.rank == 0:
                os.unlink(path)
        return shm

    def _run(self, collective: Callable[[], Any]) -> None:
        """Start a Gloo / NCCL collective and wait for it; a failure caused by a rank
        that exited becomes :class:`RankDiedError` (with ``peer_check``)."""
        try:
            collective().wait()
        except RuntimeError as exc:      # Gloo: "Connection closed by peer", ...
            if self._peer_check is not None:
                deadline = time.monotonic() + PEER_EXIT_GRACE_S
                while True:
                    try:
                        self._peer_check()
                    except RankDiedError as died:
                        raise died from exc
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            raise

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor):
        self._count("all_reduce", tensor)
        if self._shm is not None and self._shm.fits(tensor):
            return self._shm.all_reduce(tensor)
        self._run(lambda: self.group.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor, dim=-1):
        tensor = tensor.contiguous()
        self._count("all_gather", tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run(lambda: self.group.allgather([parts], [tensor]))
        return torch.cat(parts, dim=dim)

    def gather(self, tensor, dst=0, dim=-1):
        tensor = tensor.contiguous()
        self._count("gather", tensor)
        opts = dist.GatherOptions()
        opts.rootRank = dst
        if self.rank == dst:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._run(lambda: self.group.gather([parts], [tensor], opts))
            return torch.cat(parts, dim=dim)
        self._run(lambda: self.group.gather([], [tensor], opts))
        return None

    def all_to_all(self, tensor, send_counts, recv_counts):
        tensor = tensor.contiguous()
        self._count("all_to_all", tensor)
        out = tensor.new_empty(sum(recv_counts), *tensor.shape[1:])
        self._run(lambda: self.group.alltoall_base(out, tensor, list(recv_counts),
                                                   list(send_counts), dist.AllToAllOptions()))
        return out

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._count("broadcast", tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._run(lambda: self.group.broadcast([tensor], opts))

    def broadcast_object(self, obj=None, src=0):
        buf = self._buffer
        if self.rank == src:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(payload)
            head = n.to_bytes(_LENGTH_BYTES, "little") + payload[:INLINE_OBJECT_BYTES]
            buf[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
            self._broadcast(buf, src)
            if n > INLINE_OBJECT_BYTES:
                rest = torch.frombuffer(bytearray(payload[INLINE_OBJECT_BYTES:]),
                                        dtype=torch.uint8).to(self.device)
                self._broadcast(rest, src)
            return obj
        self._broadcast(buf, src)
        raw = buf.cpu().numpy().tobytes()
        n = int.from_bytes(raw[:_LENGTH_BYTES], "little")
        payload = raw[_LENGTH_BYTES:_LENGTH_BYTES + min(n, INLINE_OBJECT_BYTES)]
        if n > INLINE_OBJECT_BYTES:
            rest = torch.empty(n - INLINE_OBJECT_BYTES, dtype=torch.uint8, device=self.device)
            self._broadcast(rest, src)
            payload += rest.cpu().numpy().tobytes()
        return pickle.loads(payload)

    def close(self):
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is not None:
            shm.close()
        group, self.group = getattr(self, "group", None), None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError:     # already torn down by a peer's exit
                pass
