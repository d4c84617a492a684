"""The engine's KV connector over a sender/receiver transport (Gloo on CPU, NCCL on GPU).

One :class:`TransportKVConnector` per engine holds a pair per peer: senders on a
prefill engine, receivers on a decode engine. Sends are queued layer by layer
from inside the forward pass (:meth:`save_kv_layer`); receives run on a small
fixed pool of threads (``receive`` blocks until every layer of a ticket landed or
its timeout passed), whose results the engine collects each step with
:meth:`get_finished_loads`. Layers that arrive before their receive starts wait
in the transport's staging buffers, so a queued receive never stalls the wire.

The handshake rides on the same pairs: :meth:`start_load` posts each ticket to
its producer, which a producer engine waits for (:meth:`ticket_future`) when
its request came without one, and the producer's first token comes back on the
pair (:meth:`send_first_token`, :meth:`get_first_tokens`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tandem.engine.kv.kv_connector import KVConnector, KVSave, KVTransferParams
from tandem.kvtransfer.base import KVReceiver, KVSender, KVTransferError, get_transport
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket, check_compatible

logger = logging.getLogger(__name__)

_MAX_EARLY_TICKETS = 4096
"""Tickets kept for requests whose producer call has not asked for them yet (the
decode side reserved first), and ids of requests given up, whose late tickets are
dropped: bounded, oldest out first."""


_MAX_LOAD_IDS = 1 << 16
"""Loads remembered for their first token (transfer ids are unique per pair)."""


def _trim(entries: OrderedDict, limit: int = _MAX_EARLY_TICKETS) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)


def _logprobs_payload(logprobs: Any) -> dict[str, Any]:
    if logprobs is None:
        return {}
    return {"logprob": logprobs.logprob, "top": [list(t) for t in logprobs.top]}


def _payload_logprobs(payload: dict[str, Any]) -> Any:
    if "logprob" not in payload:
        return None
    from tandem.engine.scheduling.request import TokenLogprobs

    return TokenLogprobs(int(payload["token_id"]), float(payload["logprob"]),
                         tuple((int(t), float(lp)) for t, lp in payload["top"]))


class TransportKVConnector(KVConnector):
    """A :class:`KVConnector` over the transport named ``transport``.

    Args:
        transport: config string of :func:`tandem.kvtransfer.base.get_transport`.
        kv_cache: the engine's ``[L, 2, NB, BS, Hkv, D]`` cache tensor.
        notify: called when a load finishes (wakes an idle engine loop).
        transfer_timeout_s: seconds a send may take to drain, and a receive to land
            every layer, before the transfer counts as failed.
        num_receive_threads: receives that run at once (others queue; their
            layers are staged meanwhile).
        kv_scales: ``[L, 2, Hkv]`` float32 scales of an fp8 ``kv_cache`` (their
            checksum joins the layout, so a peer quantizing with other scales is
            refused); None for a cache in the model dtype. The quantized bytes
            travel as they are; the scales never do.
    """

    def __init__(self, transport: str, kv_cache: Any, notify: Callable[[], None] | None = None,
                 transfer_timeout_s: float = 60.0, num_receive_threads: int = 4,
                 kv_scales: Any = None):
        from tandem.engine.runtime.kv_scales import scales_checksum

        super().__init__(kv_cache, notify)
        self.transport = get_transport(transport)
        self.transfer_timeout_s = transfer_timeout_s
        self._layout = KVLayout.from_cache(kv_cache, scales_checksum(kv_scales))
        self._senders: dict[str, KVSender] = {}
        self._receivers: dict[str, KVReceiver] = {}
        # peer id -> the producer generation its channel is for: consumer side the
        # peer's (open_channel), producer side this engine's own (connect).
        self._peer_generations: dict[str, int] = {}
        self._own_generations: dict[str, int] = {}
        # Producer state of the current step: (request id, ticket, sender, source block ids).
        self._saving: list[tuple[str, KVTransferTicket, KVSender, list[int]]] = []
        self._failed: dict[str, str] = {}
        self.kv_transfer_bytes = 0            # bytes of completed sends, all time
        # Consumer state: request id -> (receive future, receiver, ticket).
        self._loads: dict[str, tuple[Future, KVReceiver | None, KVTransferTicket | None]] = {}
        self._transfer_ids = itertools.count()
        self._pool = ThreadPoolExecutor(num_receive_threads, thread_name_prefix="kv-recv")
        # The handshake. Consumer: (peer, transfer id) -> request id of the loads
        # started, and the first tokens handed over. Producer: tickets waited for
        # and tickets that came first, keyed (peer, request id, attempt).
        self._handshake_lock = threading.Lock()
        # A load's entry stays after the load ended (its token may come later, and a
        # request whose load failed still needs it to be recomputed) until its token
        # came or it is among the oldest of _MAX_LOAD_IDS.
        self._load_ids: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._first_tokens: list[tuple[str, int, Any]] = []
        self._ticket_waits: dict[tuple[str, str, int], Future] = {}
        self._early_tickets: OrderedDict[tuple[str, str, int], dict] = OrderedDict()
        self._forgotten: OrderedDict[tuple[str, str], None] = OrderedDict()

    # -- channels --------------------------------------------------------------------------
    def layout(self) -> dict:
        return self._layout.to_dict()

    def open_channel(self, peer_id: str, host: str, peer_generation: int = 0) -> dict:
        receiver = self.transport.receiver.listen(host)
        old = self._receivers.pop(peer_id, None)
        if old is not None:
            old.close()
        self._receivers[peer_id] = receiver
        self._peer_generations[peer_id] = peer_generation
        receiver.on_handoff = functools.partial(self._on_handoff, peer_id)
        return receiver.rendezvous

    def connect(self, peer_id: str, rendezvous: dict, peer_layout: dict,
                local_host: str | None = None, generation: int = 0) -> None:
        check_compatible(self._layout, KVLayout.from_dict(peer_layout))
        sender = self.transport.sender.connect(rendezvous, local_host=local_host)
        old = self._senders.pop(peer_id, None)
        if old is not None:
            old.close()
        self._senders[peer_id] = sender
        self._own_generations[peer_id] = generation
        sender.set_ticket_handler(functools.partial(self._on_ticket, peer_id))

    def close_channel(self, peer_id: str) -> bool:
        self._peer_generations.pop(peer_id, None)
        self._own_generations.pop(peer_id, None)
        end = self._senders.pop(peer_id, None) or self._receivers.pop(peer_id, None)
        if end is not None:
            end.close()
        return end is not None

    # -- producer --------------------------------------------------------------------------
    def start_save(self, saves: Sequence[KVSave]) -> None:
        self._saving, self._failed = [], {}
        for s in saves:
            try:
                ticket = KVTransferTicket.from_dict(s.params.ticket)
                check_compatible(self._layout, ticket.layout)
            except ValueError as exc:        # KVLayoutMismatchError included
                self._failed[s.request_id] = str(exc)
                continue
            sender = self._senders.get(s.params.peer_id)
            if sender is None:
                self._failed[s.request_id] = f"no KV channel to {s.params.peer_id}"
                continue
            own = self._own_generations[s.params.peer_id]
            if ticket.producer_generation != own:
                # A zombie: the blocks behind this ticket were reserved for another
                # incarnation of this worker, and may belong to another request now.
                self._failed[s.request_id] = (
                    f"ticket for producer generation {ticket.producer_generation}, this "
                    f"producer is generation {own}: refused")
                continue
            src = [s.block_ids[i] for i in ticket.sent_block_indices()]
            self._saving.append((s.request_id, ticket, sender, src))
            with self._handshake_lock:      # the caller brought the ticket: the pair's copy is moot
                self._early_tickets.pop((s.params.peer_id, s.request_id, ticket.attempt), None)

    def save_kv_layer(self, layer: int) -> None:
        for rid, ticket, sender, src in self._saving:
            if rid in self._failed:
                continue
            try:
                sender.send_layer(ticket, layer, src, self.kv_cache)
            except (KVTransferError, ValueError) as exc:
                self._failed[rid] = str(exc)

    def wait_for_save(self) -> dict[str, str]:
        for rid, ticket, sender, _ in self._saving:
            # finish() even after a failed send_layer: it releases the ticket's buffers.
            try:
                sender.finish(ticket, self.transfer_timeout_s)
            except KVTransferError as exc:
                self._failed.setdefault(rid, str(exc))
                continue
            if rid not in self._failed:
                self.kv_transfer_bytes += ticket.bytes_per_layer * ticket.layout.num_layers
        failed, self._saving, self._failed = self._failed, [], {}
        return failed

    def ticket_future(self, peer_id: str, request_id: str, attempt: int) -> Future:
        key = (peer_id, request_id, attempt)
        with self._handshake_lock:
            self._forgotten.pop((peer_id, request_id), None)
            fut = self._ticket_waits.get(key)
            if fut is None:
                fut = self._ticket_waits[key] = Future()
                early = self._early_tickets.pop(key, None)
                if early is not None:
                    del self._ticket_waits[key]
                    fut.set_result(early)
        return fut

    def forget_ticket(self, peer_id: str, request_id: str) -> None:
        with self._handshake_lock:
            self._forgotten[(peer_id, request_id)] = None
            _trim(self._forgotten)
            for key in [k for k in self._ticket_waits if k[:2] == (peer_id, request_id)]:
                self._ticket_waits.pop(key).cancel()
            for key in [k for k in self._early_tickets if k[:2] == (peer_id, request_id)]:
                del self._early_tickets[key]

    def _on_ticket(self, peer_id: str, ticket: dict) -> None:
        """A ticket from consumer ``peer_id`` arrived (on the sender's thread)."""
        key = (peer_id, str(ticket.get("request_id")), ticket.get("attempt", 0))
        with self._handshake_lock:
            if key[:2] in self._forgotten:
                return                      # given up here: the consumer's load times out
            fut = self._ticket_waits.pop(key, None)
            if fut is None:
                self._early_tickets[key] = ticket
                _trim(self._early_tickets)
                return
        fut.set_result(ticket)

    def send_first_token(self, params: KVTransferParams, token_id: int,
                         logprobs: Any = None) -> str | None:
        sender = self._senders.get(params.peer_id)
        if sender is None:
            return f"no KV channel to {params.peer_id}"
        try:
            sender.post_handoff(int(params.ticket["transfer_id"]),
                                {"token_id": int(token_id), **_logprobs_payload(logprobs)})
        except KVTransferError as exc:
            return str(exc)
        return None

    # -- consumer --------------------------------------------------------------------------
    def _on_handoff(self, peer_id: str, transfer_id: int, payload: dict) -> None:
        """Producer ``peer_id`` handed over a first token (on the receiver's thread)."""
        with self._handshake_lock:
            rid = self._load_ids.pop((peer_id, transfer_id), None)
            if rid is None:
                return                      # not a load of this connector's (any more)
            try:
                token = int(payload["token_id"])
                logprobs = _payload_logprobs(payload)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("request %s: dropped a malformed first-token handoff: %s", rid, e)
                return
            self._first_tokens.append((rid, token, logprobs))
        self.notify()

    def get_first_tokens(self) -> list[tuple[str, int, Any]]:
        with self._handshake_lock:
            tokens, self._first_tokens = self._first_tokens, []
        return tokens

    def start_load(self, request_id: str, block_ids: Sequence[int], num_cached_tokens: int,
                   num_tokens: int, params: KVTransferParams) -> dict:
        receiver = self._receivers.get(params.peer_id)
        generation = self._peer_generations.get(params.peer_id, params.peer_generation)
        ticket = KVTransferTicket(request_id, next(self._transfer_ids), tuple(block_ids),
                                  num_cached_tokens, num_tokens, self._layout,
                                  params.attempt, generation)
        fut: Future = Future()
        if receiver is None:
            fut.set_exception(KVTransferError(f"no KV channel to {params.peer_id}"))
        elif params.peer_generation != generation:
            # The router chose an incarnation of the producer this channel is not for.
            receiver.discard(ticket.transfer_id)     # whatever arrives for it is dropped
            fut.set_exception(KVTransferError(
                f"request {request_id!r} expects producer {params.peer_id} generation "
                f"{params.peer_generation}, the KV channel is for generation {generation}"))
        else:
            try:
                receiver.post_ticket(ticket.to_dict())
            except KVTransferError as exc:
                receiver.discard(ticket.transfer_id)
                fut.set_exception(exc)
            else:
                with self._handshake_lock:
                    self._load_ids[(params.peer_id, ticket.transfer_id)] = request_id
                    _trim(self._load_ids, _MAX_LOAD_IDS)
                fut = self._pool.submit(receiver.receive, ticket, self.kv_cache,
                                        self.transfer_timeout_s)
        self._loads[request_id] = (fut, receiver, ticket)
        fut.add_done_callback(lambda _: self.notify())
        return ticket.to_dict()

    def cancel_load(self, request_id: str) -> None:
        entry = self._loads.get(request_id)
        if entry is not None and entry[1] is not None:
            entry[1].discard(entry[2].transfer_id)

    def extend_load(self, request_id: str, timeout_s: float) -> bool:
        entry = self._loads.get(request_id)
        if entry is None or entry[1] is None or entry[0].done():
            return False
        entry[1].extend(entry[2].transfer_id, timeout_s)
        return True

    def get_finished_loads(self) -> list[tuple[str, str | None]]:
        done = []
        for rid, (fut, _, _) in list(self._loads.items()):
            if fut.done():
                del self._loads[rid]
                exc = fut.exception()
                if exc is not None:
                    logger.warning("KV load of %s failed: %s", rid, exc)
                done.append((rid, None if exc is None else str(exc)))
        return done

    @property
    def num_dropped_layers(self) -> int:
        """Layers that reached this (consumer) engine for a transfer it had already
        received, cancelled or failed (a late or zombie producer's), dropped without
        touching the cache; summed over the current channels."""
        return sum(r.num_dropped_layers for r in self._receivers.values())

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        for end in [*self._senders.values(), *self._receivers.values()]:
            end.close()
        self._senders.clear()
        self._receivers.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
