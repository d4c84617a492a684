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

A tensor-parallel worker's connector lives on its rank 0: a channel to a peer is
then one pair per (prefill rank, decode rank) whose KV heads overlap
(:mod:`tandem.kvtransfer.sharded`); this connector holds rank 0's ends and drives
the other ranks' (``ranks``). A one-rank worker's channel is the single pair
(0, 0) of all the heads.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tandem.engine.kv.kv_connector import KVConnector, KVRankGroup, KVSave, KVTransferParams
from tandem.kvtransfer.base import KVReceiver, KVSender, KVTransferError, get_transport
from tandem.kvtransfer.layout import (KVLayout, KVLayoutMismatchError, KVTransferTicket,
                                      check_compatible)
from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV
from tandem.kvtransfer.sharded import (KVPair, RankControl, StepSends, heads_view, pair_plan,
                                       pair_ticket, parse_worker_layout, wait_for_saved,
                                       worker_layout)

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
        kv_cache: the engine's ``[L, 2, NB, BS, Hkv, D]`` cache tensor (rank 0's,
            ``Hkv`` its heads, in a tensor-parallel worker).
        notify: called when a load finishes (wakes an idle engine loop).
        transfer_timeout_s: seconds a send may take to drain, and a receive to land
            every layer, before the transfer counts as failed.
        num_receive_threads: receives that run at once (others queue; their
            layers are staged meanwhile).
        kv_scales: ``[L, 2, Hkv]`` float32 scales of an fp8 ``kv_cache``, all the
            model's KV heads also in a tensor-parallel worker
            (:func:`~tandem.engine.runtime.kv_scales.gather_model_kv_scales`): their
            checksum joins the layout, so a peer quantizing with other scales is
            refused; None for a cache in the model dtype. The quantized bytes
            travel as they are (a pair's heads of them between sharded workers); the
            scales never do.
        ranks: a tensor-parallel worker's ranks (their KV heads, and the commands
            that drive ranks 1..); None for a one-rank worker. An int4 cache's
            packed rows travel per head too; each decode rank rebuilds an open
            block's K entry from its own heads' rows, as one rank does.
    """

    def __init__(self, transport: str, kv_cache: Any, notify: Callable[[], None] | None = None,
                 transfer_timeout_s: float = 60.0, num_receive_threads: int = 4,
                 kv_scales: Any = None, ranks: KVRankGroup | None = None):
        from tandem.engine.runtime.kv_scales import scales_checksum

        super().__init__(kv_cache, notify)
        self.transport_name = transport
        self.transport = get_transport(transport)
        self.transfer_timeout_s = transfer_timeout_s
        local = KVLayout.from_cache(kv_cache, scales_checksum(kv_scales))
        self._ranks = ranks or KVRankGroup(((0, local.num_kv_heads),))
        self._control = (RankControl(self._ranks.store_host, self._ranks.store_port)
                         if self._ranks.world_size > 1 else None)
        self._head_start = self._ranks.head_ranges[0][0]
        total = max(s + n for s, n in self._ranks.head_ranges)
        # The model's whole layout (all KV heads): what tickets carry and peers compare.
        self._layout = dataclasses.replace(local, num_kv_heads=total)
        # Per peer: the channel's pairs, and this rank's ends of them; the handshake
        # (tickets, first tokens) rides on pair (0, 0), kept in _senders/_receivers.
        self._plans: dict[str, list[KVPair]] = {}
        self._pair_senders: dict[str, list[tuple[KVPair, KVSender]]] = {}
        self._pair_receivers: dict[str, list[tuple[KVPair, KVReceiver]]] = {}
        self._senders: dict[str, KVSender] = {}
        self._receivers: dict[str, KVReceiver] = {}
        # peer id -> the producer generation its channel is for: consumer side the
        # peer's (open_channel), producer side this engine's own (connect).
        self._peer_generations: dict[str, int] = {}
        self._own_generations: dict[str, int] = {}
        # Producer state of the current step: this rank's sends, and (request id,
        # whole ticket) of each save started.
        self._step = StepSends(kv_cache, self._head_start)
        self._saving: list[tuple[str, KVTransferTicket]] = []
        self.step_saves: list[tuple[str, str, dict, list[int]]] = []
        """The current step's saves as ranks 1.. need them: ``(request id, peer id,
        ticket, source block ids)`` (a tensor-parallel runner sends them with the
        forward pass's input)."""
        self.kv_transfer_bytes = 0            # bytes of completed sends, all time
        # Consumer state: request id -> (receive future, handshake receiver, ticket).
        self._loads: dict[str, tuple[Future, KVReceiver | None, KVTransferTicket | None]] = {}
        # Loads with parts on ranks 1..: (peer, transfer id) -> [ranks still
        # receiving, first error]; request id -> its load's peer.
        self._rank_loads: dict[tuple[str, int], list] = {}
        self._load_peers: dict[str, str] = {}
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
        if self._control is not None:
            self._control.watch("load", self._on_rank_load)

    # -- channels --------------------------------------------------------------------------
    def layout(self) -> dict:
        return worker_layout(self._layout, self._ranks.head_ranges)

    def _view(self, pair: KVPair) -> Any:
        return heads_view(self.kv_cache, self._head_start, pair)

    def _rank_pairs(self, plan: list[KVPair], side: str) -> dict[int, list[KVPair]]:
        """``plan``'s pairs whose ``side`` ("prefill_rank" / "decode_rank") end is on
        a rank 1.., by rank."""
        by_rank: dict[int, list[KVPair]] = {}
        for pair in plan:
            rank = getattr(pair, side)
            if rank > 0:
                by_rank.setdefault(rank, []).append(pair)
        return by_rank

    def open_channel(self, peer_id: str, host: str, peer_generation: int = 0,
                     peer_layout: dict | None = None) -> dict:
        peer_ranges = (parse_worker_layout(peer_layout)[1] if peer_layout is not None
                       else [(0, self._layout.num_kv_heads)])
        plan = pair_plan(peer_ranges, self._ranks.head_ranges)
        self.close_channel(peer_id)
        local = [(pair, self.transport.receiver.listen(host))
                 for pair in plan if pair.decode_rank == 0]
        rendezvous = {pair: r.rendezvous for pair, r in local}
        for rank, pairs in self._rank_pairs(plan, "decode_rank").items():
            rdvs = self._control.call(rank, "open", peer_id, self.transport_name, host,
                                            [p.to_list() for p in pairs],
                                            os.environ.get(CLUSTER_SECRET_ENV))
            rendezvous.update(zip(pairs, rdvs))
        self._plans[peer_id] = plan
        self._pair_receivers[peer_id] = local
        self._receivers[peer_id] = receiver = next(r for p, r in local if p.prefill_rank == 0)
        self._peer_generations[peer_id] = peer_generation
        receiver.on_handoff = functools.partial(self._on_handoff, peer_id)
        return {"pairs": [[*pair.to_list(), rendezvous[pair]] for pair in plan]}

    def connect(self, peer_id: str, rendezvous: dict, peer_layout: dict,
                local_host: str | None = None, generation: int = 0) -> None:
        peer, peer_ranges = parse_worker_layout(peer_layout)
        check_compatible(self._layout, peer)
        plan = pair_plan(self._ranks.head_ranges, peer_ranges)
        offered = {KVPair.from_list(entry[:4]): entry[4] for entry in rendezvous["pairs"]}
        if list(offered) != plan:
            raise KVLayoutMismatchError(
                f"KV head split mismatch: this worker's ranks hold KV heads "
                f"{list(self._ranks.head_ranges)}, {peer_id}'s {peer_ranges}; its channel offers "
                f"pairs {[p.to_list() for p in offered]}, expected {[p.to_list() for p in plan]}")
        self.close_channel(peer_id)
        local = [(pair, self.transport.sender.connect(offered[pair], local_host=local_host))
                 for pair in plan if pair.prefill_rank == 0]
        for rank, pairs in self._rank_pairs(plan, "prefill_rank").items():
            self._control.call(rank, "connect", peer_id, self.transport_name,
                                     [(p.to_list(), offered[p]) for p in pairs], local_host,
                                     self.transfer_timeout_s, os.environ.get(CLUSTER_SECRET_ENV))
        self._plans[peer_id] = plan
        self._pair_senders[peer_id] = local
        self._senders[peer_id] = sender = next(s for p, s in local if p.decode_rank == 0)
        self._own_generations[peer_id] = generation
        sender.set_ticket_handler(functools.partial(self._on_ticket, peer_id))

    def close_channel(self, peer_id: str, *, ranks: bool = True) -> bool:
        """See :meth:`KVConnector.close_channel`; ``ranks=False`` leaves ranks 1..'s
        ends alone (the group is ending)."""
        self._peer_generations.pop(peer_id, None)
        self._own_generations.pop(peer_id, None)
        self._senders.pop(peer_id, None)
        self._receivers.pop(peer_id, None)
        plan = self._plans.pop(peer_id, [])
        ends = self._pair_senders.pop(peer_id, []) + self._pair_receivers.pop(peer_id, [])
        for _, end in ends:
            end.close()
        for side in ("prefill_rank", "decode_rank") if ranks else ():
            for rank in self._rank_pairs(plan, side):
                try:
                    self._control.call(rank, "close", peer_id)
                except KVTransferError as e:
                    logger.warning("closing the KV channel to %s on rank %d: %s", peer_id, rank, e)
        return bool(ends)

    # -- producer --------------------------------------------------------------------------
    def start_save(self, saves: Sequence[KVSave]) -> None:
        self._step, self._saving, self.step_saves = StepSends(self.kv_cache, self._head_start), [], []
        failed = self._step.failed
        for s in saves:
            try:
                ticket = KVTransferTicket.from_dict(s.params.ticket)
                check_compatible(self._layout, ticket.layout)
            except ValueError as exc:        # KVLayoutMismatchError included
                failed[s.request_id] = str(exc)
                continue
            peer_id = s.params.peer_id
            if peer_id not in self._senders:
                failed[s.request_id] = f"no KV channel to {peer_id}"
                continue
            own = self._own_generations[peer_id]
            if ticket.producer_generation != own:
                # A zombie: the blocks behind this ticket were reserved for another
                # incarnation of this worker, and may belong to another request now.
                failed[s.request_id] = (
                    f"ticket for producer generation {ticket.producer_generation}, this "
                    f"producer is generation {own}: refused")
                continue
            src = [s.block_ids[i] for i in ticket.sent_block_indices()]
            self._step.add(s.request_id, ticket, self._pair_senders[peer_id], src)
            self._saving.append((s.request_id, ticket))
            if self._ranks.world_size > 1:
                self.step_saves.append((s.request_id, peer_id, s.params.ticket, src))
            with self._handshake_lock:      # the caller brought the ticket: the pair's copy is moot
                self._early_tickets.pop((peer_id, s.request_id, ticket.attempt), None)

    def save_kv_layer(self, layer: int) -> None:
        self._step.send_layer(layer)

    def wait_for_save(self) -> dict[str, str]:
        failed = self._step.finish(self.transfer_timeout_s)
        if self.step_saves:                 # ranks 1.. sent their heads in the same step
            for rid, message in wait_for_saved(self._control, self._ranks.world_size - 1,
                                               self.transfer_timeout_s + 30.0,
                                               self._ranks.check_ranks).items():
                failed.setdefault(rid, message)
        for rid, ticket in self._saving:
            if rid not in failed:
                self.kv_transfer_bytes += ticket.bytes_per_layer * ticket.layout.num_layers
        self._step, self._saving, self.step_saves = StepSends(self.kv_cache, self._head_start), [], []
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
        peer_id = params.peer_id
        receiver = self._receivers.get(peer_id)
        generation = self._peer_generations.get(peer_id, params.peer_generation)
        ticket = KVTransferTicket(request_id, next(self._transfer_ids), tuple(block_ids),
                                  num_cached_tokens, num_tokens, self._layout,
                                  params.attempt, generation)
        fut: Future = Future()
        if receiver is None:
            fut.set_exception(KVTransferError(f"no KV channel to {peer_id}"))
        elif params.peer_generation != generation:
            # The router chose an incarnation of the producer this channel is not for.
            self._discard_local(peer_id, ticket.transfer_id)   # whatever arrives is dropped
            fut.set_exception(KVTransferError(
                f"request {request_id!r} expects producer {peer_id} generation "
                f"{params.peer_generation}, the KV channel is for generation {generation}"))
        else:
            try:
                receiver.post_ticket(ticket.to_dict())
            except KVTransferError as exc:
                self._discard_local(peer_id, ticket.transfer_id)
                fut.set_exception(exc)
            else:
                with self._handshake_lock:
                    self._load_ids[(peer_id, ticket.transfer_id)] = request_id
                    _trim(self._load_ids, _MAX_LOAD_IDS)
                ranks = list(self._rank_pairs(self._plans[peer_id], "decode_rank"))
                if ranks:
                    key = (peer_id, ticket.transfer_id)
                    with self._handshake_lock:
                        self._rank_loads[key] = [set(ranks), None]
                    for rank in ranks:
                        self._control.post(rank, "load", peer_id, ticket.to_dict(),
                                                 self.transfer_timeout_s)
                parts = [(pair_ticket(ticket, pair), r, self._view(pair))
                         for pair, r in self._pair_receivers[peer_id]]
                fut = self._pool.submit(self._receive, peer_id, parts)
        self._loads[request_id] = (fut, receiver, ticket)
        self._load_peers[request_id] = peer_id
        fut.add_done_callback(lambda _: self.notify())
        return ticket.to_dict()

    def _receive(self, peer_id: str, parts: list[tuple[KVTransferTicket, KVReceiver, Any]]) -> None:
        """This rank's receives of one load, one pair after the other (each pair's
        layers are staged as they arrive meanwhile)."""
        try:
            for ticket, receiver, view in parts:
                receiver.receive(ticket, view, self.transfer_timeout_s)
        except BaseException:
            # The other pairs' parts are over too; ranks 1..'s end with a discard.
            transfer_id = parts[0][0].transfer_id
            self._discard_local(peer_id, transfer_id)
            self._discard_ranks(peer_id, transfer_id)
            raise

    def _discard_local(self, peer_id: str, transfer_id: int) -> None:
        for _, receiver in self._pair_receivers.get(peer_id, []):
            receiver.discard(transfer_id)

    def _discard_ranks(self, peer_id: str, transfer_id: int) -> None:
        with self._handshake_lock:
            entry = self._rank_loads.get((peer_id, transfer_id))
            ranks = list(entry[0]) if entry is not None else []
        for rank in ranks:
            self._control.post(rank, "discard", peer_id, transfer_id)

    def _on_rank_load(self, report: tuple[str, int, int, str | None]) -> None:
        """Rank ``r`` (1..) ended its part of a load (on the reports thread)."""
        peer_id, transfer_id, rank, error = report
        key = (peer_id, transfer_id)
        with self._handshake_lock:
            entry = self._rank_loads.get(key)
            if entry is None:
                return
            entry[0].discard(rank)
            if error is not None and entry[1] is None:
                entry[1] = error
        if error is not None:               # rank 0's part and the other ranks' end at once
            self._discard_local(peer_id, transfer_id)
            self._discard_ranks(peer_id, transfer_id)
        self.notify()

    def cancel_load(self, request_id: str) -> None:
        entry = self._loads.get(request_id)
        peer_id = self._load_peers.get(request_id)
        if entry is not None and entry[1] is not None and peer_id is not None:
            self._discard_local(peer_id, entry[2].transfer_id)
            self._discard_ranks(peer_id, entry[2].transfer_id)

    def extend_load(self, request_id: str, timeout_s: float) -> bool:
        entry = self._loads.get(request_id)
        if entry is None or entry[1] is None or entry[0].done():
            return False
        peer_id, transfer_id = self._load_peers[request_id], entry[2].transfer_id
        for _, receiver in self._pair_receivers.get(peer_id, []):
            receiver.extend(transfer_id, timeout_s)
        with self._handshake_lock:
            entry = self._rank_loads.get((peer_id, transfer_id))
            ranks = list(entry[0]) if entry is not None else []
        for rank in ranks:
            self._control.post(rank, "extend", peer_id, transfer_id, timeout_s)
        return True

    def get_finished_loads(self) -> list[tuple[str, str | None]]:
        done = []
        for rid, (fut, _, ticket) in list(self._loads.items()):
            if not fut.done():
                continue
            error = None if fut.exception() is None else str(fut.exception())
            with self._handshake_lock:
                entry = self._rank_loads.get((self._load_peers[rid], ticket.transfer_id))
                if entry is not None:
                    if entry[0]:
                        continue            # ranks 1.. still landing their heads
                    del self._rank_loads[(self._load_peers[rid], ticket.transfer_id)]
                    error = error or entry[1]
            del self._loads[rid]
            self._load_peers.pop(rid, None)
            if error is not None:
                logger.warning("KV load of %s failed: %s", rid, error)
            done.append((rid, error))
        return done

    @property
    def num_dropped_layers(self) -> int:
        """Layers that reached this (consumer) engine's rank 0 for a transfer it had
        already received, cancelled or failed (a late or zombie producer's), dropped
        without touching the cache; summed over the current channels."""
        return sum(r.num_dropped_layers for ends in self._pair_receivers.values()
                   for _, r in ends)

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        for peer_id in list(self._plans):
            self.close_channel(peer_id, ranks=False)
        self._pool.shutdown(wait=False, cancel_futures=True)
