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
    srv = OutputStreamServer(lambda timeout_s, name: subs.poll(name, timeout_s), "127.0.0.1",
                             unread=subs.unread)
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

    srv = OutputStreamServer(poll, "127.0.0.1", unread=lambda name, steps: None)
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


class _Worker:
    """An in-process worker's output side for the router's pump: the real
    :class:`Subscribers` and :class:`OutputStreamServer` of a worker, and its ``poll``
    (``poll_paused``: returns nothing, touching no outbox; ``poll_error``: raises, as
    for a worker that died)."""

    def __init__(self, subs: Subscribers):
        self.subs = subs
        self.server = OutputStreamServer(lambda t, name: subs.poll(name, t), "127.0.0.1",
                                         unread=subs.unread)
        self.polls = 0
        self.poll_paused = False
        self.poll_error: BaseException | None = None

    async def open_output_stream(self, subscriber):
        if self.poll_error is not None:
            raise self.poll_error
        return self.server.open(subscriber)

    async def poll(self, timeout_s, subscriber):
        self.polls += 1
        if self.poll_error is not None:
            raise self.poll_error
        if self.poll_paused:
            return []
        return await asyncio.to_thread(self.subs.poll, subscriber, timeout_s)

    async def info(self):
        return {}

    def break_connection(self, subscriber: str) -> None:
        """The stream's connection breaks on the worker's side (a reset)."""
        conn, _ = self.server._active[subscriber]
        conn.shutdown(socket.SHUT_RDWR)


def _pump_scenario(subs, scenario):
    """Run ``scenario(worker, cluster, queue, publish, next_tokens)`` against a real
    :class:`~tandem.router.cluster.Cluster` whose one decode worker is :class:`_Worker`."""
    from tandem.router.cluster import Cluster
    from tandem.router.registry import InProcessRegistry, WorkerHandle
    from tandem.router.routing import LeastLoadedPolicy

    worker = _Worker(subs)
    sent = [0]

    def publish(n):
        for _ in range(n):
            subs.publish(StepOutput((RequestDelta("ra", (sent[0],)),), None), ["ra"])
            sent[0] += 1

    async def next_tokens(q, n):
        got = []
        while len(got) < n:
            got += list((await asyncio.wait_for(q.get(), 10)).new_token_ids)
        return got

    async def run():
        registry = InProcessRegistry()
        cluster = Cluster(registry, LeastLoadedPolicy(), router_id="router-a")
        handle = WorkerHandle("decode-0", "decode", worker)
        registry.add(handle)
        cluster.start()
        q = cluster.register("ra", handle)
        subs.assign(["ra"], "router-a")
        try:
            return await scenario(worker, handle, q, publish, next_tokens)
        finally:
            await cluster.stop()

    try:
        return asyncio.run(run())
    finally:
        worker.server.close()


async def _wait(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def test_the_routers_pump_reads_the_stream_and_reconnects_without_a_gap(subs):
    """Cluster._pump: deltas come on the stream, never by poll; when the connection
    breaks (here with steps published right after, which the old stream's thread
    takes and fails to send: they go back to the outbox) the router opens a new
    stream, and every delta arrives once, in order, the worker still in service."""
    async def scenario(worker, handle, q, publish, next_tokens):
        publish(20)
        first = await next_tokens(q, 20)
        worker.break_connection("router-a")
        publish(20)
        second = await next_tokens(q, 20)
        assert await _wait(lambda: worker.server.num_streams == 1)
        publish(5)
        return first, second, await next_tokens(q, 5), worker.polls, handle.alive

    first, second, third, polls, alive = _pump_scenario(subs, scenario)
    assert first == list(range(20))
    assert second == list(range(20, 40)) and third == list(range(40, 45))
    assert polls == 0 and alive


def test_outputs_lost_with_a_broken_stream_make_the_worker_lost(subs):
    """A batch handed to the kernel that the router never read (simulated: the
    worker's count of sent frames one ahead when the connection breaks): the
    reconnecting router sees it and treats the worker as lost (WorkerLost: the
    request resumes elsewhere from its journaled tokens), never streaming on with
    a gap."""
    from tandem.router.cluster import WorkerLost

    async def scenario(worker, handle, q, publish, next_tokens):
        publish(5)
        await next_tokens(q, 5)
        with worker.server._lock:
            worker.server._frames["router-a"] = worker.server._frames.get("router-a", 0) + 1
        worker.break_connection("router-a")
        return await asyncio.wait_for(q.get(), 10), handle.alive

    lost, alive = _pump_scenario(subs, scenario)
    assert isinstance(lost, WorkerLost) and lost.worker_id == "decode-0" and not alive


def test_a_worker_whose_engine_failed_is_lost_when_its_stream_ends(subs):
    from tandem.router.cluster import WorkerLost

    async def scenario(worker, handle, q, publish, next_tokens):
        publish(3)
        await next_tokens(q, 3)
        worker.poll_error = RuntimeError("decode-0 engine failed")
        worker.server.close()                # the loop failed: the stream ends
        return await asyncio.wait_for(q.get(), 10), handle.alive

    lost, alive = _pump_scenario(subs, scenario)
    assert isinstance(lost, WorkerLost) and not alive


def test_a_worker_without_a_reachable_stream_is_polled(subs):
    """The first stream cannot be reached (nothing listens at its address): the router
    polls instead, and nothing is lost."""
    async def scenario(worker, handle, q, publish, next_tokens):
        worker.server.close()               # its listener is gone before the router came
        publish(10)
        return await next_tokens(q, 10), worker.polls, handle.alive

    got, polls, alive = _pump_scenario(subs, scenario)
    assert got == list(range(10)) and polls >= 1 and alive


def test_a_failed_send_gives_its_steps_back(subs):
    """The worker's side alone: a batch whose send fails is read first by the next
    stream of the same subscriber, and its frame count does not move."""
    srv = OutputStreamServer(lambda t, name: subs.poll(name, t), "127.0.0.1",
                             unread=subs.unread)
    try:
        async def run():
            a = await OutputStream.connect(srv.open("router-a"))
            subs.assign(["ra"], "router-a")
            subs.publish(_step(1, "ra"), ["ra"])
            await _read_until(a, 1)
            conn, _ = srv._active["router-a"]
            conn.shutdown(socket.SHUT_RDWR)       # the thread's next send fails
            for i in (2, 3):
                subs.publish(_step(i, "ra"), ["ra"])
            b = await OutputStream.connect(srv.open("router-a"))
            got = await _read_until(b, 2)
            a.close(), b.close()
            return b.frames_before, got

        frames_before, got = asyncio.run(run())
    finally:
        srv.close()
    assert frames_before == 1
    assert [d.new_token_ids for s in got for d in s.deltas] == [(2,), (3,)]
