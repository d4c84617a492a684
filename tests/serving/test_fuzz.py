"""Fuzzing both front ends of a real cluster.

HTTP: schemathesis on the server's own ``/openapi.json`` (schema-valid and
schema-invalid requests, every response checked against what the spec says:
status, content type, headers, body), and hypothesis on raw bodies (bytes that
are not UTF-8 or not JSON, JSON holding lone surrogates, valid requests with one
field replaced by any JSON value). gRPC: hypothesis on ``GenerateRequest``
messages and on raw bytes (garbage, truncated and mutated messages) sent to
``Generate`` and ``GetModelInfo``.

None of it gets a 5xx, an UNKNOWN or an INTERNAL status; every HTTP refusal has
the documented ``{"error": {...}}`` shape; no message carries an internal class
name, a traceback, a source file or a server path; afterwards the server still
serves and every KV block is free again.

Each fuzz test stops generating after :data:`BUDGET_S` seconds (the examples left
are skipped), and the cluster's context is 64 tokens, so an accepted fuzzed request
(up to n = 128 samples) costs at most a few thousand tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks as sc

from tests.serving.conftest import Client, serve_config, start_server
from tests.test_error_messages import LEAKS
from tandem.v1 import tandem_pb2 as pb

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64
BUDGET_S = 30.0
"""Seconds of fuzzing per test; the rest of its examples are skipped."""
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
MODEL = "SmolLM2-135M-Instruct"
# What a message must not show: a Python exception's class (``<class '...Error'>``),
# protobuf's module, a traceback or a file path (LEAKS).
INTERNALS = re.compile(r"Error'>|google\.protobuf|Traceback")


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


class Budget:
    """``BUDGET_S`` seconds from the first :meth:`spent` call."""

    def __init__(self, seconds: float = BUDGET_S):
        self.seconds, self.end = seconds, None

    def spent(self) -> bool:
        if self.end is None:
            self.end = time.monotonic() + self.seconds
        return time.monotonic() > self.end


def _clean(text: str) -> None:
    assert not INTERNALS.search(text) and not LEAKS.search(text), text


def _check_http(response, request_repr) -> None:
    """No 5xx; a refusal in the documented shape with a clean message."""
    status = response.status_code
    assert status < 500, (request_repr, status, response.text[:400])
    if status >= 400:
        content_type = response.headers["content-type"]   # schemathesis: a list
        content_type = content_type if isinstance(content_type, str) else content_type[0]
        assert content_type == "application/json", (request_repr, status)
        body = response.json()
        assert set(body) == {"error"}, (request_repr, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, (request_repr, body)
        assert body["error"]["code"] == status
        _clean(body["error"]["message"])


def _assert_idle(cluster) -> None:
    counts = cluster.wait_idle(30)
    for wid, c in counts.items():
        assert c["num_running"] == c["num_waiting"] == c["num_swapped"] == 0, (wid, c)
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)


# -- HTTP ----------------------------------------------------------------------------------

def _operations(api_schema) -> list:
    ops = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} == {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize", "GET /v1/models", "GET /health", "GET /metrics"}
    return ops


# The checks that hold a response to the spec. Not positive_data_acceptance: a
# schema-valid request may still be refused (top_p 1.5 is a number).
SPEC_CHECKS = [sc.not_a_server_error, sc.status_code_conformance, sc.content_type_conformance,
               sc.response_headers_conformance, sc.response_schema_conformance]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])
def test_http_fuzz_holds_to_the_openapi_spec(api_schema, base_url, mode):
    budget = Budget(BUDGET_S / 2)
    for op in _operations(api_schema):
        if mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET":
            continue                            # no parameters: nothing can be invalid
        @given(case=op.as_strategy(generation_mode=mode))
        @FUZZ
        def run(case):
            if budget.spent():
                return
            checks = SPEC_CHECKS + [sc.negative_data_rejection] \
                if mode is schemathesis.GenerationMode.NEGATIVE else SPEC_CHECKS
            response = case.call_and_validate(base_url=base_url, timeout=120, checks=checks)
            _check_http(response, case.as_curl_command())
        run()


ENDPOINTS = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "Hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
FIELDS = sorted({"prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k",
                 "min_p", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
                 "stream", "stream_options", "echo", "priority", "tokens", "model",
                 "repetition_penalty", "presence_penalty", "min_tokens", "logit_bias",
                 "max_completion_tokens", "best_of", "add_generation_prompt", "user"})
# Text with lone surrogates (hypothesis leaves them out unless asked), and JSON escapes.
_any_text = st.text(st.characters(exclude_categories=()), max_size=12) | \
    st.sampled_from(["\ud800", "a\udfff", "<|im_end|>", "\x00", "🎉"])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 130)
    | st.floats(allow_nan=True, allow_infinity=True) | _any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_any_text, inner, max_size=3)
    | st.fixed_dictionaries({"role": _any_text, "content": inner}).map(lambda m: [m]),
    max_leaves=8)


@st.composite
def _bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    kind = draw(st.sampled_from(["field", "field", "field", "bytes", "utf8", "json"]))
    if kind == "bytes":                       # anything, mostly not UTF-8 or not JSON
        return path, draw(st.binary(max_size=64))
    if kind == "utf8":                        # a valid body cut or with a byte flipped
        raw = bytearray(json.dumps(ENDPOINTS[path]).encode())
        i = draw(st.integers(0, len(raw) - 1))
        if draw(st.booleans()):
            return path, bytes(raw[:i])
        raw[i] = draw(st.integers(0x80, 0xff))
        return path, bytes(raw)
    if kind == "json":                        # any JSON value as the whole body
        return path, json.dumps(draw(_json)).encode()
    body = dict(ENDPOINTS[path])
    body[draw(st.sampled_from(FIELDS))] = draw(_json)
    return path, json.dumps(body).encode()      # ensure_ascii: surrogates as \ud800


def test_http_raw_body_fuzz_gets_clean_refusals(base_url):
    budget = Budget()

    @given(request=_bodies())
    @settings(FUZZ, max_examples=150)
    def run(request):
        if budget.spent():
            return
        path, body = request
        response = httpx.post(f"{base_url}{path}", content=body, timeout=120,
                              headers={"content-type": "application/json"})
        _check_http(response, (path, body[:200]))
    run()


def test_http_still_serves_after_the_fuzz(cluster, base_url):
    r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{base_url}/health").status_code == 200
    _assert_idle(cluster)


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


def test_grpc_fuzz_finds_no_unknown_or_internal(cluster):
    budget = Budget()

    @given(request=_request)
    @settings(FUZZ, max_examples=30)
    def run(request):
        if budget.spent():
            return
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
    run()


@st.composite
def _wire_bytes(draw) -> bytes:
    """Bytes for a request message: garbage, or a valid message cut short or with
    bytes overwritten (many of which are still valid messages)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=48))
    raw = bytearray(draw(_request).SerializeToString())
    if not raw:
        return b"\xff"
    if draw(st.booleans()):
        return bytes(raw[:draw(st.integers(0, len(raw) - 1))])
    for _ in range(draw(st.integers(1, 3))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


def test_grpc_raw_bytes_fuzz_finds_no_unknown_or_internal(cluster):
    generate = cluster.channel.unary_stream("/tandem.v1.Tandem/Generate")  # bytes as they are
    model_info = cluster.channel.unary_unary("/tandem.v1.Tandem/GetModelInfo")
    budget = Budget()

    @given(payload=_wire_bytes(), method=st.sampled_from(["Generate", "GetModelInfo"]))
    @settings(FUZZ, max_examples=150)
    def run(payload, method):
        if budget.spent():
            return
        try:
            if method == "Generate":
                list(generate(payload, timeout=120))
            else:
                pb.GetModelInfoResponse.FromString(model_info(payload, timeout=60))
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (exc.code(), exc.details(), method, payload)
            _clean(exc.details())
            if exc.details().startswith("request: "):
                assert exc.details() == f"request: not a valid tandem.v1.{method}Request message"
    run()


def test_grpc_still_serves_after_the_fuzz(cluster):
    out = cluster.generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(
        max_tokens=2, ignore_eos=True, temperature=0.0)))
    assert sum(len(r.token_ids) for r in out) == 2
    assert cluster.stub.GetModelInfo(pb.GetModelInfoRequest()).max_model_len == MAX_MODEL_LEN
    _assert_idle(cluster)
