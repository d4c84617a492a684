"""CPU transport: a 2-rank ``ProcessGroupGloo`` per prefill/decode pair.

The receiver (decode side, rank 0) hosts a ``TCPStore`` on a port the OS picks;
the group is built over ``PrefixStore(pair name, store)``, so no global
``init_process_group`` is involved and one process may hold many pairs. Layers
travel as raw bytes (any KV dtype), one Gloo message per (transfer, layer),
announced by a header on the store's queue (see :mod:`tandem.kvtransfer.staging`
for why).

Failure behaviour:

* a sender that never sends (or never connects): ``receive`` raises
  :class:`KVTransferError` at its timeout; the receiver stays usable.
* a sender process that dies: a watchdog receive, kept posted on a reserved tag
  for the life of the pair, fails as soon as Gloo sees the connection close; the
  pair is then broken (:attr:`GlooReceiver.error` is set), every pending and
  later ``receive`` raises at once, and the pair must be re-created. Layers that
  arrived before are still received. A clean :meth:`GlooSender.close` completes
  the watchdog receive with a one-byte goodbye instead.
* a receiver that stops draining: ``finish`` raises at its timeout; Gloo closes
  the pair on that timeout, so the pair must be re-created.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import queue
import socket
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tandem.kvtransfer.base import KVSender, KVTransferError, Transport, check_send_args
from tandem.kvtransfer.blocks import gather_blocks, scatter_blocks
from tandem.kvtransfer.layout import KVTransferTicket
from tandem.kvtransfer.staging import (DATA, FOREVER, HANDOFF, SENDER_CLOSED, STOP,
                                       WATCHDOG_TAG, Header, HeaderQueue, InflightTicket,
                                       StagedReceiver, TicketInbox, check_peer, check_staged_size,
                                       host_store, join_store, message_tag, post_handoff,
                                       present_secret)

logger = logging.getLogger(__name__)

RECEIVER_RANK = 0
SENDER_RANK = 1


def _gloo_group(store: dist.Store, rank: int, local_host: str, timeout_s: float) -> dist.ProcessGroupGloo:
    """Build this end of the pair's group; blocks until the other end builds its own."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def local_address_for(peer_host: str) -> str:
    """This machine's address on the route to ``peer_host`` (loopback stays loopback)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(peer_host, None, type=socket.SOCK_DGRAM)[0]
    if ipaddress.ip_address(sockaddr[0]).is_loopback:
        return sockaddr[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        # Connecting a UDP socket sends nothing; it only asks the kernel for the route.
        probe.connect((sockaddr[0], 9))
        return probe.getsockname()[0]


class GlooReceiver(StagedReceiver):
    """Decode end of a Gloo pair. Create with :meth:`listen`.

    Args:
        host: address of this machine to listen on and advertise.
        connect_timeout_s: seconds the sender has to connect.
        data_timeout_s: seconds a layer's bytes may take once its header arrived;
            past that the pair is broken (the sender is stuck or gone).
    """

    name = "gloo"

    def __init__(self, host: str, connect_timeout_s: float, data_timeout_s: float) -> None:
        super().__init__()
        self._host = host
        self._pair_name = f"kv-{uuid.uuid4().hex}"
        self._connect_timeout_s = connect_timeout_s
        self._data_timeout_s = data_timeout_s
        self._store = host_store(host, connect_timeout_s)
        self._connected = threading.Event()
        self._closed = False
        # Posted receives, in header order, from the pump to the completer; an error
        # item fails the board, None ends the completer.
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"{self._pair_name}-completer",
                                           daemon=True)
        self._pump_thread = threading.Thread(target=self._pump, name=f"{self._pair_name}-pump",
                                             daemon=True)
        self._pump_thread.start()

    @classmethod
    def listen(cls, host: str = "127.0.0.1", *, connect_timeout_s: float = 300.0,
               data_timeout_s: float = 60.0) -> GlooReceiver:
        return cls(host, connect_timeout_s, data_timeout_s)

    @property
    def rendezvous(self) -> dict[str, Any]:
        return {"transport": self.name, "host": self._host, "port": self._store.port,
                "name": self._pair_name}

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def _pump(self) -> None:
        # Top of a thread: every failure is handed to the receive() callers through
        # the arrivals board, which is the only place anyone could act on it.
        try:
            # Own clients for the group's rendezvous and for the blocking pops: a store
            # client serves one request at a time, and close() must reach the store
            # through self._store while this thread waits.
            pair_store = dist.PrefixStore(self._pair_name, join_store(
                self._host, self._store.port, self._connect_timeout_s))
            check_peer(pair_store, self._pair_name, self._connect_timeout_s)
            try:
                group = _gloo_group(pair_store, RECEIVER_RANK, self._host, self._connect_timeout_s)
            except RuntimeError as e:
                raise KVTransferError(
                    f"sender did not connect within {self._connect_timeout_s} s: {e}") from e
            self._connected.set()
            threading.Thread(target=self._watch, args=(group,), name=f"{self._pair_name}-watchdog",
                             daemon=True).start()
            pump_store = dist.PrefixStore(
                self._pair_name, join_store(self._host, self._store.port, self._connect_timeout_s))
            headers = HeaderQueue(pump_store, blocking=True)
            self._completer.start()
            while True:
                header = headers.pop()
                if header.kind == STOP:
                    return
                if header.kind == HANDOFF:
                    self._hand_off(pump_store, header)
                    continue
                if header.kind == SENDER_CLOSED:
                    # Behind the receives already posted: their layers still land.
                    self._posted.put(KVTransferError("the sender closed the pair"))
                    return
                if header.kind != DATA:
                    raise KVTransferError(f"unknown header kind {header.kind}")
                staging = torch.empty(header.nbytes, dtype=torch.uint8)
                work = group.recv([staging], SENDER_RANK, header.tag)
                self._posted.put((header, work, staging))
        except KVTransferError as e:
            self._arrivals.fail(e)
        except Exception as e:  # noqa: BLE001 - see the comment at the top of this method
            self._arrivals.fail(KVTransferError(f"KV receive thread failed: {e!r}"))
            raise
        finally:
            # However the pump ends, the completer finishes what was posted, then exits.
            self._posted.put(None)

    def _complete(self) -> None:
        # Waits for the posted receives in order, apart from the pump: Gloo runs a
        # small handshake per message, and posting each receive only after the
        # previous one completed stalls every layer on it (measured for 128 tokens x
        # 30 layers on loopback: 74 ms serial, 10 ms with this split).
        wait_timeout = datetime.timedelta(seconds=self._data_timeout_s)
        while True:
            item = self._posted.get()
            if item is None:
                return
            if isinstance(item, KVTransferError):
                self._arrivals.fail(item)
                return
            header, work, staging = item
            try:
                work.wait(wait_timeout)
            except RuntimeError as e:
                self._arrivals.fail(KVTransferError(
                    f"pair broken while receiving transfer {header.transfer_id} "
                    f"layer {header.layer}: {e}"))
                return
            self._arrivals.put(header.transfer_id, header.layer, staging)

    def _watch(self, group: dist.ProcessGroupGloo) -> None:
        # Gloo cannot cancel a posted receive, so this thread lives until the sender
        # says goodbye or its connection drops; it holds the group until then.
        try:
            group.recv([torch.empty(1, dtype=torch.uint8)], SENDER_RANK, WATCHDOG_TAG).wait(FOREVER)
        except RuntimeError as e:
            self._arrivals.fail(KVTransferError(f"lost the connection to the sender: {e}"))

    def _state_note(self) -> str:
        return "" if self.connected else " (the sender has not connected)"

    def _land(self, ticket: KVTransferTicket, layer: int, payload: torch.Tensor,
              kv_cache: torch.Tensor, dst: torch.Tensor, deadline: float) -> None:
        check_staged_size(ticket, layer, payload.numel())
        blocks = payload.view(ticket.layout.torch_dtype).view(ticket.layout.block_shape(ticket.num_sent_blocks))
        scatter_blocks(kv_cache[layer], ticket.sent_dst_block_ids, blocks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        HeaderQueue(dist.PrefixStore(self._pair_name, self._store)).push(Header(STOP))
        if self._connected.is_set():
            # The pump exits at STOP; the completer once the layers already posted landed.
            self._pump_thread.join(self._data_timeout_s)
            self._completer.join(self._data_timeout_s)
        self._arrivals.fail(KVTransferError("the receiver is closed"))


class GlooSender(KVSender):
    """Prefill end of a Gloo pair. Create with :meth:`connect`."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroupGloo, pair_store: dist.Store, inbox: TicketInbox,
                 peer: str) -> None:
        self._group = group
        self._store = pair_store
        self._queue = HeaderQueue(pair_store)
        self._inbox = inbox
        self._peer = peer
        self._lock = threading.Lock()
        self._inflight: dict[int, InflightTicket] = {}
        self._error: KVTransferError | None = None
        self._closed = False

    @classmethod
    def connect(cls, rendezvous: dict[str, Any], *, timeout_s: float = 60.0,
                local_host: str | None = None) -> GlooSender:
        """See :meth:`KVSender.connect`.

        Args:
            local_host: this worker's address as the receiver reaches it (where its
                Gloo device listens); by default the local end of the route to
                ``rendezvous["host"]``.
        """
        host, port, pair_name = rendezvous["host"], rendezvous["port"], rendezvous["name"]
        pair_store = dist.PrefixStore(pair_name, join_store(host, port, timeout_s))
        present_secret(pair_store, pair_name, timeout_s)
        try:
            group = _gloo_group(pair_store, SENDER_RANK, local_host or local_address_for(host),
                                timeout_s)
        except RuntimeError as e:
            raise KVTransferError(f"cannot join KV pair {pair_name} at {host}:{port}: {e}") from e
        return cls(group, pair_store, TicketInbox(host, port, pair_name, timeout_s),
                   f"{host}:{port}")

    @property
    def error(self) -> KVTransferError | None:
        """Why this pair can no longer send, or None while it can."""
        return self._error

    def _check_usable(self) -> None:
        if self._closed:
            raise KVTransferError("the sender is closed")
        if self._error is not None:
            raise KVTransferError(f"the pair to {self._peer} is broken: {self._error}")

    def send_layer(self, ticket: KVTransferTicket, layer: int, src_block_ids: Sequence[int],
                   kv_cache: torch.Tensor) -> None:
        check_send_args(ticket, layer, src_block_ids, kv_cache)
        data = None
        if ticket.num_sent_blocks:
            # [2, n, block_size, heads, head_dim], contiguous, as raw bytes.
            data = gather_blocks(kv_cache[layer], src_block_ids).cpu().view(-1).view(torch.uint8)
        with self._lock:
            self._check_usable()
            inflight = self._inflight.setdefault(ticket.transfer_id, InflightTicket(ticket))
            inflight.add_layer(ticket, layer)
            if data is None:
                return
            tag = message_tag(ticket.transfer_id, layer, ticket.layout.num_layers)
            try:
                work = self._group.send([data], RECEIVER_RANK, tag)
                # After the send is posted, so that the receiver's matching recv
                # always has bytes on the way.
                self._queue.push(Header(DATA, ticket.transfer_id, layer, data.numel(), tag))
            except (RuntimeError, dist.DistError) as e:
                self._error = KVTransferError(f"send failed: {e}")
                raise self._error from e
            inflight.sends.append((work, data))

    def set_ticket_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        self._inbox.set_handler(handler)

    def post_handoff(self, transfer_id: int, payload: dict[str, Any]) -> None:
        with self._lock:
            self._check_usable()
            try:
                post_handoff(self._store, self._queue, transfer_id, payload)
            except (RuntimeError, dist.DistError) as e:
                self._error = KVTransferError(f"handoff failed: {e}")
                raise self._error from e

    def finish(self, ticket: KVTransferTicket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            inflight = self._inflight.pop(ticket.transfer_id, None)
        if ticket.num_sent_blocks == 0:
            return
        if inflight is None:
            raise KVTransferError(f"request {ticket.request_id!r} transfer {ticket.transfer_id}: "
                                  "no layer was sent")
        self._wait_sends(inflight.sends, deadline, ticket)
        missing = inflight.missing_layers()
        if missing:
            raise KVTransferError(f"request {ticket.request_id!r} transfer {ticket.transfer_id}: "
                                  f"layers {missing} were never sent")

    def _wait_sends(self, sends: list[tuple[Any, torch.Tensor]], deadline: float,
                    ticket: KVTransferTicket | None) -> None:
        what = (f"request {ticket.request_id!r} transfer {ticket.transfer_id}"
                if ticket is not None else "pending sends")
        for work, _ in sends:
            # Gloo treats a zero timeout as "use the default", so never pass zero.
            left = max(deadline - time.monotonic(), 1e-3)
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                timed_out = time.monotonic() >= deadline
                with self._lock:
                    self._error = KVTransferError(
                        f"{what}: {'timed out' if timed_out else 'failed'} sending to "
                        f"{self._peer}: {e}")
                raise self._error from e

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """See :meth:`KVSender.close`; first waits up to ``drain_timeout_s`` seconds for unfinished sends.

        A receiver that is already gone is not an error here (it is recorded in
        :attr:`error`): the pair is over either way.

        Raises:
            KVTransferError: unfinished sends failed or did not drain in time.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [s for inflight in self._inflight.values() for s in inflight.sends]
            self._inflight.clear()
        try:
            if pending and self._error is None:
                self._wait_sends(pending, time.monotonic() + drain_timeout_s, None)
        finally:
            self._inbox.close(self._store)
            if self._error is None:
                self._say_goodbye(drain_timeout_s)

    def _say_goodbye(self, timeout_s: float) -> None:
        """Tell the receiver this end is gone; a receiver that is already gone needs no telling."""
        try:
            self._queue.push(Header(SENDER_CLOSED))
            self._group.send([torch.zeros(1, dtype=torch.uint8)], RECEIVER_RANK,
                             WATCHDOG_TAG).wait(datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as e:
            self._error = KVTransferError(f"goodbye to {self._peer} failed: {e}")
            logger.info("KV sender closed without a goodbye: %s", self._error)


TRANSPORT = Transport(sender=GlooSender, receiver=GlooReceiver)
