"""Disaggregation inside the engine: the KV connector interface and its registry.

A KV connector moves a request's prompt KV between two engines (the shape of
vLLM's KV connector and SGLang's ``disaggregation/``). The engine drives it; the
transport behind it (Gloo, NCCL, ...) lives in :mod:`tandem.kvtransfer`, found
through a registry keyed by the transport config string, so the engine never
imports a transport.

Producer (prefill engine), inside the forward pass of the step that computes a
request's last prompt chunk::

    runner: connector.start_save(saves)          requests whose prompt completes now
            for each layer l: compute l; connector.save_kv_layer(l, kv_cache)
            failed = connector.wait_for_save()   request id -> error message

Consumer (decode engine): a request added with ``kv_transfer_params`` is a
remote-prefill request. The scheduler admits it in queue order and reserves
blocks for its whole prompt (prefix-cache hits reused); it then waits in state
``WAITING_FOR_REMOTE_KV``::

    engine: ticket = connector.start_load(request_id, block_ids, num_cached, num_tokens, peer)
            ... each step: connector.get_finished_loads() -> [(request id, error or None)]
                           connector.get_first_tokens() -> [(request id, token, logprobs)]
    scheduler: all layers landed and the first token known -> RUNNING

The handshake runs on the channel itself, so the router sends both engines their
request at once and only streams tokens (SGLang's bootstrap, Dynamo's shape):
``start_load`` also posts the ticket to the producer, whose engine waits for it
(:meth:`KVConnector.ticket_future`) when its request came without one; after the
prompt's last layer and its first token, the producer hands that token over
(:meth:`KVConnector.send_first_token`) and the consumer decodes on, with no call
from the router in between.

Fencing: every channel is for one incarnation of the producer (its cluster
registry generation, given to :meth:`KVConnector.open_channel` and
:meth:`KVConnector.connect`). A consumer fails a load at once when the router
chose another generation (``KVTransferParams.peer_generation``), and tickets
carry the channel's generation, which a producer of any other generation
refuses. Layers that arrive for a load the consumer ended (cancelled, failed)
are dropped on arrival, so a late producer never writes into blocks that were
freed and reserved for another request.

Everything that crosses between engines (tickets, rendezvous) is plain data
(dicts of str/int/bytes), so it may travel over Ray or gRPC.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class KVTransferParams:
    """Where a request's prompt KV comes from or goes to.

    Attributes:
        peer_id: the other engine's worker id (e.g. ``decode-0``).
        ticket: producer side: the consumer's reservation (``KVTransferTicket.to_dict()``,
            destination blocks and cached prefix); None on the consumer side, where
            the connector makes the ticket once blocks are reserved.
        attempt: the router's attempt number for the request (0 first); the
            consumer copies it into the ticket.
        peer_generation: consumer side: the incarnation (cluster registry
            generation) of the producer the router chose; a load fails at once if
            the channel to ``peer_id`` was opened for another one.
    """

    peer_id: str
    ticket: dict | None = None
    attempt: int = 0
    peer_generation: int = 0


@dataclass(frozen=True)
class KVRankGroup:
    """A tensor-parallel engine's ranks, as its KV connector (on rank 0) needs them.

    Attributes:
        head_ranges: ``(first KV head, heads)`` each rank holds, rank 0 first.
        store_host, store_port: the group's ``TCPStore``, through which the connector
            drives ranks 1..'s ends of its channels (:func:`get_rank_kv_agent`).
        check_ranks: raises if a rank 1.. died or hangs
            (:class:`~tandem.engine.parallel.communicator.RankDiedError`).
    """

    head_ranges: tuple[tuple[int, int], ...]
    store_host: str = ""
    store_port: int = 0
    check_ranks: Callable[[], None] = lambda: None

    @property
    def world_size(self) -> int:
        return len(self.head_ranges)


@dataclass(frozen=True)
class KVSave:
    """One request whose prompt KV the producer sends in this step.

    Attributes:
        request_id: the request.
        params: its :class:`KVTransferParams` (with the consumer's ticket).
        block_ids: this engine's blocks of the request, in sequence order.
    """

    request_id: str
    params: KVTransferParams
    block_ids: tuple[int, ...]


class KVConnector(ABC):
    """Moves prompt KV between a producer (prefill) and a consumer (decode) engine.

    One connector per engine, with channels to any number of peers. The engine
    calls every method on its own (loop) thread; an implementation may use
    threads of its own for the wire, but reports results only through
    :meth:`wait_for_save` and :meth:`get_finished_loads`.

    Args:
        kv_cache: the engine's ``[L, 2, NB, BS, Hkv, D]`` cache tensor.
        notify: called (from any thread) when a load finishes, so an idle engine
            loop wakes up to collect it.
    """

    def __init__(self, kv_cache: Any, notify: Callable[[], None] | None = None):
        self.kv_cache = kv_cache
        self.notify = notify or (lambda: None)

    # -- channels (control plane) ----------------------------------------------------------
    @abstractmethod
    def open_channel(self, peer_id: str, host: str, peer_generation: int = 0,
                     peer_layout: dict | None = None) -> dict:
        """Consumer: listen on ``host`` for producer ``peer_id``, incarnation
        ``peer_generation``, whose :meth:`layout` is ``peer_layout`` (None: a one-rank
        worker's; a tensor-parallel producer's says which rank holds which KV heads);
        returns the rendezvous (plain values) to hand to that producer's
        :meth:`connect`. A load whose ``KVTransferParams.peer_generation`` differs
        fails at once; tickets carry the channel's generation.

        Raises:
            KVLayoutMismatchError: a KV head this worker holds is on no rank of the peer.
        """

    @abstractmethod
    def connect(self, peer_id: str, rendezvous: dict, peer_layout: dict,
                local_host: str | None = None, generation: int = 0) -> None:
        """Producer: join consumer ``peer_id``'s channel, from this node's address
        ``local_host`` (None: the address on the route to the peer). ``generation``
        is this producer's own incarnation: a ticket for another one is refused.

        Raises:
            KVLayoutMismatchError: the two caches disagree (the message names each
                differing field with both values), or the two workers' KV head
                splits do not match the pairs the consumer opened.
        """

    @abstractmethod
    def close_channel(self, peer_id: str) -> bool:
        """Close the channel to ``peer_id``; returns whether there was one. Requests
        for that peer then fail until a channel is opened again."""

    @abstractmethod
    def layout(self) -> dict:
        """This engine's KV layout as plain values (compared across a channel)."""

    # -- producer --------------------------------------------------------------------------
    @abstractmethod
    def start_save(self, saves: Sequence[KVSave]) -> None:
        """Before the forward pass: these requests' prompts complete in this step.

        A save whose ticket does not fit (layout, no channel, a
        ``producer_generation`` other than this producer's) sends nothing and is
        reported failed by :meth:`wait_for_save`."""

    @abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """Right after ``layer``'s K/V of this step are in the cache: send that layer
        of every request given to :meth:`start_save` (without waiting for the wire)."""

    @abstractmethod
    def wait_for_save(self) -> dict[str, str]:
        """After the forward pass: wait until this step's sends have left.

        Returns:
            request id -> error message, for each save that failed (the others
            reached the wire completely).
        """

    @abstractmethod
    def ticket_future(self, peer_id: str, request_id: str, attempt: int) -> Future:
        """The ticket consumer ``peer_id`` posts for ``request_id``'s attempt
        ``attempt`` (a ``KVTransferTicket.to_dict()``), as a future that completes
        when it arrives (at once if it did already); :meth:`forget_ticket` cancels it.
        Thread-safe."""

    @abstractmethod
    def forget_ticket(self, peer_id: str, request_id: str) -> None:
        """Stop waiting for ``request_id``'s tickets from ``peer_id`` (cancel the
        futures, drop those that arrived or will). Thread-safe."""

    @abstractmethod
    def send_first_token(self, params: KVTransferParams, token_id: int,
                         logprobs: Any = None) -> str | None:
        """After a successful save: hand the consumer the first token sampled for the
        request of ``params.ticket`` (``logprobs``: its ``TokenLogprobs`` or None).

        Returns:
            None once handed over; an error message if the channel is broken or
            gone (the consumer never gets the token).
        """

    # -- consumer --------------------------------------------------------------------------
    @abstractmethod
    def start_load(self, request_id: str, block_ids: Sequence[int], num_cached_tokens: int,
                   num_tokens: int, params: KVTransferParams) -> dict:
        """Blocks were reserved for a remote-prefill request: start receiving its layers.

        Args:
            block_ids: the request's blocks covering ``num_tokens`` prompt tokens.
            num_cached_tokens: leading tokens already in this cache, or outside
                the sliding window of every layer for the first decode (not sent;
                their ``block_ids`` may repeat the null block).
            params: the producer, the router's attempt and the producer generation
                it expects; a generation other than the channel's fails the load
                at once (reported by :meth:`get_finished_loads`).

        Returns:
            The ticket (plain dict) the producer needs, with ``params.attempt`` and
            the channel's producer generation.
        """

    @abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """Stop waiting for ``request_id``'s layers; its load still finishes (with an
        error) through :meth:`get_finished_loads`, after which its blocks may be freed."""

    @abstractmethod
    def extend_load(self, request_id: str, timeout_s: float) -> bool:
        """Give ``request_id``'s load at least ``timeout_s`` more seconds from now
        before it times out: its producer is making progress, and the prompt is
        queued there, not stalled. Returns whether a load was in flight."""

    @abstractmethod
    def get_first_tokens(self) -> list[tuple[str, int, Any]]:
        """First tokens the producers handed over since the last call, for loads this
        connector started: ``(request id, token id, TokenLogprobs or None)``. Never blocks."""

    @abstractmethod
    def get_finished_loads(self) -> list[tuple[str, str | None]]:
        """Loads that ended since the last call: ``(request id, None)`` once every layer
        landed, ``(request id, error message)`` when the load failed or was cancelled.
        Never blocks."""

    @property
    @abstractmethod
    def num_loads_in_flight(self) -> int:
        """Loads started and not yet reported by :meth:`get_finished_loads`."""

    def close(self) -> None:
        """Release every channel. Idempotent."""


# Transport config string -> "module:Class" implementing KVConnector. Imported on
# first use, so that the engine never imports a transport it does not use.
_CONNECTORS: dict[str, str] = {
    "gloo": "tandem.kvtransfer.connector:TransportKVConnector",
    "nccl": "tandem.kvtransfer.connector:TransportKVConnector",
}


# A tensor-parallel rank's ends of its worker's KV channels (transport-independent:
# rank 0's connector names the transport with each channel).
_RANK_KV_AGENT = "tandem.kvtransfer.sharded:RankKVAgent"


def get_rank_kv_agent(rank: int, store_host: str, store_port: int, kv_cache: Any,
                      head_start: int) -> Any:
    """Rank ``rank`` (1..)'s agent for its worker's KV channels: it serves the commands
    rank 0's connector sends through the group's ``TCPStore`` at ``store_host:store_port``
    and sends a producer step's KV heads (``start_save``, ``save_kv_layer``,
    ``wait_for_save``) from ``kv_cache`` (this rank's ``[L, 2, NB, BS, Hkv_rank, D]``,
    holding the model's KV heads from ``head_start``)."""
    module, cls = _RANK_KV_AGENT.split(":")
    return getattr(importlib.import_module(module), cls)(rank, store_host, store_port,
                                                         kv_cache, head_start)


def kv_connector_names() -> list[str]:
    """Config strings accepted by :func:`get_kv_connector`."""
    return sorted(_CONNECTORS)


def get_kv_connector(name: str, kv_cache: Any, notify: Callable[[], None] | None = None,
                     **kwargs: Any) -> KVConnector:
    """Build the connector for transport ``name`` over ``kv_cache``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in _CONNECTORS:
        raise ValueError(f"kv_transport: unknown KV transport {name!r}; "
                         f"known: {kv_connector_names()}")
    module, cls = _CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)(name, kv_cache, notify, **kwargs)
