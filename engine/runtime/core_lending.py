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
the machine, one byte per worker (its *slot*): the threads it steps on now, 0
while it waits for work. Before each step a worker claims its own share of the
cores plus the shares of the workers that are idle now, and sizes torch's
intra-op thread pool to that; the claims never add up to more than the machine's
cores (:class:`CoreLending`), so a worker whose cores were lent waits until the
borrower gives them back: after the layer it is computing (the engine calls
:meth:`CoreLending.give_back` between layers), not at the end of its step, which
for a prompt chunk of thousands of tokens is hundreds of milliseconds. The
workers are not pinned (the operating system places their threads); when all are
busy each runs on its share, as if pinned.

The board's file is created and removed by whoever starts the workers
(:func:`create_board`, :func:`remove_board`); a worker only maps it. A worker that
dies while it claims cores leaves them claimed until its replacement (same slot)
releases them: its peers borrow less meanwhile, and one whose own share is held
waits ``max_wait_s`` at most per step.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
import time
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
    """One worker's side of the board: claims its cores before each step.

    Each slot holds the threads its worker steps on now (0: idle). :meth:`busy`,
    under an exclusive lock on the board's file, claims this worker's share plus
    what its idle peers leave, never more than is free: the claims never add up to
    more than ``max_threads``, so no two OpenMP teams ever share a core (where
    both spin-wait, each step of both would stall), except where the shares
    themselves add up to more (more workers than cores: each steps on its share).
    A worker whose share a peer is stepping on marks its share claimed and waits
    for that peer to give it back (the peer's :meth:`give_back`, after its current
    layer; at the latest its next :meth:`busy`, which claims only its own share),
    at most ``max_wait_s`` (a peer that died holding cores), after which it steps
    on its share anyway.

    Call :meth:`busy` from the thread that runs the engine's steps (torch's thread
    count is that thread's OpenMP setting), before a step; :meth:`give_back` from
    the same thread between the layers of a step that borrowed (:attr:`borrowing`);
    :meth:`idle` before waiting for work.

    Raises:
        OSError: the board's file cannot be opened or mapped.
        ValueError: the file is shorter than ``config.shares`` has slots.
    """

    def __init__(self, config: CoreLendingConfig, set_threads=None, max_wait_s: float = 2.0,
                 poll_s: float = 0.0005):
        self.config = config
        self.max_wait_s, self.poll_s = max_wait_s, poll_s
        self._file = open(config.path, "r+b")
        self._board = mmap.mmap(self._file.fileno(), 0)
        if len(self._board) < len(config.shares):
            size = len(self._board)
            self.close()
            raise ValueError(f"{config.path}: a board of {size} slots, "
                             f"expected {len(config.shares)}")
        if set_threads is None:
            import torch
            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._peers = tuple(i for i in range(len(config.shares)) if i != config.slot)
        self.threads = 0            # what the pool was last sized to (0: not yet)
        self.waited_s = 0.0         # seconds spent waiting for lent cores (total)
        self.given_back = 0         # steps cut short on borrowed cores (give_back)
        self._board[config.slot] = 0

    @property
    def max_threads(self) -> int:
        return self.config.max_threads or sum(self.config.shares)

    def lendable(self) -> int:
        """Cores this worker could claim now: its share plus every idle peer's,
        within what the other slots leave free (at least its share)."""
        board, shares, me = self._board, self.config.shares, self.config.slot
        others = [i for i in range(len(shares)) if i != me]
        free = self.max_threads - sum(board[i] for i in others)
        n = shares[me] + sum(shares[i] for i in others if board[i] == 0)
        return max(shares[me], min(n, free))

    def busy(self) -> int:
        """Claim this worker's cores for its next step (waiting, if a peer steps on
        its share, for that step to end) and size the thread pool to them (only
        when that changes); returns the thread count in effect."""
        board, me, share = self._board, self.config.slot, self.config.shares[self.config.slot]
        t0 = None
        while True:
            fcntl.flock(self._file, fcntl.LOCK_EX)
            try:
                shares = self.config.shares
                peers = [i for i in range(len(shares)) if i != me]
                others = sum(board[i] for i in peers)
                # Wait only for cores a peer borrowed: with more workers than cores
                # (shares that add up past max_threads) the shares overlap anyway.
                borrowed = sum(max(0, board[i] - shares[i]) for i in peers)
                if self.max_threads - others >= share or not borrowed or (
                        t0 is not None and time.monotonic() - t0 >= self.max_wait_s):
                    n = self.lendable()
                    board[me] = n
                    break
                board[me] = share       # the borrower sees it after its layer
            finally:
                fcntl.flock(self._file, fcntl.LOCK_UN)
            if t0 is None:
                t0 = time.monotonic()
            time.sleep(self.poll_s)
        if t0 is not None:
            self.waited_s += time.monotonic() - t0
        if n != self.threads:
            self._set_threads(n)
            self.threads = n
        return n

    @property
    def borrowing(self) -> bool:
        """This worker's thread pool holds more than its share: idle peers' cores."""
        return self.threads > self.config.shares[self.config.slot]

    def give_back(self) -> int:
        """Between two parts of a step that borrowed cores (the engine calls it after
        each of the model's layers): if a peer has since claimed its share back (it
        waits in :meth:`busy`), shrink this worker's claim and thread pool to what the
        others leave, never below its own share, so the peer waits for one layer
        instead of the rest of the step. No lock and no write while nobody asked:
        one read of the board. Returns the thread count in effect."""
        share = self.config.shares[self.config.slot]
        if self.threads <= share:
            return self.threads
        board, me, peers = self._board, self.config.slot, self._peers
        if sum(board[i] for i in peers) + self.threads <= self.max_threads:
            return self.threads
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            free = self.max_threads - sum(board[i] for i in peers)
            n = max(share, min(self.threads, free))
            board[me] = n
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)
        if n != self.threads:
            self._set_threads(n)
            self.threads = n
            self.given_back += 1
        return n

    def idle(self) -> None:
        """Release this worker's cores: its peers may step on them."""
        self._board[self.config.slot] = 0

    def close(self) -> None:
        """Release the cores and unmap the board."""
        if not self._board.closed:
            self.idle()
            self._board.close()
        self._file.close()
