"""The other worker in KV transfer tests: a real process driven over a pipe.

The pipe plays the control plane (it carries rendezvous dicts and tickets, never
KV); tickets the receiver posts on the pair are kept and read back with ``tickets``. Each command is a tuple ``(name, *args)``; the reply is ``("ok", value)`` or
``("error", "ExceptionType: message")``. ``connect`` takes an optional dict of
keyword arguments for the transport's ``connect`` (e.g. ``{"device": "cuda:1"}``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

import torch

from tandem.kvtransfer.base import get_transport
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket


def make_cache(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A deterministic ``[L, 2, num_blocks, block_size, heads, head_dim]`` cache, equal in every process."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.torch_dtype)


class Peer:
    """Handle on a peer process; every call waits for the peer's reply."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def call(self, *command: Any, timeout_s: float = 30.0) -> Any:
        """Run a command; returns its value, raises RuntimeError with the peer's error text."""
        self._conn.send(command)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {command[0]!r} within {timeout_s} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def die(self) -> None:
        """Make the peer exit at once, closing nothing (a crashed worker)."""
        self._conn.send(("die",))
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            self._conn.send(("exit",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def serve(conn) -> None:
    """Peer main loop: runs commands until ``exit``."""
    sender = receiver = None
    device = "cpu"  # where this peer's KV caches live
    tickets: list[dict] = []  # what the receiver posted on the pair, in order
    while True:
        name, *args = conn.recv()
        try:
            if name == "exit":
                for end in (sender, receiver):
                    if end is not None:
                        end.close()
                conn.send(("ok", None))
                return
            if name == "connect":
                transport, rendezvous, *options = args
                kwargs = options[0] if options else {}
                device = kwargs.get("device", "cpu")
                sender = get_transport(transport).sender.connect(rendezvous, timeout_s=20, **kwargs)
                sender.set_ticket_handler(tickets.append)
                value = None
            elif name == "tickets":
                value = list(tickets)
            elif name == "handoff":
                value = sender.post_handoff(*args)
            elif name == "listen":
                receiver = get_transport(args[0]).receiver.listen()
                value = receiver.rendezvous
            elif name == "send":
                value = _send(sender, device, *args)
            elif name == "receive":
                ticket_dict, num_blocks, timeout_s = args
                ticket = KVTransferTicket.from_dict(ticket_dict)
                kv_cache = torch.zeros((ticket.layout.num_layers, 2, num_blocks, ticket.layout.block_size,
                                        ticket.layout.num_kv_heads, ticket.layout.head_dim),
                                       dtype=ticket.layout.torch_dtype)
                receiver.receive(ticket, kv_cache, timeout_s)
                value = kv_cache
            elif name == "die":
                os._exit(3)
            else:
                raise ValueError(f"unknown command {name!r}")
        except Exception as e:  # noqa: BLE001 - the error travels back to the test as text
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        else:
            conn.send(("ok", value))


def _send(sender, device: str, jobs: list[tuple[dict, list[int]]], layout_dict: dict, num_blocks: int,
          seed: int, layers: list[int] | None = None, finish_timeout_s: float | None = 10.0) -> None:
    """Send ``layers`` (default: all) of each ``(ticket, src_block_ids)`` job from one cache.

    Layers are interleaved across jobs (job 0 layer 0, job 1 layer 0, job 0 layer 1, ...),
    as a prefill batch computing several requests layer by layer would send them.
    """
    layout = KVLayout.from_dict(layout_dict)
    kv_cache = make_cache(layout, num_blocks, seed).to(device)
    tickets = [(KVTransferTicket.from_dict(t), src) for t, src in jobs]
    for layer in (range(layout.num_layers) if layers is None else layers):
        for ticket, src in tickets:
            sender.send_layer(ticket, layer, src, kv_cache)
    if finish_timeout_s is not None:
        for ticket, _ in tickets:
            sender.finish(ticket, finish_timeout_s)
