"""A worker's step outputs pushed to its router over TCP (engine/runtime/output_stream.py):
the real listener and the router's asyncio reader over loopback, fed by a real
:class:`~tandem.engine.runtime.subscribers.Subscribers` (the engine loop's outboxes)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from tandem.engine.runtime.output_stream import (HEARTBEAT_S, OutputStream, OutputStreamError,
                                                 OutputStreamServer)
from tandem.engine.runtime.outputs import RequestDelta, StepOutput
from tandem.engine.runtime.subscribers import Subscribers


def _step(i: int, request_id: str = "r0") -> StepOutput:
    return StepOutput((RequestDelta(request_id, (i,)),), None, step_time_s=0.01 * i)


@pytest.fixture
def subs():
    return Subscribers(timeout_s=1.5)


@pytest.fixture
def server(subs):
    srv = OutputStreamServer(lambda timeout_s, name: subs.poll(name, timeout_s), "127.0.0.1")
    yield srv
    srv.close()


async def _read_until(stream: OutputStream, n: int, timeout_s: float = 10.0) -> list[StepOutput]:
    got: list[StepOutput] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        frame = await stream.read(1.0)
        got += frame or []
    return got


def test_published_steps_arrive_in_order_and_only_the_subscribers_own(subs, server):
    async def run():
        a = await OutputStream.connect(server.open("router-a"))
        b = await OutputStream.connect(server.open("router-b"))
        subs.assign(["ra"], "router-a")
        subs.assign(["rb"], "router-b")
        for i in range(50):
            subs.publish(StepOutput((RequestDelta("ra", (i,)), RequestDelta("rb", (-i,))),
                                    None), ["ra", "rb"])
        got_a, got_b = await _read_until(a, 50), await _read_until(b, 50)
        assert server.num_streams == 2
        a.close(), b.close()
        return got_a, got_b

    got_a, got_b = asyncio.run(run())
    assert [d.new_token_ids for s in got_a for d in s.deltas] == [(i,) for i in range(50)]
    assert [d.request_id for s in got_a for d in s.deltas] == ["ra"] * 50
    assert [d.new_token_ids for s in got_b for d in s.deltas] == [(-i,) for i in range(50)]


def test_an_idle_worker_sends_heartbeats(subs, server):
    async def run():
        stream = await OutputStream.connect(server.open("router-a"))
        t0 = time.monotonic()
        frame = await stream.read(5 * HEARTBEAT_S)
        waited = time.monotonic() - t0
        stream.close()
        return frame, waited

    frame, waited = asyncio.run(run())
    assert frame == []                       # a heartbeat, not a timeout (None)
    assert waited < 5 * HEARTBEAT_S


def test_a_token_works_once_and_a_wrong_one_gets_nothing(server):
    rendezvous = server.open("router-a")

    async def run():
        first = await OutputStream.connect(rendezvous)
        with pytest.raises(OutputStreamError, match="handshake"):
            await OutputStream.connect(rendezvous)           # used already
        with pytest.raises(OutputStreamError, match="handshake"):
            await OutputStream.connect({**rendezvous, "token": "00" * 32})
        first.close()

    asyncio.run(run())
    # A raw connection with a wrong token reads nothing but the close.
    with socket.create_connection((rendezvous["host"], rendezvous["port"]), timeout=5) as s:
        s.sendall(b"\x01" * 32)
        assert s.recv(100) == b""


def test_a_failed_loop_ends_the_stream():
    fail = threading.Event()

    def poll(timeout_s, name):
        if fail.is_set():
            raise RuntimeError("decode-0 engine failed: boom")
        time.sleep(0.01)
        return [_step(1)]

    srv = OutputStreamServer(poll, "127.0.0.1")
    try:
        async def run():
            stream = await OutputStream.connect(srv.open("router-a"))
            assert (await stream.read(5.0))[0].deltas[0].new_token_ids == (1,)
            fail.set()
            with pytest.raises(OutputStreamError, match="closed"):
                for _ in range(1000):
                    await stream.read(5.0)
        asyncio.run(run())
    finally:
        srv.close()


def test_shutdown_ends_every_stream(subs, server):
    async def run():
        stream = await OutputStream.connect(server.open("router-a"))
        await stream.read(5.0)
        server.close()
        with pytest.raises(OutputStreamError):
            for _ in range(10):
                await stream.read(5.0)

    asyncio.run(run())


def test_a_router_that_closes_its_stream_stops_polling_and_goes_silent(subs, server):
    """The worker's thread polls only while the router reads: once the router's end is
    closed its subscriber falls silent, and the loop's silence rule (its requests
    aborted) applies as when a router stopped calling ``poll``."""
    async def run():
        stream = await OutputStream.connect(server.open("router-a"))
        subs.assign(["ra"], "router-a")
        await stream.read(5.0)
        stream.close()

    asyncio.run(run())
    deadline = time.monotonic() + 10
    dropped = {}
    while time.monotonic() < deadline and "router-a" not in dropped:
        subs.publish(_step(1, "ra"), ["ra"])    # the worker's sends now fail
        time.sleep(0.2)
        dropped.update(subs.drop_silent())
    assert dropped.get("router-a") == ["ra"]
    assert server.num_streams == 0
