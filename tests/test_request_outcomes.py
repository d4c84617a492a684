"""How a request ends is decided once, in ``Orchestrator.generate``'s exit, and counted
once: ran to its end, failed, or stopped by its consumer (the client went away) at
any point, including after it had finished (then it is no abort). The orchestrator
runs for real over a stand-in cluster whose one worker's deltas the test feeds;
the counts are read from the real Prometheus exposition. (Through real gRPC and
HTTP: tests/serving/test_metrics.py, test_openai_api.py.)"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.runtime.outputs import RequestDelta
from tandem.router.metrics import ABORT_SOURCES, Metrics
from tandem.router.orchestrator import FAIL_WITH_SIBLINGS, Orchestrator
from tandem.router.registry import WorkerHandle
from tandem.router.server import request_from_proto
from tandem.router.validation import RequestValidator
from tandem.router.worker_client import WorkerError
from tandem.v1 import tandem_pb2 as pb


class _Worker:
    """The stand-in worker object (called in-process through the router's typed
    client): records which of its methods were called."""

    def __init__(self, cluster: "_Cluster"):
        self.cluster = cluster

    async def add_request(self, request) -> None:
        self.cluster.calls.append("add_request")
        if self.cluster.add_error is not None:
            raise self.cluster.add_error

    async def abort(self, request_id, sample_index=0) -> bool:
        self.cluster.calls.append("abort")
        return True


class _Cluster:
    """One colocated worker that answers every call at once; ``deliver`` feeds the
    request's deltas as the worker's output pump would."""

    router_id = ""
    disaggregated = False

    def __init__(self, add_error: BaseException | None = None):
        self.worker = WorkerHandle("colocated-0", "colocated", _Worker(self))
        self.decode = [self.worker]
        self.add_error = add_error
        self.calls: list[str] = []
        self.rid: str | None = None
        self.queue: asyncio.Queue | None = None

    def reserve_decode(self, rid, prompt_token_ids, exclude=()):
        return self.worker

    def register(self, rid, worker):
        self.rid, self.queue = rid, asyncio.Queue()
        return self.queue

    def unregister(self, rid):
        self.queue = None

    def add_on_stream(self, worker, request):
        return None                  # no output stream: requests go by call


    def deliver(self, tokens=(7,), finish_reason=None):
        self.queue.put_nowait(RequestDelta(self.rid, tuple(tokens), finish_reason=finish_reason))


def _counts(metrics: Metrics) -> dict[str, float]:
    """Non-zero ``request_aborts`` by source and ``request_success`` by reason."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == "tandem:request_aborts_total" and s.value:
                out[f"aborts:{s.labels['source']}"] = s.value
            elif s.name == "tandem:request_success_total" and s.value:
                out[s.labels["finished_reason"]] = s.value
    return out


@pytest.fixture
def request_(tokenizer):
    return RequestValidator(tokenizer, 2048).validate(request_from_proto(pb.GenerateRequest(
        prompt="Hello", stream=True, sampling=pb.SamplingParams(max_tokens=50, ignore_eos=True))))


def _orchestrator(tokenizer, cluster) -> tuple[Orchestrator, Metrics]:
    metrics = Metrics("m")
    return Orchestrator(cluster, tokenizer, metrics), metrics


async def _settle(orch: Orchestrator) -> None:
    """Let the background aborts on the workers run."""
    while orch._background:
        await asyncio.sleep(0)


def test_runs_to_its_end(tokenizer, request_):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)
        events = orch.generate(request_, "grpc_cancel")
        first = asyncio.ensure_future(anext(events))
        while cluster.queue is None:
            await asyncio.sleep(0)
        cluster.deliver()
        assert (await first).update.token_ids == [7]
        cluster.deliver(finish_reason="length")
        async for _ in events:
            pass
        await _settle(orch)
        return metrics, cluster
    metrics, cluster = asyncio.run(run())
    assert _counts(metrics) == {"length": 1}
    assert cluster.calls == ["add_request"]


@pytest.mark.parametrize("stop", ["cancel", "close"])
@pytest.mark.parametrize("source", ["grpc_cancel", "http_disconnect"])
def test_a_consumer_that_stops_early_is_one_abort_of_its_source(tokenizer, request_, stop,
                                                                source):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)
        events = orch.generate(request_, source)
        got = asyncio.Queue()

        async def consume():
            async with contextlib.aclosing(events):
                async for ev in events:
                    got.put_nowait(ev)
                    if stop == "close":
                        return                             # closes it at its yield
        task = asyncio.ensure_future(consume())
        while cluster.queue is None:
            await asyncio.sleep(0)
        cluster.deliver()
        await got.get()
        if stop == "cancel":                               # cancelled while it waits
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _settle(orch)
        return metrics, cluster
    metrics, cluster = asyncio.run(run())
    assert _counts(metrics) == {f"aborts:{source}": 1, "abort": 1}
    assert cluster.calls == ["add_request", "abort"]      # stopped on the worker too


def test_cancelled_before_its_first_token(tokenizer, request_):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)
        task = asyncio.ensure_future(anext(orch.generate(request_, "grpc_cancel")))
        while cluster.queue is None:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _settle(orch)
        return metrics
    assert _counts(asyncio.run(run())) == {"aborts:grpc_cancel": 1, "abort": 1}


@pytest.mark.parametrize("stop", ["cancel", "close"])
def test_a_request_that_finished_is_no_abort_however_late_its_client_leaves(tokenizer,
                                                                            request_, stop):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)
        events = orch.generate(request_, "grpc_cancel")
        first = asyncio.ensure_future(anext(events))
        while cluster.queue is None:
            await asyncio.sleep(0)
        cluster.deliver(finish_reason="length")
        ev = await first
        assert ev.sample.finished
        if stop == "close":
            await events.aclose()          # before the generator ran to its end
        else:
            task = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await _settle(orch)
        return metrics, cluster
    metrics, cluster = asyncio.run(run())
    assert _counts(metrics) == {"length": 1}
    assert "abort" not in cluster.calls


def test_a_failure_is_an_error_not_an_abort(tokenizer, request_):
    async def run():
        cluster = _Cluster(add_error=RuntimeError("the engine broke"))
        orch, metrics = _orchestrator(tokenizer, cluster)
        with pytest.raises(WorkerError, match="colocated-0.add_request: RuntimeError: the engine broke"):
            async for _ in orch.generate(request_, "grpc_cancel"):
                pass
        await _settle(orch)
        return metrics
    assert _counts(asyncio.run(run())) == {"error": 1}


def test_stopped_with_a_failed_sibling_is_an_error(tokenizer, request_):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)

        async def consume():
            async for _ in orch.generate(request_, "http_disconnect"):
                pass
        task = asyncio.ensure_future(consume())
        while cluster.queue is None:
            await asyncio.sleep(0)
        task.cancel(FAIL_WITH_SIBLINGS)
        await asyncio.gather(task, return_exceptions=True)
        await _settle(orch)
        return metrics
    assert _counts(asyncio.run(run())) == {"error": 1}


def test_a_worker_side_abort_counts_as_source_worker(tokenizer, request_):
    async def run():
        cluster = _Cluster()
        orch, metrics = _orchestrator(tokenizer, cluster)
        events = orch.generate(request_, "grpc_cancel")
        first = asyncio.ensure_future(anext(events))
        while cluster.queue is None:
            await asyncio.sleep(0)
        cluster.deliver(tokens=(), finish_reason="abort")
        await first
        async for _ in events:
            pass
        return metrics
    assert _counts(asyncio.run(run())) == {"aborts:worker": 1, "abort": 1}


def test_every_source_is_exposed_at_zero_and_nothing_else_is_accepted():
    metrics = Metrics("m")
    text = metrics.render().decode()
    for source in ABORT_SOURCES:
        assert f'tandem:request_aborts_total{{model_name="m",source="{source}"}} 0.0' in text
    with pytest.raises(ValueError, match="source"):
        metrics.request_cancelled("grpc")
