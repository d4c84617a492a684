"""Requests sent to a decode or prefill worker on its output stream instead of by Ray
call (engine/runtime/output_stream.py, :class:`~tandem.engine.runtime.early_adds.EarlyAdds`,
``Orchestrator._on_stream``): the real listener and asyncio reader over loopback,
real in-process :class:`DecodeWorker` and :class:`PrefillWorker` on the default
model, the router's real :class:`Cluster` and :class:`Orchestrator`. What must
hold: each request runs once and is answered (added, prefilled, or the error the
call would raise), a stream that breaks before the answer falls back to the call
without running it twice, and the tokens are those of the call path. A prefill
that succeeds on the stream, through a real KV channel, is served in
tests/serving/test_serving_e2e.py::test_prefill_kv_really_moved."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket
import threading
import time

import pytest

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.runtime.output_stream import OutputStream, OutputStreamError, OutputStreamServer
from tandem.engine.runtime.outputs import AddResult, WorkerRequest
from tandem.engine.runtime.subscribers import Subscribers
from tandem.engine.runtime.worker_common import WorkerFencedError
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _request(rid: str, router_id: str = "router-a", prompt=(1, 2, 3, 4, 5)) -> WorkerRequest:
    return WorkerRequest(rid, tuple(prompt), GREEDY, router_id=router_id)


# -- the stream ------------------------------------------------------------------------------


def _listener(on_request=None):
    subs = Subscribers(timeout_s=5.0)
    return OutputStreamServer(lambda t, name: subs.poll(name, t), "127.0.0.1",
                              unread=subs.unread, on_request=on_request)


def test_requests_reach_the_worker_in_order_each_as_its_routers():
    got: list[tuple[str, str]] = []
    arrived = threading.Event()

    def on_request(subscriber, request):
        got.append((subscriber, request.request_id))
        if len(got) == 6:
            arrived.set()

    server, silent = _listener(on_request), _listener()

    async def run():
        a = await OutputStream.connect(server.open("router-a"))
        b = await OutputStream.connect(server.open("router-b"))
        quiet = await OutputStream.connect(silent.open("router-a"))
        assert a.takes_requests and b.takes_requests and not quiet.takes_requests
        for i in range(3):
            assert a.send(_request(f"a{i}", "router-a"))
            assert b.send(_request(f"b{i}", "router-b"))
        assert await asyncio.to_thread(arrived.wait, 10)
        a.close()
        assert not a.send(_request("late"))          # closing: nothing is written
        b.close(), quiet.close()

    try:
        asyncio.run(run())
    finally:
        server.close(), silent.close()
    assert [r for s, r in got if s == "router-a"] == ["a0", "a1", "a2"]
    assert [r for s, r in got if s == "router-b"] == ["b0", "b1", "b2"]


@pytest.mark.parametrize("frame", ["not a request", "oversized"])
def test_a_frame_that_is_not_a_request_ends_the_connection(frame):
    got = []
    server = _listener(lambda s, r: got.append(r))

    async def run():
        stream = await OutputStream.connect(server.open("router-a"))
        if frame == "oversized":
            stream._writer.write((1 << 40).to_bytes(8, "little"))
        else:
            payload = pickle.dumps({"request_id": "x"})
            stream._writer.write(len(payload).to_bytes(8, "little") + payload)
        with pytest.raises(OutputStreamError):
            for _ in range(20):                     # heartbeats until the worker closes it
                await stream.read(5.0)
        stream.close()

    try:
        asyncio.run(run())
    finally:
        server.close()
    assert got == []


# -- matching a frame with its call ---------------------------------------------------------


def test_whichever_of_frame_and_call_comes_first_adds_the_request_once():
    from concurrent.futures import Future

    from tandem.engine.runtime.early_adds import EarlyAdds

    early = EarlyAdds(ttl_s=0.2)
    starts: list[str] = []

    def start(rid):
        def go():
            starts.append(rid)
            fut = Future()
            fut.set_result(None)
            return fut
        return go

    # The frame first: its add runs; the call gets that add's future.
    first = _request("r1")
    assert early.from_stream(first, start("r1"))
    assert not early.from_stream(first, start("r1"))        # a duplicate frame: dropped
    fut = early.claim(first)
    assert fut is not None and fut.result() is None
    # The call first: it adds the request itself; the frame that follows is dropped.
    second = _request("r2")
    assert early.claim(second) is None
    assert not early.from_stream(second, start("r2"))
    # Another attempt or sample of the same request is another request.
    assert early.from_stream(dataclasses.replace(first, attempt=1), start("r1/1"))
    assert early.from_stream(dataclasses.replace(first, sample_index=2), start("r1#2"))
    assert starts == ["r1", "r1/1", "r1#2"]
    # Unmatched marks and adds are forgotten after the TTL.
    assert early.claim(_request("r3")) is None
    assert len(early) == 3
    time.sleep(0.3)
    early.claim(_request("r4"))
    assert len(early) == 1


# -- a real decode worker ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    from tandem.engine.config import CacheConfig, EngineConfig

    return EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64))


class _Outbox:
    """What a router subscribed as ``subscriber`` reads from the worker's polls:
    the answers, and each request's tokens and whether it finished."""

    def __init__(self, worker, subscriber: str):
        self.worker, self.subscriber = worker, subscriber
        self.answers: list[AddResult] = []
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    async def read(self, until, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            for item in await self.worker.poll(0.2, self.subscriber):
                if isinstance(item, AddResult):
                    self.answers.append(item)
                    continue
                for d in item.deltas:
                    self.tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
                    if d.finish_reason is not None:
                        self.finished.add(d.request_id)


@pytest.mark.slow
def test_a_decode_worker_answers_each_request_from_the_stream(config, f32_weights):
    """Frames handed to the worker as its stream's reader thread does: added and
    answered; refused ones answered with the error its call raises (the field
    named), a fenced worker's with WorkerFencedError; a call marked
    ``sent_on_stream`` returns the frame's add, or adds what no frame brought."""
    from tandem.decode_worker.worker import DecodeWorker

    async def scenario():
        worker = DecodeWorker("colocated-0", config, role="colocated", kv_transport=None,
                              weights_from=f32_weights.engine)
        add = worker._request_from_stream()
        try:
            outbox = _Outbox(worker, "router-a")
            await worker.poll(0.01, "router-a")                 # the router subscribes
            add("router-a", _request("r1"))
            add("router-a", _request("bad", prompt=()))
            add("router-b", _request("foreign"))               # not its router's: ignored
            await outbox.read(lambda: len(outbox.answers) >= 2)
            answers = outbox.answers
            assert [(a.request_id, type(a.error)) for a in answers] == \
                [("r1", type(None)), ("bad", InvalidParameterError)]
            assert answers[1].error.field == "prompt_token_ids"
            # The stream broke before the answer: the call returns the frame's add.
            await worker.add_request(dataclasses.replace(_request("r1"), sent_on_stream=True))
            # A call whose frame never came adds it; a late frame is then dropped.
            await worker.add_request(dataclasses.replace(_request("r2"), sent_on_stream=True))
            add("router-a", _request("r2"))
            await worker.fence("lease lost")
            add("router-a", _request("r3"))
            await outbox.read(lambda: len(outbox.answers) >= 3)
            assert [(a.request_id, type(a.error)) for a in outbox.answers[2:]] == \
                [("r3", WorkerFencedError)]
            await worker.unfence()
            await outbox.read(lambda: outbox.finished == {"r1", "r2"})
            counts = await worker.check_invariants()
            return outbox.tokens, counts
        finally:
            await worker.shutdown()

    tokens, counts = asyncio.run(scenario())
    ref = f32_weights.generate([[1, 2, 3, 4, 5]], GREEDY)[0].outputs[0].token_ids
    assert tokens == {"r1": list(ref), "r2": list(ref)}     # each added once, greedy = offline
    assert counts["adds_from_stream"] == 3                   # r1, bad, r3
    assert counts["num_free_blocks"] == counts["num_blocks"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["stream", "stream broken before the answer"])
def test_the_router_adds_on_the_stream_and_falls_back_to_the_call(config, f32_weights,
                                                                   tokenizer, path):
    """Through the real Cluster (its pump opens the worker's output stream) and
    Orchestrator: the request goes on the stream and no ``add_request`` call is made;
    when the connection breaks after the worker read the frame but before its
    answer, the router makes the call, which returns the frame's add (the request
    is added once) and the tokens are the same."""
    from tandem.decode_worker.worker import DecodeWorker
    from tandem.router.cluster import Cluster
    from tandem.router.orchestrator import Orchestrator
    from tandem.router.registry import InProcessRegistry, WorkerHandle
    from tandem.router.routing import LeastLoadedPolicy
    from tandem.router.validation import ValidatedRequest

    prompt = tokenizer.encode("The capital of France is")

    async def scenario():
        worker = DecodeWorker("colocated-0", config, role="colocated", kv_transport=None,
                              weights_from=f32_weights.engine)
        calls: list[bool] = []
        call = worker.add_request

        async def add_request(request):
            calls.append(request.sent_on_stream)
            return await call(request)
        worker.add_request = add_request
        if path != "stream":
            read = worker._request_from_stream()

            def read_then_break(subscriber, request):
                answer = worker.loop.subscribers.answer
                worker.loop.subscribers.answer = lambda name, result: None   # lost with it
                try:
                    read(subscriber, request)
                    worker.loop.call(lambda: None).result(30)     # the add ran
                finally:
                    worker.loop.subscribers.answer = answer
                conn, _ = worker._output_stream._active[subscriber]
                conn.shutdown(socket.SHUT_RDWR)
            worker._request_from_stream = lambda: read_then_break
        registry = InProcessRegistry()
        cluster = Cluster(registry, LeastLoadedPolicy(), router_id="router-a")
        registry.add(WorkerHandle("colocated-0", "colocated", worker))
        cluster.start()
        orch = Orchestrator(cluster, tokenizer)
        try:
            deadline = time.monotonic() + 30
            while "colocated-0" not in cluster._streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            v = ValidatedRequest("client-1", tuple(prompt), GREEDY, 0, True)
            out: list[int] = []
            async for ev in orch.generate(v):
                out += ev.update.token_ids
            counts = await worker.check_invariants()
            return out, calls, counts
        finally:
            await cluster.stop()
            await worker.shutdown()

    out, calls, counts = asyncio.run(scenario())
    ref = f32_weights.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out == list(ref)
    assert counts["adds_from_stream"] == 1
    assert calls == ([] if path == "stream" else [True])
    assert counts["num_free_blocks"] == counts["num_blocks"]


@pytest.mark.slow
def test_a_prefill_worker_answers_each_request_from_the_stream(config, f32_weights):
    """Frames handed to a prefill worker as its stream's reader thread does: each
    prefill runs on the actor's event loop and is answered with the error its call
    raises (no ticket from a decode worker in time: KVTransferError; fenced:
    WorkerFencedError; aborted while waiting for the ticket; aborted before its
    frame came: KVTransferError, and a call after such an abort too); a call marked
    ``sent_on_stream`` returns the frame's prefill, which ran once; another
    router's frame is ignored; no block is held after."""
    from tandem.kvtransfer.base import KVTransferError
    from tandem.prefill_worker.worker import PrefillWorker
    from tandem.router.worker_client import call_worker

    def remote(rid: str, router_id: str = "router-a") -> WorkerRequest:
        return dataclasses.replace(_request(rid, router_id),
                                   kv_transfer_params=KVTransferParams("decode-0", None, 0))

    async def scenario():
        worker = PrefillWorker("prefill-0", config, weights_from=f32_weights.engine,
                               ticket_timeout_s=0.5)
        try:
            await worker.open_output_stream("router-a")    # the stream's listener
            prefill = worker._request_from_stream()
            outbox = _Outbox(worker, "router-a")
            await worker.poll(0.01, "router-a")
            prefill("router-a", remote("p1"))
            prefill("router-b", remote("foreign"))
            prefill("router-a", remote("p2"))
            while "p2" not in worker._ticket_waits:      # p2 waits for its ticket
                await asyncio.sleep(0.01)
            assert await worker.abort("p2")
            await outbox.read(lambda: len(outbox.answers) >= 2)
            # The stream broke before p1's answer: the call returns that prefill's end.
            with pytest.raises(KVTransferError, match="no KV ticket"):
                await call_worker("prefill-0", worker, "prefill",
                                  dataclasses.replace(remote("p1"), sent_on_stream=True))
            await worker.fence("lease lost")
            prefill("router-a", remote("p3"))
            await outbox.read(lambda: len(outbox.answers) >= 3)
            await worker.unfence()
            # An abort (by call) that overtakes its request's frame: the frame is
            # refused when it comes, as is a call after such an abort.
            assert not await worker.abort("p4")
            prefill("router-a", remote("p4"))
            await outbox.read(lambda: len(outbox.answers) >= 4)
            assert not await worker.abort("p5")
            with pytest.raises(KVTransferError, match="aborted before it arrived"):
                await call_worker("prefill-0", worker, "prefill", remote("p5"))
            return outbox.answers, await worker.check_invariants(), dict(worker._ticket_waits)
        finally:
            await worker.shutdown()

    answers, counts, waits = asyncio.run(scenario())
    got = {a.request_id: a for a in answers}
    assert sorted(got) == ["p1", "p2", "p3", "p4"]           # not router-b's
    assert isinstance(got["p1"].error, KVTransferError) and got["p1"].first is None
    assert isinstance(got["p2"].error, asyncio.CancelledError)
    assert isinstance(got["p3"].error, WorkerFencedError)
    assert isinstance(got["p4"].error, KVTransferError)
    assert "aborted before it arrived" in str(got["p4"].error)
    assert counts["prefills_from_stream"] == 4               # p1 once, p2, p3, p4
    assert counts["num_free_blocks"] == counts["num_blocks"] and counts["num_waiting"] == 0
    assert waits == {}
