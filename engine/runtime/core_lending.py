"""Cores lent between the engine workers of one machine while some of them are idle.

Disaggregated on one small CPU machine, each worker gets a share of the cores:
pinned that way (``--cpu-affinity``), the prefill worker's cores sit idle while
its decode worker steps through long answers, and the decode worker's while the
prompts of its next requests are prefilled; on 2 cores each phase then runs at
half the machine's speed even when the other has nothing to do. Sharing every core
all the time (each worker as many threads as the machine has cores) wins while
one worker is idle and loses badly while both step: two OpenMP teams that
spin-wait on the same cores (``benchmarks/README.md``, "Lending idle cores").

So the workers keep a **core board**: a small file mapped into every worker of
the machine, one byte per worker (its *slot*), 1 while that worker has steps to
run. Before each step a worker sizes torch's intra-op thread pool to its own
share of the cores plus the shares of the workers that are idle now; while it
waits for work it marks itself idle. The workers are not pinned (the operating
system places their threads); when all are busy each runs on its share, as if
pinned. A worker that starts while a peer's step is running on borrowed cores
shares the cores with it until that step ends (the peer sees the new worker busy
before its next step).

The board's file is created and removed by whoever starts the workers
(:func:`create_board`, :func:`remove_board`); a worker only maps it. A worker that
dies while marked busy leaves its slot busy until its replacement (same slot)
marks it idle: its peers only lend less meanwhile.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreLendingConfig:
    """One worker's place on a core board.

    Attributes:
        path: the board's file (:func:`create_board`).
        slot: this worker's byte on the board (0 .. ``len(shares) - 1``).
        shares: every slot's own share of the cores (threads), this one's included.
        max_threads: the most threads a worker takes however many peers are idle
            (the machine's cores, where more workers than cores share them);
            None: the sum of the shares.
    """

    path: str
    slot: int
    shares: tuple[int, ...]
    max_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.shares or any(s < 1 for s in self.shares):
            raise ValueError(f"shares: each slot needs at least one core, got {self.shares}")
        if self.max_threads is not None and self.max_threads < self.shares[self.slot]:
            raise ValueError(f"max_threads: {self.max_threads} is below this slot's share "
                             f"{self.shares[self.slot]}")
        if not 0 <= self.slot < len(self.shares):
            raise ValueError(f"slot: {self.slot} is not one of the board's "
                             f"{len(self.shares)} slots")


def create_board(num_slots: int, directory: str | None = None) -> str:
    """A new board of ``num_slots`` idle slots (zero bytes); returns its path. The file
    lives in ``directory`` (default: ``/dev/shm`` where it exists, so it stays in
    memory, else the temp directory).

    Raises:
        ValueError: ``num_slots`` < 1.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots: must be at least 1, got {num_slots}")
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="tandem-core-board-", dir=directory)
    try:
        os.write(fd, bytes(num_slots))
    finally:
        os.close(fd)
    return path


def remove_board(path: str) -> None:
    """Delete a board's file (workers that still map it keep their mapping)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class CoreLending:
    """One worker's side of the board: marks its slot and sizes its thread pool.

    Call :meth:`busy` from the thread that runs the engine's steps (torch's thread
    count is that thread's OpenMP setting), before a step; :meth:`idle` before
    waiting for work.

    Raises:
        OSError: the board's file cannot be opened or mapped.
        ValueError: the file is shorter than ``config.shares`` has slots.
    """

    def __init__(self, config: CoreLendingConfig, set_threads=None):
        self.config = config
        with open(config.path, "r+b") as f:
            self._board = mmap.mmap(f.fileno(), 0)
        if len(self._board) < len(config.shares):
            size = len(self._board)
            self._board.close()
            raise ValueError(f"{config.path}: a board of {size} slots, "
                             f"expected {len(config.shares)}")
        if set_threads is None:
            import torch
            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self.threads = 0            # what the pool was last sized to (0: not yet)
        self._board[config.slot] = 0

    def lendable(self) -> int:
        """Cores this worker may step on now: its share plus every idle peer's, at
        most ``config.max_threads``."""
        board, shares, me = self._board, self.config.shares, self.config.slot
        n = shares[me] + sum(s for i, s in enumerate(shares) if i != me and board[i] == 0)
        return n if self.config.max_threads is None else min(n, self.config.max_threads)

    def busy(self) -> int:
        """Mark this worker busy and size the thread pool to :meth:`lendable`
        (only when it changes); returns the thread count in effect."""
        self._board[self.config.slot] = 1
        n = self.lendable()
        if n != self.threads:
            self._set_threads(n)
            self.threads = n
        return n

    def idle(self) -> None:
        """Mark this worker idle: its peers may step on its cores."""
        self._board[self.config.slot] = 0

    def close(self) -> None:
        """Mark idle and unmap the board."""
        if not self._board.closed:
            self.idle()
            self._board.close()
