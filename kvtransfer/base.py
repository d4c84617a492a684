"""Transport interface for KV transfer, and the registry keyed by config string.

One sender/receiver pair links one prefill worker to one decode worker. The
decode side listens first (it owns the destination blocks); its
:attr:`KVReceiver.rendezvous` is a small dict of plain values (host, port, and for
NCCL the 128-byte unique id) that the control plane (a Ray actor call) hands to
the prefill side, which connects with :meth:`KVSender.connect`. KV bytes only ever
flow over the pair itself.

Per request::

    decode:  ticket = reserve blocks ...                    (control plane carries ticket.to_dict())
    prefill: for layer in range(L): compute layer; sender.send_layer(ticket, layer, src_block_ids, kv_cache)
             sender.finish(ticket, timeout_s)               # raises KVTransferError
    decode:  receiver.receive(ticket, kv_cache, timeout_s)  # raises KVTransferError, never hangs

The handshake rides on the pair too, so the router need not carry it: the decode
side posts each ticket (:meth:`KVReceiver.post_ticket`) and the prefill side reads
it from its sender (:meth:`KVSender.set_ticket_handler`); after the last layer the
prefill side hands over the first token it sampled (:meth:`KVSender.post_handoff`,
delivered to :attr:`KVReceiver.on_handoff`).

Receivers drain the wire eagerly into staging buffers, so a layer can arrive
before :meth:`KVReceiver.receive` is called; every ticket must therefore end in
``receive`` or :meth:`KVReceiver.discard`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from tandem.kvtransfer.layout import KVLayout, KVTransferTicket, check_compatible


class KVTransferError(RuntimeError):
    """A transfer failed: timeout, peer gone, pair broken, or inconsistent data."""


class KVSender(ABC):
    """Prefill side of a pair. Thread-safe."""

    name: str = ""

    @classmethod
    @abstractmethod
    def connect(cls, rendezvous: dict[str, Any], *, timeout_s: float = 60.0,
                local_host: str | None = None) -> KVSender:
        """Join the pair that a receiver's :attr:`KVReceiver.rendezvous` describes.

        Blocks until both ends are connected.

        Args:
            local_host: this worker's address as the receiver reaches it (its node
                IP), for a transport whose sender listens too; None: the transport
                picks (Gloo: the local end of the route to the receiver, which for a
                loopback receiver is the receiver's own address).

        Raises:
            KVTransferError: the receiver could not be reached within ``timeout_s`` seconds.
        """

    @abstractmethod
    def send_layer(self, ticket: KVTransferTicket, layer: int, src_block_ids: Sequence[int],
                   kv_cache: torch.Tensor) -> None:
        """Queue layer ``layer`` of ``ticket`` for sending and return without waiting for the wire.

        The blocks are gathered into a private buffer before this returns (on a
        GPU: ordered after the work already queued on the current stream), so the
        caller may go on computing the next layer and may overwrite the blocks.
        Every ticket given to ``send_layer`` must end in :meth:`finish`, also when
        a later layer failed: ``finish`` then raises, but it is what releases the
        ticket's buffers.

        Args:
            ticket: the receiver's reservation.
            layer: ``0 <= layer < ticket.layout.num_layers``; each layer once per ticket.
            src_block_ids: this worker's blocks holding the sent part of the
                sequence, ``len == ticket.num_sent_blocks``, in sequence order.
            kv_cache: this worker's ``[L, 2, NB, block_size, heads, head_dim]`` cache.

        Raises:
            KVLayoutMismatchError: ``kv_cache`` does not match ``ticket.layout``.
            ValueError: bad layer, layer sent twice, wrong number or range of block ids.
            KVTransferError: the pair is broken or closed.
        """

    @abstractmethod
    def finish(self, ticket: KVTransferTicket, timeout_s: float) -> None:
        """Wait until every layer of ``ticket`` has left this worker; forget the ticket.

        Raises:
            KVTransferError: a layer was never passed to :meth:`send_layer`, the
                pair broke, or the wire did not drain within ``timeout_s`` seconds
                (a sender-side timeout means the receiver stopped draining; the
                pair is then broken and must be re-created).
        """

    @abstractmethod
    def set_ticket_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        """Give every ticket the receiver posts (:meth:`KVReceiver.post_ticket`, a
        ``KVTransferTicket.to_dict()``) to ``handler``, those that arrived before
        this call first. ``handler`` runs on a thread of the sender's and must not block."""

    @abstractmethod
    def post_handoff(self, transfer_id: int, payload: dict[str, Any]) -> None:
        """Hand the receiver ``payload`` (plain values: the first token) for
        ``transfer_id``, behind that transfer's layers; call after :meth:`finish`.

        Raises:
            KVTransferError: the pair is broken or closed.
        """

    @abstractmethod
    def close(self) -> None:
        """Tell the receiver this sender is gone and release the pair. Idempotent."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side of a pair. Thread-safe; several tickets may be received concurrently."""

    name: str = ""

    @classmethod
    @abstractmethod
    def listen(cls, host: str = "127.0.0.1", *, connect_timeout_s: float = 300.0) -> KVReceiver:
        """Open the receiving end on ``host`` (an address of this machine the sender can reach).

        Returns at once; the sender may connect within ``connect_timeout_s`` seconds.
        Ports are chosen by the OS.
        """

    @property
    @abstractmethod
    def rendezvous(self) -> dict[str, Any]:
        """Plain values (str, int, bytes) to hand to :meth:`KVSender.connect` on the other worker."""

    @abstractmethod
    def receive_layers(self, ticket: KVTransferTicket, kv_cache: torch.Tensor,
                       timeout_s: float) -> Iterator[int]:
        """Land ``ticket``'s layers in ``kv_cache`` at ``ticket.sent_dst_block_ids``, one at a time.

        A generator: yields each layer index (in arrival order) once its blocks are
        in ``kv_cache`` and visible to the caller. Only the ticket's sent
        destination blocks are written.

        Args:
            ticket: the reservation the sender was given.
            kv_cache: this worker's ``[L, 2, NB, block_size, heads, head_dim]`` cache.
            timeout_s: seconds for the whole ticket, counted from the first ``next()``.

        Raises:
            KVLayoutMismatchError: ``kv_cache`` does not match ``ticket.layout``.
            ValueError: a destination block id is outside ``kv_cache``.
            KVTransferError: not all layers landed within ``timeout_s`` (the ticket
                is then discarded and the receiver stays usable), the sender closed
                or died, or an arriving layer has the wrong size.
        """

    def receive(self, ticket: KVTransferTicket, kv_cache: torch.Tensor, timeout_s: float) -> None:
        """Block until every layer of ``ticket`` landed in ``kv_cache``; see :meth:`receive_layers`."""
        for _ in self.receive_layers(ticket, kv_cache, timeout_s):
            pass

    on_handoff: Callable[[int, dict[str, Any]], None] | None = None
    """Called with ``(transfer_id, payload)`` for each :meth:`KVSender.post_handoff`
    of the sender, on the receiver's thread; set by the owner, must not block."""

    @abstractmethod
    def post_ticket(self, ticket: dict[str, Any]) -> None:
        """Post ``ticket`` (``KVTransferTicket.to_dict()``) to the sender's ticket
        handler; kept until the sender reads it (it may connect later).

        Raises:
            KVTransferError: the pair's store cannot be reached.
        """

    @abstractmethod
    def discard(self, transfer_id: int) -> None:
        """Drop whatever arrived or will arrive for ``transfer_id`` (e.g. the request was aborted)."""

    @abstractmethod
    def extend(self, transfer_id: int, timeout_s: float) -> None:
        """Give a receive of ``transfer_id`` at least ``timeout_s`` more seconds from
        now (its sender is alive and busy with other work: the transfer is queued,
        not stalled). No effect on a finished or discarded transfer."""

    @abstractmethod
    def close(self) -> None:
        """Stop receiving and release the pair. Idempotent."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_send_args(ticket: KVTransferTicket, layer: int, src_block_ids: Sequence[int],
                    kv_cache: torch.Tensor) -> None:
    """The checks every :meth:`KVSender.send_layer` makes before touching the wire.

    The transport sees only the tensor: its shape and dtype are checked here, the
    fp8 scales' checksum by the connector (taken from the ticket)."""
    check_compatible(KVLayout.from_cache(kv_cache, ticket.layout.kv_scales_checksum),
                     ticket.layout)
    if not 0 <= layer < ticket.layout.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {ticket.layout.num_layers})")
    if len(src_block_ids) != ticket.num_sent_blocks:
        raise ValueError(f"request {ticket.request_id}: {len(src_block_ids)} src blocks given, "
                         f"ticket sends {ticket.num_sent_blocks}")
    _check_block_range(src_block_ids, kv_cache.shape[2], "src_block_ids")


def check_receive_args(ticket: KVTransferTicket, kv_cache: torch.Tensor) -> None:
    """The checks every :meth:`KVReceiver.receive_layers` makes before waiting (shape
    and dtype; the scales' checksum is the connector's to check)."""
    check_compatible(ticket.layout,
                     KVLayout.from_cache(kv_cache, ticket.layout.kv_scales_checksum))
    _check_block_range(ticket.sent_dst_block_ids, kv_cache.shape[2], "dst_block_ids")


def _check_block_range(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} {bad} outside the cache's {num_blocks} blocks")


class Transport(NamedTuple):
    """The two ends of one transport kind."""

    sender: type[KVSender]
    receiver: type[KVReceiver]


# Config string -> module defining the transport. Modules are imported on first use
# so that choosing "gloo" never loads CUDA/NCCL code, and vice versa.
_TRANSPORT_MODULES: dict[str, str] = {
    "gloo": "tandem.kvtransfer.gloo",
    "nccl": "tandem.kvtransfer.nccl",
}


def transport_names() -> list[str]:
    """Config strings accepted by :func:`get_transport`."""
    return sorted(_TRANSPORT_MODULES)


def get_transport(name: str) -> Transport:
    """The sender and receiver classes for a config string (``"gloo"``, ``"nccl"``).

    Raises:
        ValueError: unknown name.
    """
    if name not in _TRANSPORT_MODULES:
        raise ValueError(f"unknown KV transport {name!r}; known: {transport_names()}")
    module = importlib.import_module(_TRANSPORT_MODULES[name])
    return module.TRANSPORT
