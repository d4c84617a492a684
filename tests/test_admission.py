"""Rate-limit admission: one path (router/admission.py) for both front ends, on a real
RateLimiter over a real redis-server.

The front ends run in process: the real gRPC server on a loopback port and the real
HTTP app (through httpx's ASGI transport). Admission refuses before the
orchestrator would run a request, so theirs is a stand-in that only says the
cluster can serve.
"""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import grpc
import httpx
import pytest

from tandem.control.rate_limits import RateLimiter, RateLimits
from tandem.control.redis_server import EmbeddedRedis
from tandem.control.state import ClusterState
from tandem.router.admission import ANONYMOUS, HeldSlot, RateLimitExceeded, admit
from tandem.router.metrics import Metrics
from tandem.router.openai_api import OpenAIServer
from tandem.router.server import TandemService, start_grpc_server
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

CONCURRENT = "rate limit exceeded for this API key: too many concurrent requests"


@pytest.fixture(scope="module")
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def state(redis_url):
    s = ClusterState(redis_url)
    s.redis.flushall()
    yield s
    s.close()


def _rate_limited(metrics: Metrics, reason: str) -> float:
    line = f'tandem:requests_rate_limited_total{{model_name="m",reason="{reason}"}} '
    text = metrics.render().decode()
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_admit_holds_a_slot_until_released_and_refuses_past_the_cap(state):
    limiter = RateLimiter(state, RateLimits(max_concurrency=1))
    metrics = Metrics("m")

    async def run() -> None:
        held = await admit(limiter, None, "r1", metrics)
        assert held == HeldSlot(limiter, ANONYMOUS, "r1")
        assert limiter.in_flight(ANONYMOUS) == 1
        with pytest.raises(RateLimitExceeded) as info:
            await admit(limiter, None, "r2", metrics)
        assert (info.value.reason, info.value.retry_after_s, info.value.retry_after_seconds,
                str(info.value)) == ("concurrency", 0.0, 1, CONCURRENT)
        assert limiter.in_flight(ANONYMOUS) == 1         # the refused one holds nothing
        other = await admit(limiter, "key-2", "r2", metrics)     # another key's own cap
        assert other == HeldSlot(limiter, "key-2", "r2")
        await held.release()
        await other.release()
        assert limiter.in_flight(ANONYMOUS) == limiter.in_flight("key-2") == 0
        assert await admit(None, None, "r3", metrics) is None    # no limiter: nothing held

    asyncio.run(run())
    assert _rate_limited(metrics, "concurrency") == 1


def test_both_front_ends_refuse_through_the_one_admission_path(state, tokenizer):
    limiter = RateLimiter(state, RateLimits(max_concurrency=1))
    metrics = Metrics("m")
    orchestrator = SimpleNamespace(cluster=SimpleNamespace(can_serve=True))
    info = {"model_name": "m", "max_model_len": 64, "block_size": 16, "dtype": "float32",
            "vocab_size": tokenizer.vocab_size}
    assert limiter.admit(ANONYMOUS, "holder").allowed           # the cap is taken

    async def grpc_refusal() -> grpc.aio.AioRpcError:
        service = TandemService(orchestrator, tokenizer, info, metrics, limiter)
        server, port, _ = await start_grpc_server(service, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in pb_grpc.TandemStub(channel).Generate(
                            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), timeout=30):
                        pass
                return err.value
        finally:
            await server.stop(None)

    async def http_refusals() -> list[httpx.Response]:
        app = OpenAIServer(orchestrator, tokenizer, info, metrics, limiter=limiter).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://tandem") as client:
            return [await client.post("/v1/completions", json={"prompt": [1, 2]}),
                    await client.post("/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "Hi"}]})]

    err = asyncio.run(grpc_refusal())
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"{CONCURRENT} (retry after 1 s)")
    for r in asyncio.run(http_refusals()):
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json() == {"error": {"message": CONCURRENT, "type": "RateLimitError",
                                      "param": None, "code": 429}}
    # Counted once per refusal, by the shared path, whichever front end asked.
    assert _rate_limited(metrics, "concurrency") == 3
    assert limiter.in_flight(ANONYMOUS) == 1                    # still only the holder
