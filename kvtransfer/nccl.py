"""GPU transport: a 2-rank NCCL communicator per prefill/decode pair, via ctypes on libnccl.

The receiver (decode side, rank 0) makes the ``ncclUniqueId`` and hosts the
pair's ``TCPStore``; both travel to the sender in :attr:`NCCLReceiver.rendezvous`
(host, port, pair name, the 128 id bytes). KV goes GPU to GPU with
``ncclSend``/``ncclRecv`` on a private CUDA stream at each end; headers go
through the store's queue exactly as for Gloo (see :mod:`tandem.kvtransfer.staging`).

NCCL has no message tags: point-to-point messages between two ranks match in
the order they were issued. The sender pushes the header and issues ``ncclSend``
under one lock, and the receiver's pump posts ``ncclRecv`` in header order, so
the n-th receive always meets the n-th send however transfers interleave. The
header goes first because NCCL sets up a peer connection lazily, inside the first
``ncclSend``'s ``ncclGroupEnd``, which blocks until the peer posts a matching
operation; for the same reason both ends exchange one warm-up byte when the pair
is made, which keeps connection setup out of the first request's latency.

Failure behaviour:

* a sender that never sends: nothing is posted for it; ``receive`` raises
  :class:`KVTransferError` at its timeout and the receiver stays usable.
* a layer whose header arrived but whose bytes do not within the caller's
  timeout (the sender died mid-transfer): a posted NCCL receive cannot be
  cancelled, so the communicator is aborted and the pair is broken
  (:attr:`NCCLReceiver.error`); re-create it. NCCL has no cheap way to notice a
  dead peer that was idle: such a death shows as timeouts.
* NCCL refuses two ranks on one GPU: a pair needs two devices (two GPUs of one
  machine, or two machines).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from tandem.kvtransfer.base import KVSender, KVTransferError, Transport, check_send_args
from tandem.kvtransfer.layout import KVTransferTicket
from tandem.kvtransfer.libnccl import NCCL_SUCCESS, NCCLLibrary
from tandem.kvtransfer.staging import (DATA, HANDOFF, SENDER_CLOSED, STOP, Header, HeaderQueue,
                                       InflightTicket, StagedReceiver, TicketInbox, check_peer,
                                       check_staged_size, host_store, join_store, post_handoff,
                                       present_secret)

RECEIVER_RANK = 0
SENDER_RANK = 1
_POLL_S = 50e-6  # first sleep between CUDA event polls; doubles up to 1 ms

T = TypeVar("T")


def _cuda_device(device: torch.device | int | str | None) -> torch.device:
    if not torch.cuda.is_available():
        raise KVTransferError("the NCCL KV transport needs CUDA; use 'gloo' on this machine")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"NCCL KV transport needs a CUDA device with an index, got {device}")
    return device


def _wait_event(event: torch.cuda.Event, deadline: float, poll: Callable[[], None] | None = None) -> bool:
    """Poll ``event`` until it completes (True) or ``deadline`` passes (False); never blocks on the GPU."""
    sleep_s = _POLL_S
    while not event.query():
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            return False
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, 1e-3)
    return True


def _run_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run a blocking call on a helper thread; raise KVTransferError if it has not returned in time.

    ``ncclCommInitRank`` has no timeout of its own and blocks until every rank joined.
    """
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            errors.append(e)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise KVTransferError(f"{what} did not finish within {timeout_s} s")
    if errors:
        raise errors[0]
    return result[0]


class NCCLReceiver(StagedReceiver):
    """Decode end of an NCCL pair. Create with :meth:`listen`.

    Args:
        host: address of this machine to listen on and advertise.
        connect_timeout_s: seconds the sender has to connect.
        device: the CUDA device holding this worker's KV cache (default: current).
        library: a loaded :class:`NCCLLibrary` (default: :func:`find_libnccl`'s).
    """

    name = "nccl"

    def __init__(self, host: str, connect_timeout_s: float, device: torch.device | int | str | None,
                 library: NCCLLibrary | None) -> None:
        super().__init__()
        self._device = _cuda_device(device)
        self._lib = library or NCCLLibrary()
        self._host = host
        self._pair_name = f"kv-{uuid.uuid4().hex}"
        self._connect_timeout_s = connect_timeout_s
        self._unique_id = self._lib.unique_id()
        self._store = host_store(host, connect_timeout_s)
        self._stream = torch.cuda.Stream(self._device)
        self._comm: int | None = None
        self._comm_lock = threading.Lock()  # orders recv posting against abort
        self._connected = threading.Event()
        self._closed = False
        self._pump_thread = threading.Thread(target=self._pump, name=f"{self._pair_name}-pump",
                                             daemon=True)
        self._pump_thread.start()

    @classmethod
    def listen(cls, host: str = "127.0.0.1", *, connect_timeout_s: float = 300.0,
               device: torch.device | int | str | None = None,
               library: NCCLLibrary | None = None) -> NCCLReceiver:
        return cls(host, connect_timeout_s, device, library)

    @property
    def rendezvous(self) -> dict[str, Any]:
        return {"transport": self.name, "host": self._host, "port": self._store.port,
                "name": self._pair_name, "unique_id": self._unique_id}

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def _pump(self) -> None:
        # Top of a thread: failures reach the receive() callers through the board.
        try:
            check_peer(dist.PrefixStore(self._pair_name, join_store(
                self._host, self._store.port, self._connect_timeout_s)),
                self._pair_name, self._connect_timeout_s)
            torch.cuda.set_device(self._device)
            comm = self._lib.comm_init_rank(2, self._unique_id, RECEIVER_RANK)
            with self._comm_lock:
                self._comm = comm
            warm_up = torch.empty(1, dtype=torch.uint8, device=self._device)
            self._lib.recv(warm_up.data_ptr(), 1, SENDER_RANK, comm, self._stream.cuda_stream)
            self._stream.synchronize()
            self._connected.set()
            pump_store = dist.PrefixStore(
                self._pair_name, join_store(self._host, self._store.port, self._connect_timeout_s))
            queue = HeaderQueue(pump_store, blocking=True)
            while True:
                header = queue.pop()
                if header.kind == STOP:
                    return
                if header.kind == HANDOFF:
                    self._hand_off(pump_store, header)
                    continue
                if header.kind == SENDER_CLOSED:
                    raise KVTransferError("the sender closed the pair")
                if header.kind != DATA:
                    raise KVTransferError(f"unknown header kind {header.kind}")
                with torch.cuda.stream(self._stream):
                    # Allocated on the transfer stream, so the caching allocator will
                    # not hand this memory to other streams while the receive runs.
                    staging = torch.empty(header.nbytes, dtype=torch.uint8, device=self._device)
                with self._comm_lock:
                    if self._comm is None:
                        raise KVTransferError("the communicator was aborted")
                    self._lib.recv(staging.data_ptr(), header.nbytes, SENDER_RANK, self._comm,
                                   self._stream.cuda_stream)
                    landed = torch.cuda.Event()
                    landed.record(self._stream)
                self._arrivals.put(header.transfer_id, header.layer, (staging, landed))
        except KVTransferError as e:
            self._arrivals.fail(e)
        except Exception as e:  # noqa: BLE001 - see the comment at the top of this method
            self._arrivals.fail(KVTransferError(f"KV receive thread failed: {e!r}"))
            raise

    def _state_note(self) -> str:
        return "" if self.connected else " (the sender has not connected)"

    def _check_comm(self) -> None:
        with self._comm_lock:
            code = NCCL_SUCCESS if self._comm is None else self._lib.async_error(self._comm)
        if code != NCCL_SUCCESS:
            raise KVTransferError(f"NCCL communicator failed: {self._lib.error_string(code)}")

    def _abort(self, error: KVTransferError) -> None:
        with self._comm_lock:
            comm, self._comm = self._comm, None
            if comm is not None:
                self._lib.comm_abort(comm)
        self._arrivals.fail(error)

    def _land(self, ticket: KVTransferTicket, layer: int, payload: tuple[torch.Tensor, torch.cuda.Event],
              kv_cache: torch.Tensor, dst: torch.Tensor, deadline: float) -> None:
        staging, landed = payload
        check_staged_size(ticket, layer, staging.numel())
        if kv_cache.device != self._device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, this receiver on {self._device}")
        try:
            arrived = _wait_event(landed, deadline, self._check_comm)
        except KVTransferError as e:
            self._abort(e)
            raise
        if not arrived:
            error = KVTransferError(
                f"request {ticket.request_id!r} transfer {ticket.transfer_id} layer {layer}: "
                f"announced but not received before the timeout; the pair is broken")
            self._abort(error)
            raise error
        blocks = staging.view(ticket.layout.torch_dtype).view(ticket.layout.block_shape(ticket.num_sent_blocks))
        # The destination blocks may have been freed and re-reserved while kernels
        # queued on the caller's stream still read them: write after those.
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            kv_cache[layer].index_copy_(1, dst, blocks)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        # Host-side wait: the caller may read the cache on any stream after we return.
        copied.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        HeaderQueue(dist.PrefixStore(self._pair_name, self._store)).push(Header(STOP))
        if self._connected.is_set():
            self._pump_thread.join(10.0)
        self._abort(KVTransferError("the receiver is closed"))


class NCCLSender(KVSender):
    """Prefill end of an NCCL pair. Create with :meth:`connect`."""

    name = "nccl"

    def __init__(self, lib: NCCLLibrary, comm: int, device: torch.device, pair_store: dist.Store,
                 inbox: TicketInbox, peer: str) -> None:
        self._lib = lib
        self._comm: int | None = comm
        self._device = device
        self._store = pair_store
        self._queue = HeaderQueue(pair_store)
        self._inbox = inbox
        self._peer = peer
        self._stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._inflight: dict[int, InflightTicket] = {}
        self._error: KVTransferError | None = None
        self._closed = False

    @classmethod
    def connect(cls, rendezvous: dict[str, Any], *, timeout_s: float = 60.0,
                local_host: str | None = None, device: torch.device | int | str | None = None,
                library: NCCLLibrary | None = None) -> NCCLSender:
        """See :meth:`KVSender.connect`; ``device`` is the CUDA device of this worker's KV cache.

        ``local_host`` is not used: NCCL's bootstrap picks its own interface
        (``NCCL_SOCKET_IFNAME``).
        """
        device = _cuda_device(device)
        lib = library or NCCLLibrary()
        host, port, pair_name = rendezvous["host"], rendezvous["port"], rendezvous["name"]
        pair_store = dist.PrefixStore(pair_name, join_store(host, port, timeout_s))
        present_secret(pair_store, pair_name, timeout_s)

        def init() -> int:
            torch.cuda.set_device(device)
            return lib.comm_init_rank(2, bytes(rendezvous["unique_id"]), SENDER_RANK)

        deadline = time.monotonic() + timeout_s
        comm = _run_with_timeout(init, timeout_s, f"joining NCCL KV pair {pair_name}")
        sender = cls(lib, comm, device, pair_store, TicketInbox(host, port, pair_name, timeout_s),
                     f"{host}:{port}")
        warm_up = torch.zeros(1, dtype=torch.uint8, device=device)
        with torch.cuda.device(device):
            lib.send(warm_up.data_ptr(), 1, RECEIVER_RANK, comm, sender._stream.cuda_stream)
        sender._wait_sends([(sender._record(), warm_up)], deadline, "warm-up")
        return sender

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    @property
    def error(self) -> KVTransferError | None:
        """Why this pair can no longer send, or None while it can."""
        return self._error

    def send_layer(self, ticket: KVTransferTicket, layer: int, src_block_ids: Sequence[int],
                   kv_cache: torch.Tensor) -> None:
        check_send_args(ticket, layer, src_block_ids, kv_cache)
        if kv_cache.device != self._device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, this sender on {self._device}")
        data = ready = None
        if ticket.num_sent_blocks:
            src = torch.tensor(list(src_block_ids), dtype=torch.int64, device=self._device)
            # Gathered on the caller's stream, after the kernels that wrote this layer.
            data = kv_cache[layer].index_select(1, src).view(-1).view(torch.uint8)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        with self._lock:
            if self._closed:
                raise KVTransferError("the sender is closed")
            if self._error is not None or self._comm is None:
                raise KVTransferError(f"the pair to {self._peer} is broken: {self._error}")
            inflight = self._inflight.setdefault(ticket.transfer_id, InflightTicket(ticket))
            inflight.add_layer(ticket, layer)
            if data is None:
                return
            # Same lock as the send: header order is NCCL's matching order.
            self._queue.push(Header(DATA, ticket.transfer_id, layer, data.numel(), 0))
            self._stream.wait_event(ready)
            try:
                # NCCL launches on the calling thread's current device.
                with torch.cuda.device(self._device):
                    self._lib.send(data.data_ptr(), data.numel(), RECEIVER_RANK, self._comm,
                                   self._stream.cuda_stream)
            except KVTransferError as e:
                # The receiver already posted a receive for the announced bytes.
                self._error = KVTransferError(f"send failed after its header: {e}")
                raise self._error from e
            data.record_stream(self._stream)
            inflight.sends.append((self._record(), data))

    def _poll_comm(self) -> None:
        comm = self._comm
        code = NCCL_SUCCESS if comm is None else self._lib.async_error(comm)
        if code != NCCL_SUCCESS:
            raise KVTransferError(f"NCCL communicator failed: {self._lib.error_string(code)}")

    def finish(self, ticket: KVTransferTicket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            inflight = self._inflight.pop(ticket.transfer_id, None)
        if ticket.num_sent_blocks == 0:
            return
        if inflight is None:
            raise KVTransferError(f"request {ticket.request_id!r} transfer {ticket.transfer_id}: "
                                  "no layer was sent")
        self._wait_sends(inflight.sends, deadline,
                         f"request {ticket.request_id!r} transfer {ticket.transfer_id}")
        missing = inflight.missing_layers()
        if missing:
            raise KVTransferError(f"request {ticket.request_id!r} transfer {ticket.transfer_id}: "
                                  f"layers {missing} were never sent")

    def _wait_sends(self, sends: list[tuple[torch.cuda.Event, torch.Tensor]], deadline: float,
                    what: str) -> None:
        for sent, _ in sends:
            try:
                done = _wait_event(sent, deadline, self._poll_comm)
            except KVTransferError as e:
                self._break(KVTransferError(f"{what}: {e}"))
                raise self._error from e
            if not done:
                # The receiver stopped posting receives; the queued send can never be
                # cancelled, only the communicator aborted.
                self._break(KVTransferError(f"{what}: timed out sending to {self._peer}"))
                raise self._error

    def set_ticket_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        self._inbox.set_handler(handler)

    def post_handoff(self, transfer_id: int, payload: dict[str, Any]) -> None:
        with self._lock:
            if self._closed or self._error is not None:
                raise KVTransferError(f"the pair to {self._peer} is closed or broken: {self._error}")
            try:
                post_handoff(self._store, self._queue, transfer_id, payload)
            except (RuntimeError, dist.DistError) as e:
                self._error = KVTransferError(f"handoff failed: {e}")
                raise self._error from e

    def _break(self, error: KVTransferError) -> None:
        with self._lock:
            self._error = self._error or error
            comm, self._comm = self._comm, None
        if comm is not None:
            self._lib.comm_abort(comm)

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """See :meth:`KVSender.close`; first waits up to ``drain_timeout_s`` seconds for unfinished sends.

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
                self._wait_sends(pending, time.monotonic() + drain_timeout_s, "pending sends")
        finally:
            self._inbox.close(self._store)
            if self._error is None:
                self._queue.push(Header(SENDER_CLOSED))
            with self._lock:
                comm, self._comm = self._comm, None
            if comm is not None:
                self._lib.comm_abort(comm)


TRANSPORT = Transport(sender=NCCLSender, receiver=NCCLReceiver)
