"""All-reduce of CPU tensors through shared memory, for the ranks of one machine.

A tensor-parallel decode step runs ``2 L + 1`` all-reduces of a few KiB each (61
for SmolLM2-135M). Gloo's go through loopback TCP sockets: about 0.1-0.4 ms
each on 2 cores, more than the layer's matmuls at small batches. Ranks on one
machine can instead meet in a shared mapping, as vLLM's CPU backend and SGLang's
do: each rank copies its tensor into its slot, publishes a sequence number, waits
until every rank published it, and sums the slots **in rank order** (so every
rank gets the same bits).

Layout of the mapping (one per group)::

    flags  [W, 8] int64     rank r's last published sequence number at [r, 0]
                            (one 64-byte line per rank: no false sharing)
    data   [2, W, S] bytes  two generations of one S-byte slot per rank

Sequence number ``g`` uses generation ``g % 2``. A rank can overwrite its slot of
generation ``g % 2`` again only at ``g + 2``, after it saw every rank publish
``g + 1``, which each does only after summing ``g``'s slots: no rank reads a slot
while it is rewritten. Publishing is a plain aligned 8-byte store after the copy
returned; x86-64 keeps stores in program order, which is the ordering this relies
on (other CPUs would need fences: :func:`available` says where it runs).
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from typing import Callable

import numpy as np
import torch

_FLAG_STRIDE = 8        # int64s per rank's flag line (64 bytes)
_SPINS_BEFORE_YIELD = 64
_PEER_CHECK_INTERVAL_S = 0.05


def available() -> bool:
    """Whether this CPU's memory ordering is the one the protocol relies on (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def create_segment(world_size: int, slot_bytes: int) -> str:
    """Create a zeroed shared file for a group (rank 0); returns its path (in
    ``/dev/shm`` where it exists). The caller unlinks it once every rank mapped it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="tandem-tp-", dir=folder)
    try:
        os.ftruncate(fd, _segment_bytes(world_size, slot_bytes))
    finally:
        os.close(fd)
    return path


def _segment_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * _FLAG_STRIDE * 8 + 2 * world_size * slot_bytes


class SharedMemoryAllReduce:
    """One rank's end of the shared mapping (module docstring).

    Args:
        path: the group's file (:func:`create_segment`).
        rank, world_size: this rank and the group's size.
        slot_bytes: the largest tensor (bytes) :meth:`all_reduce` takes.
        timeout_s: how long a rank waits for the others before it raises.
        peer_check: called about every 50 ms while a rank waits; it raises when a
            peer's process is gone (rank 0 polls the processes it started), so a
            dead rank ends the wait at once instead of after ``timeout_s``.
    """

    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int,
                 timeout_s: float, peer_check: Callable[[], None] | None = None):
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_s = timeout_s
        self._peer_check = peer_check
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _segment_bytes(world_size, slot_bytes))
        flag_bytes = world_size * _FLAG_STRIDE * 8
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=world_size * _FLAG_STRIDE
                                    ).reshape(world_size, _FLAG_STRIDE)[:, 0]
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=flag_bytes,
                                      count=2 * world_size * slot_bytes
                                      ).view(2, world_size, slot_bytes)
        self._seq = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` can go this way: a contiguous CPU tensor of at most
        ``slot_bytes`` bytes."""
        return (tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= self.slot_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (rank order; the same bits on every
        rank); it must :meth:`fits`.

        Raises:
            RuntimeError: a rank did not publish within ``timeout_s`` (gone), or
                what ``peer_check`` raised.
        """
        self._seq += 1
        seq, n = self._seq, tensor.numel() * tensor.element_size()
        slots = self._data[seq % 2, :, :n]
        flat = tensor.view(-1)
        slots[self.rank].view(tensor.dtype).copy_(flat)
        self._flags[self.rank] = seq
        self._wait(seq)
        out = slots[0].view(tensor.dtype)
        flat.copy_(out)
        for r in range(1, self.world_size):
            flat.add_(slots[r].view(tensor.dtype))
        return tensor

    def _wait(self, seq: int) -> None:
        flags, spins, deadline, next_check = self._flags, 0, None, 0.0
        while flags.min() < seq:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()        # a peer may be waiting for this core
                if spins % 4096 == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if self._peer_check is not None and now >= next_check:
                        next_check = now + _PEER_CHECK_INTERVAL_S
                        self._peer_check()
                    if now > deadline:
                        raise RuntimeError(f"shared-memory all-reduce: ranks "
                                           f"{np.flatnonzero(flags < seq).tolist()} did not "
                                           f"arrive within {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self._map is not None:
            self._flags = self._data = None
            try:
                self._map.close()
            except BufferError:      # a tensor view is still alive: the OS unmaps at exit
                pass
            self._map = None
