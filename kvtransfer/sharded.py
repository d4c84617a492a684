"""KV transfer between tensor-parallel workers: which rank sends which KV heads to
which rank, and how rank 0 drives its other ranks' ends of the transfer.

A worker of ``W`` tensor-parallel ranks keeps its KV heads split over the ranks
(:func:`~tandem.engine.parallel.partition.head_partition`): rank ``r`` holds heads
``[start_r, start_r + n_r)`` of the model's ``Hkv`` in its own cache, with the same
block ids as every other rank. A prefill worker of ``P`` ranks and a decode worker of
``D`` ranks are joined by one transport pair per *(prefill rank, decode rank)* whose
heads overlap (:func:`pair_plan`), each carrying exactly those heads: every decode
rank receives the heads it owns, straight from a prefill rank that holds them, and
no KV passes through a third process (the DistServe / Dynamo shape: each phase's
parallelism chosen on its own, the KV re-split on the wire). SmolLM2-135M's 3 KV
heads, prefill ``P = 2`` (heads 0-1 | 2) to decode ``D = 1`` (0-2)::

    prefill rank 0 [h0 h1] ---- pair (0, 0): heads 0-1 ----> decode rank 0 [h0 h1 h2]
    prefill rank 1 [h2]    ---- pair (1, 0): head 2    ---->

and ``P = 1`` to ``D = 2``: pairs (0, 0) heads 0-1 and (0, 1) head 2. Pair (0, 0)
always exists (both ranks 0 hold head 0); it carries the handshake (tickets, the
first token) as a one-rank worker's single pair does.

Only rank 0 of a worker hears from the router and runs the scheduler, so it drives
its other ranks' pair ends (:class:`RankControl`, commands over the group's
``TCPStore``; :class:`RankKVAgent` runs them in ranks 1..): opening receivers and
connecting senders when a channel is set up, starting, extending and discarding a
load's receives. A producer's sends ride on the step: the step's saves go to the
other ranks with the forward pass's input, each rank sends its own heads from inside
its forward pass, and reports back whether its sends left. Ranks 1.. report each
load's end the same way; rank 0 counts a load finished once every rank's part landed.

Layouts: a sharded worker's :meth:`~tandem.engine.kv.kv_connector.KVConnector.layout`
is the model's whole KV layout (all ``Hkv`` heads) plus ``kv_head_ranges``; a pair
travels in the layout of its own heads (:func:`pair_ticket`).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tandem.kvtransfer.base import KVReceiver, KVSender, KVTransferError, get_transport
from tandem.kvtransfer.layout import KVLayout, KVLayoutMismatchError, KVTransferTicket
from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV

logger = logging.getLogger(__name__)

HEAD_RANGES_KEY = "kv_head_ranges"
"""The key a sharded worker's layout dict adds: ``[[first KV head, heads], ...]`` per rank."""

_PREFIX = "tandem-kv"
_FOREVER = datetime.timedelta(days=365)


@dataclass(frozen=True)
class KVPair:
    """One transport pair of a channel: prefill rank ``prefill_rank`` sends KV heads
    ``[head_start, head_start + num_heads)`` (the model's numbering) to decode rank
    ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    head_start: int
    num_heads: int

    def to_list(self) -> list[int]:
        return [self.prefill_rank, self.decode_rank, self.head_start, self.num_heads]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> KVPair:
        return cls(*(int(v) for v in values))


def worker_layout(layout: KVLayout, head_ranges: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The plain-data layout of a worker whose ranks hold ``head_ranges`` of
    ``layout.num_kv_heads`` (the model's) heads; a one-rank worker's is
    ``layout.to_dict()`` alone."""
    data = layout.to_dict()
    if len(head_ranges) > 1:
        data[HEAD_RANGES_KEY] = [[int(s), int(n)] for s, n in head_ranges]
    return data


def parse_worker_layout(data: dict[str, Any]) -> tuple[KVLayout, list[tuple[int, int]]]:
    """Inverse of :func:`worker_layout`: ``(whole layout, head range per rank)``.

    Raises:
        KVLayoutMismatchError: the ranges leave a head uncovered or name one outside
            the layout's heads.
        ValueError: a malformed layout.
    """
    data = dict(data)
    ranges = data.pop(HEAD_RANGES_KEY, None)
    layout = KVLayout.from_dict(data)
    if ranges is None:
        return layout, [(0, layout.num_kv_heads)]
    head_ranges = [(int(s), int(n)) for s, n in ranges]
    covered = set()
    for start, n in head_ranges:
        if n < 1 or start < 0 or start + n > layout.num_kv_heads:
            raise KVLayoutMismatchError(f"KV head split: range {start}-{start + n - 1} is "
                                        f"outside the model's {layout.num_kv_heads} KV heads")
        covered.update(range(start, start + n))
    if len(covered) != layout.num_kv_heads:
        raise KVLayoutMismatchError(f"KV head split {head_ranges} does not hold every one of "
                                    f"the {layout.num_kv_heads} KV heads")
    return layout, head_ranges


def pair_plan(prefill_ranges: Sequence[tuple[int, int]],
              decode_ranges: Sequence[tuple[int, int]]) -> list[KVPair]:
    """The pairs joining a prefill worker whose ranks hold ``prefill_ranges`` and a
    decode worker whose ranks hold ``decode_ranges`` (``(first KV head, heads)`` per
    rank): for each decode rank in order, its heads in runs, each run from the first
    prefill rank holding it (with replicated heads, the lowest such rank sends).

    Raises:
        KVLayoutMismatchError: a head a decode rank holds is on no prefill rank.
    """
    pairs = []
    for d, (d_start, d_n) in enumerate(decode_ranges):
        head = d_start
        while head < d_start + d_n:
            for p, (p_start, p_n) in enumerate(prefill_ranges):
                if p_start <= head < p_start + p_n:
                    stop = min(d_start + d_n, p_start + p_n)
                    pairs.append(KVPair(p, d, head, stop - head))
                    head = stop
                    break
            else:
                raise KVLayoutMismatchError(
                    f"KV head split mismatch: decode rank {d} holds KV head {head}, which no "
                    f"prefill rank holds (prefill {list(prefill_ranges)}, decode "
                    f"{list(decode_ranges)})")
    return pairs


def pair_ticket(ticket: KVTransferTicket, pair: KVPair) -> KVTransferTicket:
    """``ticket`` (in the decode worker's whole layout) as pair ``pair`` carries it:
    the same blocks and transfer id, the layout of the pair's heads."""
    return dataclasses.replace(ticket, layout=dataclasses.replace(ticket.layout,
                                                                  num_kv_heads=pair.num_heads))


def heads_view(kv_cache: torch.Tensor, rank_head_start: int, pair: KVPair) -> torch.Tensor:
    """The pair's heads of a rank's ``[L, 2, NB, BS, Hkv_rank, D]`` cache (which holds
    the model's heads from ``rank_head_start``), as a view: ``[L, 2, NB, BS, heads, D]``."""
    lo = pair.head_start - rank_head_start
    return kv_cache[:, :, :, :, lo:lo + pair.num_heads]


class StepSends:
    """One rank's KV sends of one producer step: each request's pairs from this rank,
    each pair its heads' view of the cache, sent layer by layer from inside the
    forward pass.

    Args:
        kv_cache: this rank's ``[L, 2, NB, BS, Hkv_rank, D]`` cache tensor.
        head_start: the model's first KV head this rank holds.
        what: prefix of the failure messages (e.g. ``"rank 1: "``).
    """

    def __init__(self, kv_cache: torch.Tensor, head_start: int, what: str = ""):
        self._kv_cache, self._head_start, self._what = kv_cache, head_start, what
        self._saving: list[tuple[str, list[tuple[KVTransferTicket, KVSender, torch.Tensor]],
                                 list[int]]] = []
        self.failed: dict[str, str] = {}
        """Request id -> why its sends failed, this step."""

    def add(self, request_id: str, ticket: KVTransferTicket,
            ends: Sequence[tuple[KVPair, KVSender]], src_block_ids: Sequence[int]) -> None:
        """Send ``ticket`` (the decode worker's whole layout) from ``src_block_ids``
        over this rank's ``ends`` of its channel."""
        self._saving.append((request_id, [
            (pair_ticket(ticket, pair), sender, heads_view(self._kv_cache, self._head_start, pair))
            for pair, sender in ends], list(src_block_ids)))

    def send_layer(self, layer: int) -> None:
        """Right after ``layer``'s K/V are in the cache: queue it on every pair."""
        for rid, sends, src in self._saving:
            if rid in self.failed:
                continue
            for ticket, sender, view in sends:
                try:
                    sender.send_layer(ticket, layer, src, view)
                except (KVTransferError, ValueError) as e:
                    self.failed[rid] = f"{self._what}{e}"
                    break

    def finish(self, timeout_s: float) -> dict[str, str]:
        """Wait until every send left (``timeout_s`` seconds each); the failures."""
        for rid, sends, _ in self._saving:
            # finish() even after a failed send_layer: it releases the ticket's buffers.
            for ticket, sender, _ in sends:
                try:
                    sender.finish(ticket, timeout_s)
                except KVTransferError as e:
                    self.failed.setdefault(rid, f"{self._what}{e}")
        return self.failed


def _join(host: str, port: int, timeout: datetime.timedelta) -> dist.Store:
    return dist.PrefixStore(_PREFIX, dist.TCPStore(host, port, is_master=False, timeout=timeout))


class RankControl:
    """Rank 0's side of the commands to ranks 1.. of its group, over the group's
    ``TCPStore`` at ``host:port`` (each rank pops its queue ``ctl/<rank>``; replies
    and reports come back under this module's prefix).

    Args:
        timeout_s: how long :meth:`call` waits for a reply.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 120.0):
        self._host, self._port = host, port
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = _join(host, port, self._timeout)
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def post(self, rank: int, *command: Any) -> None:
        """Queue ``command`` (name, args...) for rank ``rank``; no reply."""
        with self._lock:
            self._store.queue_push(f"ctl/{rank}", pickle.dumps((None, command)))

    def call(self, rank: int, *command: Any) -> Any:
        """Run ``command`` on rank ``rank`` and return its result.

        Raises:
            KVTransferError: the rank raised (its message), or no reply within the timeout.
        """
        with self._lock:
            seq = next(self._seq)
            key = f"reply/{rank}/{seq}"
            self._store.queue_push(f"ctl/{rank}", pickle.dumps((seq, command)))
            try:
                self._store.wait([key], self._timeout)
                ok, value = pickle.loads(self._store.get(key))
                self._store.delete_key(key)
            except (RuntimeError, dist.DistError) as e:
                raise KVTransferError(f"tensor-parallel rank {rank} did not answer "
                                      f"{command[0]!r}: {e}") from e
        if not ok:
            raise KVTransferError(f"tensor-parallel rank {rank}: {command[0]} failed: {value}")
        return value

    def watch(self, kind: str, handler: Callable[[Any], None]) -> None:
        """Call ``handler`` with each report of kind ``kind`` as it arrives, on a
        thread of its own (which ends with the group's store)."""
        def run() -> None:
            store = _join(self._host, self._port, _FOREVER)
            while True:
                try:
                    value = pickle.loads(store.queue_pop(f"report/{kind}"))
                except (RuntimeError, dist.DistError):
                    return
                handler(value)

        threading.Thread(target=run, name=f"kv-{kind}-reports", daemon=True).start()

    def reports(self, kind: str) -> list[Any]:
        """The reports of kind ``kind`` ranks 1.. posted since the last call. Never blocks."""
        key = f"report/{kind}"
        with self._lock:
            n = self._store.queue_len(key)
            return [pickle.loads(self._store.queue_pop(key)) for _ in range(n)]


class RankKVAgent:
    """A tensor-parallel worker's rank ``rank`` (1..): its ends of the worker's KV
    channels, driven by rank 0 (:class:`RankControl` commands on a thread of its own,
    and the step's saves from the forward pass, :meth:`start_save` ..
    :meth:`wait_for_save`).

    Args:
        rank: this rank.
        host, port: the group's ``TCPStore``.
        kv_cache: this rank's ``[L, 2, NB, BS, Hkv_rank, D]`` cache tensor.
        head_start: the model's first KV head this rank holds.
    """

    def __init__(self, rank: int, host: str, port: int, kv_cache: torch.Tensor, head_start: int):
        self.rank, self.kv_cache, self.head_start = rank, kv_cache, head_start
        self._commands = _join(host, port, _FOREVER)        # blocking pops
        self._replies = _join(host, port, datetime.timedelta(seconds=60))
        self._reply_lock = threading.Lock()
        self._senders: dict[str, list[tuple[KVPair, KVSender]]] = {}
        self._receivers: dict[str, list[tuple[KVPair, KVReceiver]]] = {}
        self._step = StepSends(kv_cache, head_start)
        self.transfer_timeout_s = 60.0
        self._pool = ThreadPoolExecutor(4, thread_name_prefix=f"kv-recv-r{rank}")
        threading.Thread(target=self._serve, name=f"kv-control-r{rank}", daemon=True).start()

    # -- commands from rank 0 ---------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                seq, (name, *args) = pickle.loads(self._commands.queue_pop(f"ctl/{self.rank}"))
            except (RuntimeError, dist.DistError):
                return                                  # the group's store is gone
            try:
                result = (True, getattr(self, f"_do_{name}")(*args))
            except Exception as e:  # noqa: BLE001 - the error goes back to rank 0
                logger.warning("tensor-parallel rank %d: KV command %s failed: %s",
                               self.rank, name, e)
                result = (False, f"{type(e).__name__}: {e}")
            if seq is not None:
                self._put(f"reply/{self.rank}/{seq}", result)

    def _put(self, key: str, value: Any) -> None:
        with self._reply_lock:
            self._replies.set(key, pickle.dumps(value))

    def _report(self, kind: str, value: Any) -> None:
        with self._reply_lock:
            self._replies.queue_push(f"report/{kind}", pickle.dumps(value))

    def _view(self, pair: KVPair) -> torch.Tensor:
        return heads_view(self.kv_cache, self.head_start, pair)

    @staticmethod
    def _use_secret(secret: str | None) -> None:
        """The cluster's secret, which the pairs prove (rank 0's worker learns it
        after this rank started, so it comes with each channel)."""
        if secret:
            os.environ[CLUSTER_SECRET_ENV] = secret

    def _do_open(self, peer_id: str, transport: str, host: str, pairs: list[list[int]],
                 secret: str | None = None) -> list[dict]:
        self._do_close(peer_id)
        self._use_secret(secret)
        ends = [(KVPair.from_list(p), get_transport(transport).receiver.listen(host))
                for p in pairs]
        self._receivers[peer_id] = ends
        return [r.rendezvous for _, r in ends]

    def _do_connect(self, peer_id: str, transport: str, pairs: list[tuple[list[int], dict]],
                    local_host: str | None, timeout_s: float, secret: str | None = None) -> None:
        self._do_close(peer_id)
        self._use_secret(secret)
        self.transfer_timeout_s = timeout_s
        self._senders[peer_id] = [
            (KVPair.from_list(p), get_transport(transport).sender.connect(rdv, local_host=local_host))
            for p, rdv in pairs]

    def _do_close(self, peer_id: str) -> bool:
        ends = self._senders.pop(peer_id, []) + self._receivers.pop(peer_id, [])
        for _, end in ends:
            end.close()
        return bool(ends)

    def _do_load(self, peer_id: str, ticket: dict, timeout_s: float) -> None:
        base = KVTransferTicket.from_dict(ticket)
        ends = self._receivers.get(peer_id, [])

        def receive() -> None:
            error = None
            try:
                if not ends:
                    raise KVTransferError(f"rank {self.rank}: no KV channel to {peer_id}")
                for pair, receiver in ends:
                    receiver.receive(pair_ticket(base, pair), self._view(pair), timeout_s)
            except (KVTransferError, ValueError) as e:
                error = f"rank {self.rank}: {e}"
                for _, receiver in ends:           # the other pairs' parts end too
                    receiver.discard(base.transfer_id)
            self._report("load", (peer_id, base.transfer_id, self.rank, error))

        self._pool.submit(receive)

    def _do_discard(self, peer_id: str, transfer_id: int) -> None:
        for _, receiver in self._receivers.get(peer_id, []):
            receiver.discard(transfer_id)

    def _do_extend(self, peer_id: str, transfer_id: int, timeout_s: float) -> None:
        for _, receiver in self._receivers.get(peer_id, []):
            receiver.extend(transfer_id, timeout_s)

    # -- a producer step's sends (on the forward pass's thread) ------------------------------
    def start_save(self, saves: Sequence[tuple[str, str, dict, Sequence[int]]]) -> None:
        """Before the forward pass: the step's ``(request id, peer id, ticket, source
        block ids)`` that rank 0 accepted."""
        self._step = StepSends(self.kv_cache, self.head_start, f"rank {self.rank}: ")
        for rid, peer_id, ticket, src in saves:
            self._step.add(rid, KVTransferTicket.from_dict(ticket),
                           self._senders.get(peer_id, []), src)

    def save_kv_layer(self, layer: int) -> None:
        self._step.send_layer(layer)

    def wait_for_save(self) -> None:
        """After the forward pass: wait until this rank's sends left (up to the
        channel's ``transfer_timeout_s`` seconds), and report the failures (request
        id -> message) to rank 0."""
        self._report("saved", (self.rank, self._step.finish(self.transfer_timeout_s)))


def wait_for_saved(control: RankControl, num_ranks: int, timeout_s: float,
                   check_ranks: Callable[[], None]) -> dict[str, str]:
    """Rank 0, after its own sends of a step: the failures ranks 1.. (``num_ranks`` of
    them) reported for their sends of the same step.

    Raises:
        RankDiedError: a rank died meanwhile (``check_ranks``).
    """
    failed: dict[str, str] = {}
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < num_ranks:
        for _, errors in control.reports("saved"):
            seen += 1
            for rid, message in errors.items():
                failed.setdefault(rid, message)
        if seen < num_ranks:
            check_ranks()
            if time.monotonic() > deadline:
                raise KVTransferError(f"{num_ranks - seen} tensor-parallel ranks did not report "
                                      f"their KV sends within {timeout_s} s")
            time.sleep(0.001)
    return failed
