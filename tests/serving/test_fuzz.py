"""Fuzzing both front ends of a real cluster: schemathesis on the HTTP API's generated
OpenAPI schema, hypothesis on the gRPC API's protobuf. Neither finds a 5xx or an
UNKNOWN / INTERNAL status, no error message carries a traceback or a source path,
and the server keeps serving afterwards.

The cluster's context is 64 tokens, so an accepted fuzzed request (up to n = 128
samples) costs at most a few thousand tokens.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.conftest import Client, serve_config, start_server
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64
FUZZ = settings(max_examples=10, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def cluster(ray_session):
    cfg = serve_config("colocated", http_port=0)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_model_len=MAX_MODEL_LEN))
    server = start_server(cfg)
    client = Client(server)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.server.server.http_port}"


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def _clean(text: str) -> None:
    assert "Traceback" not in text and ".py\"" not in text and "/site-packages/" not in text, text


def _operations(api_schema) -> list:
    ops = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize", "GET /v1/models", "GET /health"}
    return ops


def test_http_fuzz_finds_no_server_error(api_schema, base_url):
    for op in _operations(api_schema):
        @given(case=op.as_strategy())
        @FUZZ
        def run(case):
            response = case.call(base_url=base_url, timeout=120)
            assert response.status_code < 500, (case.as_curl_command(), response.text[:400])
            if response.status_code >= 400:
                body = response.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
                _clean(response.text)
        run()


def test_http_still_serves_after_the_fuzz(base_url):
    r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- gRPC --------------------------------------------------------------------------------------

_u32 = st.integers(0, 2 ** 32 - 1)
_small = st.integers(0, 40)
_float = st.floats(allow_nan=True, allow_infinity=True, width=32)
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | \
    st.sampled_from(["<|im_start|>", "<|im_end|>", "\x00", "🎉" * 20, " " * 30])

_sampling = st.builds(
    pb.SamplingParams,
    n=st.one_of(st.integers(0, 3), st.integers(0, 300), _u32),
    max_tokens=st.one_of(_small, _u32),
    temperature=_float, top_k=st.integers(-(2 ** 31), 2 ** 31 - 1), top_p=_float, min_p=_float,
    repetition_penalty=_float, presence_penalty=_float, frequency_penalty=_float,
    seed=st.integers(0, 2 ** 64 - 1),
    stop_token_ids=st.lists(_u32, max_size=3), stop=st.lists(_text, max_size=3),
    include_stop_str_in_output=st.booleans(), ignore_eos=st.booleans(),
    logprobs=st.one_of(st.integers(0, 25), _u32), min_tokens=st.one_of(_small, _u32),
    skip_special_tokens=st.booleans())

_input = st.one_of(
    st.builds(lambda t: {"prompt": t}, _text),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
              st.lists(st.one_of(st.integers(0, 49151), _u32), max_size=80)),
    st.builds(lambda ms: {"chat": pb.ChatMessages(messages=ms)}, st.lists(
        st.builds(pb.ChatMessage, role=st.one_of(st.sampled_from(["user", "system", "assistant"]),
                                                 _text), content=_text), max_size=3)),
    st.just({}))

_request = st.builds(
    lambda inp, sampling, has_sampling, priority, stream, rid: pb.GenerateRequest(
        request_id=rid, sampling=sampling if has_sampling else None, priority=priority,
        stream=stream, **inp),
    _input, _sampling, st.booleans(), st.integers(-(2 ** 31), 2 ** 31 - 1), st.booleans(),
    st.one_of(st.just(""), _text, st.text(min_size=257, max_size=300)))

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@given(request=_request)
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_grpc_fuzz_finds_no_unknown_or_internal(cluster, request):
    try:
        responses = list(cluster.stub.Generate(request, timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details(), request)
        _clean(exc.details())
        return
    for r in responses:
        assert r.finish_reason != pb.FINISH_REASON_ERROR, (r, request)
        for lp in r.logprobs:
            assert not math.isnan(lp.logprob)


def test_grpc_still_serves_after_the_fuzz(cluster):
    out = cluster.generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(
        max_tokens=2, ignore_eos=True, temperature=0.0)))
    assert sum(len(r.token_ids) for r in out) == 2
    counts = cluster.wait_idle(30)
    for wid, c in counts.items():
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)
