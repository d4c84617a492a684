"""What every transport shares: the header queue, the arrivals board, the receive loop.

Why headers: neither Gloo nor NCCL can cancel a posted receive. A Gloo receive
whose wait times out closes the whole pair ("Application timeout caused pair
closure"), and an NCCL receive that never matches blocks its stream for good. So
a receiver never posts a receive on the data channel for bytes that are not
already (or, for NCCL, about to be) on their way. For every layer the sender
queues the data send and pushes a small header ``(kind, transfer_id, layer,
nbytes, tag)`` onto a queue in the receiver-hosted ``TCPStore``; the receiver's
pump thread pops headers in order and posts one exactly sized receive per
header into a staging buffer; the layer is filed on an :class:`Arrivals` board
once the receive completed (Gloo) or with the CUDA event that marks its
completion (NCCL). ``receive`` waits on that board (a condition variable
with a deadline), so a sender that never sends costs the waiting caller a
timeout and nothing else::

    prefill                    TCPStore queue               decode
    send(data, tag) ───────────────────────────────────────> recv(staging, tag) posted by the pump
    queue_push(header) ──> [h0, h1, ...] ── queue_pop ──> pump: post recv per header
                                                         completion -> board.put(transfer, layer)
                                                         receive(): board.take -> scatter into kv_cache

The board keeps what arrived before ``receive`` was called, so the wire is
always drained and the sender never stalls on a slow consumer.

The pair's store also carries the two sides' handshake, so that the router only
sends each side its request and streams tokens (SGLang's bootstrap, Dynamo's
shape): the decode side posts each ticket on a second queue, which a thread of
the prefill side reads (:class:`TicketInbox`); the prefill side hands over the
first token it sampled as a ``HANDOFF`` header behind the ticket's last ``DATA``
header, its payload under a key of its own::

    decode: reserve blocks -> post_ticket(ticket) ──> [tickets] ──> TicketInbox -> prefill engine
    prefill: send layers; sample; post_handoff(id, first token) ──> [headers] ──> pump -> on_handoff
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import struct
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from tandem.kvtransfer.base import KVReceiver, KVTransferError, check_receive_args
from tandem.kvtransfer.layout import KVTransferTicket

logger = logging.getLogger(__name__)

# Header kinds.
DATA = 0            # a layer's bytes follow on the data channel
SENDER_CLOSED = 1   # the sender closed the pair; nothing follows
STOP = 2            # pushed by the receiver to itself to end its pump thread
HANDOFF = 3         # the first token of transfer ``transfer_id``: payload under handoff_key()

_HEADER = struct.Struct("<qqqqq")  # kind, transfer_id, layer, nbytes, tag
_QUEUE_KEY = "headers"
_TICKET_QUEUE_KEY = "tickets"
_END_OF_TICKETS = b"-"   # pushed by a closing sender to end its ticket thread
# A blocking queue_pop waits up to the store client's timeout; the pump is woken by
# headers or by STOP, never by that timeout, so make it effectively infinite. Also the
# wait of a receive that only a peer's death or goodbye may end.
FOREVER = datetime.timedelta(days=3650)
# Ids of finished or discarded transfers remembered so that late layers for them are
# dropped on arrival; transfer ids are unique per pair, so a bounded memory suffices.
_MAX_REMEMBERED_DONE = 1 << 16


class Header(NamedTuple):
    """One entry of the header queue; ``nbytes`` and ``tag`` describe the data message."""

    kind: int
    transfer_id: int = 0
    layer: int = 0
    nbytes: int = 0
    tag: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        return cls(*_HEADER.unpack(data))


# Gloo tags are in [0, 2**31); the top one is kept for the connection watchdog.
WATCHDOG_TAG = (1 << 31) - 1


def message_tag(transfer_id: int, layer: int, num_layers: int) -> int:
    """Data-channel tag of one layer of one transfer, in ``[0, WATCHDOG_TAG)``.

    Tags keep concurrent transfers on one pair apart. Wrap-around collisions are
    harmless: messages with equal tags are matched first-in first-out, which is
    also the order in which their headers are popped.
    """
    return (transfer_id * num_layers + layer) % WATCHDOG_TAG


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A ``TCPStore`` server on ``host`` at a port chosen by the OS (read it from ``.port``)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the ``TCPStore`` at ``host:port``.

    Raises:
        KVTransferError: not reachable within ``timeout_s`` seconds.
    """
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise KVTransferError(f"cannot reach the KV receiver's store at {host}:{port}: {e}") from e


CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
"""The environment variable holding the cluster's secret (any string; ``tandem serve``
generates one and hands it to its workers)."""

_AUTH_KEY, _VERDICT_KEY = "auth", "auth_verdict"
_ACCEPTED, _REFUSED = b"accepted", b"refused"


def cluster_secret() -> bytes | None:
    """This process's cluster secret (:data:`CLUSTER_SECRET_ENV`), None if unset."""
    value = os.environ.get(CLUSTER_SECRET_ENV)
    return value.encode() if value else None


def _proof(secret: bytes | None, pair_name: str) -> bytes:
    if secret is None:
        return b"-"
    return hmac.new(secret, f"tandem-kv-pair|{pair_name}".encode(), hashlib.sha256).hexdigest().encode()


def present_secret(pair_store: dist.Store, pair_name: str, timeout_s: float,
                   secret: bytes | None = None) -> None:
    """Sender side of the pair handshake: prove knowledge of the cluster secret
    (HMAC-SHA256 of the pair name; the secret itself never travels) and wait for the
    receiver's verdict, before any data channel is built.

    Args:
        secret: default :func:`cluster_secret`.

    Raises:
        KVTransferError: the receiver refused the proof, or gave no verdict within
            ``timeout_s`` seconds.
    """
    pair_store.set(_AUTH_KEY, _proof(secret if secret is not None else cluster_secret(), pair_name))
    try:
        pair_store.wait([_VERDICT_KEY], datetime.timedelta(seconds=timeout_s))
        verdict = pair_store.get(_VERDICT_KEY)
    except (RuntimeError, dist.DistError) as e:
        raise KVTransferError(f"KV pair {pair_name}: no handshake verdict within {timeout_s} s") from e
    if verdict != _ACCEPTED:
        raise KVTransferError(f"KV pair {pair_name}: the receiver refused this peer "
                              "(wrong or missing cluster secret)")


def check_peer(pair_store: dist.Store, pair_name: str, timeout_s: float,
               secret: bytes | None = None) -> None:
    """Receiver side of the pair handshake: wait for the sender's proof and accept it
    only if it was made with this process's cluster secret (compared in constant
    time). A receiver without a secret accepts any peer.

    Raises:
        KVTransferError: no proof within ``timeout_s`` seconds, or a wrong one (the
            sender is told, and the pair is never built).
    """
    secret = secret if secret is not None else cluster_secret()
    try:
        pair_store.wait([_AUTH_KEY], datetime.timedelta(seconds=timeout_s))
        presented = pair_store.get(_AUTH_KEY)
    except (RuntimeError, dist.DistError) as e:
        raise KVTransferError(f"sender did not connect within {timeout_s} s: {e}") from e
    ok = secret is None or hmac.compare_digest(presented, _proof(secret, pair_name))
    pair_store.set(_VERDICT_KEY, _ACCEPTED if ok else _REFUSED)
    if not ok:
        raise KVTransferError(f"KV pair {pair_name}: refused a peer without the cluster secret")


def encode_message(message: dict[str, Any]) -> bytes:
    """A handshake message (plain values) as JSON bytes: data, never code, crosses the pair."""
    return json.dumps(message, separators=(",", ":")).encode()


def decode_message(data: bytes) -> dict[str, Any]:
    """:func:`encode_message`'s inverse.

    Raises:
        KVTransferError: not a JSON object.
    """
    try:
        message = json.loads(data)
    except ValueError as e:
        raise KVTransferError(f"malformed handshake message: {e}") from e
    if not isinstance(message, dict):
        raise KVTransferError(f"malformed handshake message: {type(message).__name__}")
    return message


def handoff_key(transfer_id: int) -> str:
    """The pair-store key of transfer ``transfer_id``'s first-token payload."""
    return f"handoff/{transfer_id}"


def post_ticket(pair_store: dist.Store, ticket: dict[str, Any]) -> None:
    """Decode side: queue ``ticket`` (``KVTransferTicket.to_dict()``) for the sender's
    :class:`TicketInbox`; the store keeps it until the sender reads it."""
    pair_store.queue_push(_TICKET_QUEUE_KEY, encode_message(ticket))


def post_handoff(pair_store: dist.Store, queue: HeaderQueue, transfer_id: int,
                 payload: dict[str, Any]) -> None:
    """Prefill side: hand transfer ``transfer_id``'s first token (``payload``, plain
    values) to the receiver, behind the headers already pushed. The caller holds the
    sender's lock, so that the header is ordered after the transfer's ``DATA``."""
    pair_store.set(handoff_key(transfer_id), encode_message(payload))
    queue.push(Header(HANDOFF, transfer_id))


class TicketInbox:
    """Prefill side of the handshake: the tickets the decode side posts
    (:func:`post_ticket`), read by a thread of its own and given to a handler.

    Tickets that arrive before :meth:`set_handler` are kept and given to it then.
    The thread ends when :meth:`close` pushes the end marker, or when the store
    (hosted by the receiver) goes away.

    Args:
        host, port, pair_name: the pair's store (the receiver's rendezvous).
        timeout_s: seconds to reach the store.
    """

    def __init__(self, host: str, port: int, pair_name: str, timeout_s: float) -> None:
        self._store = dist.PrefixStore(pair_name, join_store(host, port, timeout_s))
        self._store.set_timeout(FOREVER)
        self._pair_name = pair_name
        self._lock = threading.Lock()
        self._handler: Callable[[dict[str, Any]], None] | None = None
        self._early: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name=f"{pair_name}-tickets", daemon=True)
        self._thread.start()

    def set_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        """Give every ticket, those already read first, to ``handler`` (called on the
        inbox's thread, or here; it must not block)."""
        with self._lock:
            self._handler = handler
            early, self._early = self._early, []
            for ticket in early:
                handler(ticket)

    def _run(self) -> None:
        while True:
            try:
                data = self._store.queue_pop(_TICKET_QUEUE_KEY)
            except (RuntimeError, dist.DistError):     # the receiver (its store) is gone
                return
            if data == _END_OF_TICKETS:
                return
            try:
                ticket = decode_message(data)
            except KVTransferError as e:
                logger.warning("KV pair %s: dropped a ticket: %s", self._pair_name, e)
                continue
            with self._lock:
                if self._handler is None:
                    self._early.append(ticket)
                else:
                    self._handler(ticket)

    def close(self, pair_store: dist.Store) -> None:
        """End the thread (through ``pair_store``, a client other than the thread's)."""
        try:
            pair_store.queue_push(_TICKET_QUEUE_KEY, _END_OF_TICKETS)
        except (RuntimeError, dist.DistError):
            pass                                        # the store is gone: so is the thread


class HeaderQueue:
    """The ordered header channel of one pair, over a ``TCPStore`` queue.

    Args:
        store: the pair's store, already prefixed with the pair name.
        blocking: make :meth:`pop` wait without limit (the pump's own client).
    """

    def __init__(self, store: dist.Store, *, blocking: bool = False) -> None:
        if blocking:
            store.set_timeout(FOREVER)
        self._store = store

    def push(self, header: Header) -> None:
        self._store.queue_push(_QUEUE_KEY, header.pack())

    def pop(self) -> Header:
        return Header.unpack(self._store.queue_pop(_QUEUE_KEY))


class Arrivals:
    """Layers that have landed in staging, by transfer id; the rendezvous of pump and ``receive``.

    Thread-safe. A transfer's entry holds ``layer -> payload`` (whatever the
    transport staged: a CPU byte tensor, or a GPU buffer plus event).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._staged: dict[int, dict[int, Any]] = {}
        self._done: OrderedDict[int, None] = OrderedDict()
        self._error: KVTransferError | None = None
        self._num_dropped = 0
        self._deadlines: dict[int, float] = {}   # transfer id -> extended deadline

    def put(self, transfer_id: int, layer: int, payload: Any) -> bool:
        """File a landed layer; returns False (payload dropped) if the transfer is finished or discarded."""
        with self._cond:
            if transfer_id in self._done:
                self._num_dropped += 1
                return False
            self._staged.setdefault(transfer_id, {})[layer] = payload
            self._cond.notify_all()
            return True

    def take(self, transfer_id: int, wanted: set[int], deadline: float,
             describe: Callable[[bool], str]) -> list[tuple[int, Any]]:
        """Remove and return the staged layers of ``wanted``; wait for at least one.

        Staged layers are returned even after :meth:`fail`, so transfers that
        completed before a sender closed can still be received. ``describe(timed_out)``
        words the error.

        Raises:
            KVTransferError: the deadline (``time.monotonic()`` seconds) passed,
                the board failed, or the transfer was already finished/discarded.
        """
        with self._cond:
            while True:
                staged = self._staged.get(transfer_id, {})
                ready = [(layer, staged.pop(layer)) for layer in sorted(wanted & staged.keys())]
                if ready:
                    return ready
                if transfer_id in self._done:
                    raise KVTransferError(f"transfer {transfer_id} was already received or discarded")
                if self._error is not None:
                    raise KVTransferError(f"{describe(False)}: {self._error}") from self._error
                left = self._deadline(transfer_id, deadline) - time.monotonic()
                if left <= 0:
                    raise KVTransferError(describe(True))
                self._cond.wait(left)

    def _deadline(self, transfer_id: int, deadline: float) -> float:
        return max(deadline, self._deadlines.get(transfer_id, deadline))

    def deadline(self, transfer_id: int, deadline: float) -> float:
        """``deadline``, or the later one :meth:`extend` gave ``transfer_id``."""
        with self._cond:
            return self._deadline(transfer_id, deadline)

    def extend(self, transfer_id: int, deadline: float) -> None:
        """Let ``take`` for ``transfer_id`` wait until ``deadline`` (``time.monotonic()``
        seconds) if that is later than its own; a finished transfer is ignored."""
        with self._cond:
            if transfer_id not in self._done:
                self._deadlines[transfer_id] = max(deadline, self._deadlines.get(transfer_id, 0.0))

    def finish(self, transfer_id: int) -> None:
        """Forget ``transfer_id``: drop what is staged for it and whatever arrives later."""
        with self._cond:
            self._staged.pop(transfer_id, None)
            self._deadlines.pop(transfer_id, None)
            self._done[transfer_id] = None
            while len(self._done) > _MAX_REMEMBERED_DONE:
                self._done.popitem(last=False)
            self._cond.notify_all()

    def fail(self, error: KVTransferError) -> None:
        """Nothing more will arrive: wake every waiter with ``error`` (the first failure wins)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def error(self) -> KVTransferError | None:
        with self._cond:
            return self._error

    @property
    def num_dropped(self) -> int:
        """Layers dropped on arrival because their transfer was finished or discarded."""
        with self._cond:
            return self._num_dropped

    def staged_transfer_ids(self) -> list[int]:
        """Transfers with layers waiting for ``receive`` (for leak checks)."""
        with self._cond:
            return sorted(t for t, layers in self._staged.items() if layers)


@dataclass
class InflightTicket:
    """Sender-side state of one ticket between its first ``send_layer`` and ``finish``."""

    ticket: KVTransferTicket
    layers: set[int] = field(default_factory=set)
    # (completion handle, buffer): a Gloo work or a CUDA event; the buffer must outlive the send.
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def add_layer(self, ticket: KVTransferTicket, layer: int) -> None:
        """Record that ``layer`` is being sent.

        Raises:
            ValueError: the transfer id belongs to another ticket, or the layer was sent already.
        """
        if self.ticket != ticket:
            raise ValueError(f"transfer_id {ticket.transfer_id} is in flight for request "
                             f"{self.ticket.request_id!r}, not {ticket.request_id!r}")
        if layer in self.layers:
            raise ValueError(f"request {ticket.request_id!r}: layer {layer} already sent")
        self.layers.add(layer)

    def missing_layers(self) -> list[int]:
        return sorted(set(range(self.ticket.layout.num_layers)) - self.layers)


class StagedReceiver(KVReceiver):
    """A receiver whose pump thread stages layers on an :class:`Arrivals` board.

    Subclasses run the pump and implement :meth:`_land`, which moves one staged
    layer into the cache.
    """

    def __init__(self) -> None:
        self._arrivals = Arrivals()
        self.on_handoff: Callable[[int, dict[str, Any]], None] | None = None
        self._post_store: dist.Store | None = None
        self._post_lock = threading.Lock()

    def post_ticket(self, ticket: dict[str, Any]) -> None:
        with self._post_lock:
            if self._post_store is None:
                # A client of its own: the pump's blocks in its pops.
                self._post_store = dist.PrefixStore(self._pair_name, join_store(
                    self._host, self._store.port, self._connect_timeout_s))
            try:
                post_ticket(self._post_store, ticket)
            except (RuntimeError, dist.DistError) as e:
                raise KVTransferError(f"cannot post the ticket of request "
                                      f"{ticket.get('request_id')!r}: {e}") from e

    def _hand_off(self, pair_store: dist.Store, header: Header) -> None:
        """The pump popped a ``HANDOFF`` header: read its payload and give it to
        :attr:`on_handoff` (a bad payload is logged and dropped: the router's own
        path then decides)."""
        key = handoff_key(header.transfer_id)
        try:
            payload = decode_message(pair_store.get(key))
            pair_store.delete_key(key)
        except KVTransferError as e:
            logger.warning("transfer %d: dropped the first-token handoff: %s", header.transfer_id, e)
            return
        handler = self.on_handoff
        if handler is not None:
            handler(header.transfer_id, payload)

    def receive_layers(self, ticket: KVTransferTicket, kv_cache: torch.Tensor,
                       timeout_s: float) -> Iterator[int]:
        check_receive_args(ticket, kv_cache)
        return self._receive_layers(ticket, kv_cache, timeout_s)

    def _receive_layers(self, ticket: KVTransferTicket, kv_cache: torch.Tensor,
                        timeout_s: float) -> Iterator[int]:
        num_layers = ticket.layout.num_layers
        if ticket.num_sent_blocks == 0:
            # The whole sequence is cached here; the sender sends nothing for it.
            self._arrivals.finish(ticket.transfer_id)
            yield from range(num_layers)
            return
        deadline = time.monotonic() + timeout_s
        dst = torch.tensor(ticket.sent_dst_block_ids, dtype=torch.int64, device=kv_cache.device)
        missing = set(range(num_layers))

        def describe(timed_out: bool) -> str:
            what = (f"request {ticket.request_id!r} transfer {ticket.transfer_id}: "
                    f"{len(missing)} of {num_layers} layers not received")
            return f"{what} within {timeout_s} s{self._state_note()}" if timed_out else what

        try:
            while missing:
                for layer, payload in self._arrivals.take(ticket.transfer_id, missing, deadline,
                                                          describe):
                    self._land(ticket, layer, payload, kv_cache, dst,
                               self._arrivals.deadline(ticket.transfer_id, deadline))
                    missing.discard(layer)
                    yield layer
        finally:
            # Success, error, timeout or an abandoned generator: either way this
            # ticket is over, and late layers for it must not pile up.
            self._arrivals.finish(ticket.transfer_id)

    def discard(self, transfer_id: int) -> None:
        self._arrivals.finish(transfer_id)

    def extend(self, transfer_id: int, timeout_s: float) -> None:
        self._arrivals.extend(transfer_id, time.monotonic() + timeout_s)

    def staged_transfer_ids(self) -> list[int]:
        """Transfers with layers that arrived but were not yet received (should be empty when idle)."""
        return self._arrivals.staged_transfer_ids()

    @property
    def num_dropped_layers(self) -> int:
        """Layers that arrived for a transfer already received or discarded (a late or
        zombie sender's) and were dropped without touching the cache."""
        return self._arrivals.num_dropped

    @property
    def error(self) -> KVTransferError | None:
        """Why this pair can no longer receive, or None while it can."""
        return self._arrivals.error

    def _state_note(self) -> str:
        """Extra words for timeout messages (e.g. that the sender never connected)."""
        return ""

    @abstractmethod
    def _land(self, ticket: KVTransferTicket, layer: int, payload: Any, kv_cache: torch.Tensor,
              dst: torch.Tensor, deadline: float) -> None:
        """Write one staged layer into ``kv_cache[layer][:, dst]``; visible to the caller on return."""


def check_staged_size(ticket: KVTransferTicket, layer: int, nbytes: int) -> None:
    """Raise if a staged layer's size is not what the ticket says (the peers disagree on the ticket)."""
    if nbytes != ticket.bytes_per_layer:
        raise KVTransferError(
            f"request {ticket.request_id!r} transfer {ticket.transfer_id} layer {layer}: "
            f"received {nbytes} bytes, ticket expects {ticket.bytes_per_layer} "
            f"({ticket.num_sent_blocks} blocks x {ticket.layout.bytes_per_block_per_layer})")
