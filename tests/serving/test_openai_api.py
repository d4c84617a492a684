"""The OpenAI-compatible HTTP API, driven by the real ``openai`` client against a real
cluster (Ray worker, gRPC and HTTP front ends on one orchestrator), modelled on vLLM's
``tests/entrypoints/openai`` assertions: usage, finish reasons, logprobs 0/5/21,
stream == non-stream, ``n``, the include_usage matrix, batched prompts, echo, errors
and their shapes, tokenize / detokenize, and a client disconnect freeing its blocks.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time

import httpx
import openai
import pytest

from tests.serving.conftest import Client, serve_config, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster(ray_session):
    server = start_server(serve_config("colocated", http_port=0))
    client = Client(server)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.server.server.http_port}"


@pytest.fixture(scope="module")
def api(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == exc.status_code
    assert "Traceback" not in body["error"]["message"] and ".py" not in body["error"]["message"]
    return body["error"]


def _count(base_url: str, prompt: str) -> int:
    return len(httpx.post(f"{base_url}/tokenize", json={"prompt": prompt}).json()["tokens"])


# -- models, tokenize ------------------------------------------------------------------------

def test_models_lists_the_served_model(api):
    [m] = api.models.list().data
    assert m.id == MODEL and m.owned_by == "tandem"


def test_tokenize_and_detokenize_round_trip(base_url, cluster):
    ids = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 8192
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == PROMPT
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT}).json()
    header = httpx.post(f"{base_url}/tokenize", json={"prompt": "<|im_start|>assistant\n",
                                                      "add_special_tokens": False}).json()
    assert len(header["tokens"]) == 4 and chat["tokens"][-4:] == header["tokens"]
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10 ** 7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


def test_health_and_metrics(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    text = httpx.get(f"{base_url}/metrics").text
    assert "tandem:num_requests_running" in text


# -- completions -----------------------------------------------------------------------------

def test_completion_usage_and_finish_reason(api, base_url):
    r = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0,
                               extra_body={"ignore_eos": True})
    [c] = r.choices
    assert c.finish_reason == "length" and c.index == 0 and len(c.text) > 0
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == _count(base_url, PROMPT)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_stop_string_finishes_with_stop(api):
    free = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free.strip().split()[1]
    r = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                               stop=[stop], extra_body={"ignore_eos": True})
    [c] = r.choices
    assert c.finish_reason == "stop" and stop not in c.text
    assert free.startswith(c.text)
    assert c.model_extra["stop_reason"] == stop


@pytest.mark.parametrize("k", [0, 5])
def test_completion_logprobs(api, k):
    r = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0,
                               logprobs=k, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)
    assert all(len(t) == k for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    if k:   # greedy: the chosen token is the most likely one
        for tok, top, v in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
            assert max(top.values()) == pytest.approx(v, abs=1e-5)


def test_completion_logprobs_21_is_refused(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=21)
    assert _error(e.value)["param"] == "logprobs"


def test_stream_text_equals_non_stream_text(api):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0,
              extra_body={"ignore_eos": True})
    full = api.completions.create(**kw).choices[0]
    chunks = list(api.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_cut_inside_a_character_ends_at_the_last_whole_one(api):
    # max_tokens ends the answer after two of 👍's four bytes: decode would show U+FFFD.
    answer = "你好，世界 🎉👍🏽🇯🇵\n你好，世界 🎉"
    kw = dict(model=MODEL, prompt="你好，世界 🎉👍🏽🇯🇵\n" * 6, max_tokens=40, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:   # one batch: as cheap as one
        whole = pool.submit(api.completions.create, **kw)
        chunks = list(api.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}))
        whole = whole.result()
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (answer, "length")
    assert whole.usage.completion_tokens == 40
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert all("\ufffd" not in t for t in texts) and "".join(texts) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_include_usage_matrix(api, include_usage):
    opts = None if include_usage is None else {"include_usage": include_usage}
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                         temperature=0.0, stream_options=opts,
                                         extra_body={"ignore_eos": True}))
    if include_usage:
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 3
        assert last.usage.total_tokens == last.usage.prompt_tokens + 3
        assert all(c.usage is None for c in body)
    else:
        assert all(c.usage is None for c in chunks)


def test_chat_include_usage(api):
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                              stream=True, temperature=0.0,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_chat_stream_role_chunk_comes_with_the_first_token(base_url):
    """As vLLM sends it: clients take TTFT at the first chunk (``vllm bench serve``
    does), so a role chunk sent before the prefill would report a TTFT of ~0."""
    prompt = "Repeat: " + " ".join(f"w{i}" for i in range(600))     # ~1,800 tokens of prefill
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "stream": True, "temperature": 0.0, "ignore_eos": True}
    times, chunks = [], []
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - t0)
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["content"]
    # The prefill lies before the role chunk, not between it and the first token.
    assert times[1] - times[0] < 0.5 * times[0], times


def test_n_and_batched_prompts(api, base_url):
    prompts = [PROMPT, "One, two, three,"]
    r = api.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=3, temperature=1.0,
                               seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 6 * 4
    alone = [api.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0.0,
                                    extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    greedy = api.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(greedy.choices, key=lambda c: c.index)] == alone
    assert greedy.usage.prompt_tokens == sum(_count(base_url, p) for p in prompts)


def test_token_id_prompts(api, base_url):
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = api.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0.0)
    by_text = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_echo_prepends_the_prompt(api):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    plain = api.completions.create(**kw).choices[0].text
    echoed = api.completions.create(echo=True, **kw).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in api.completions.create(echo=True, stream=True,
                                                                         **kw) if c.choices)
    assert streamed == PROMPT + plain


# -- chat ------------------------------------------------------------------------------------

def test_chat_completion_and_stream_agree(api):
    kw = dict(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0.0)
    r = api.chat.completions.create(**kw)
    [c] = r.choices
    assert c.message.role == "assistant" and c.message.content
    assert r.object == "chat.completion" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in api.chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == c.message.content


def test_chat_logprobs(api):
    r = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0,
                                    logprobs=True, top_logprobs=5,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 5 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21)
    assert _error(e.value)["param"] == "top_logprobs"


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,param", [
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": ["x" * 300]}, "stop[0]"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
])
def test_bad_parameters_are_400_naming_the_param(api, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL, prompt=PROMPT, **kw)
    err = _error(e.value)
    assert err["param"] == param and err["type"] == "BadRequestError"
    assert err["message"].startswith(param + ":")


def test_bad_chat_messages_are_400(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=[{"role": "us er", "content": "x"}])
    assert _error(e.value)["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=[])
    assert _error(e.value)["param"] == "messages"


def test_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    err = _error(e.value)
    assert err["param"] == "model" and "gpt-4" in err["message"]


def test_malformed_body_is_400(base_url):
    r = httpx.post(f"{base_url}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _post_raw(base_url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def _refusal(r: httpx.Response, status: int) -> dict:
    """The documented error body of a refusal with ``status``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


LONE_SURROGATES = [      # JSON text: \ud800 decodes to a lone surrogate, no valid Unicode
    ("/v1/completions", r'{"prompt": "ab\ud800", "max_tokens": 1}', "prompt", 2, "D800"),
    ("/v1/completions", r'{"prompt": ["ok", "\udfff"], "max_tokens": 1}', "prompt[1]", 0,
     "DFFF"),
    ("/v1/completions", r'{"prompt": "ok", "stop": ["x", "\udc00"]}', "stop[1]", 0, "DC00"),
    ("/v1/completions", r'{"prompt": "ok", "model": "\ud800"}', "model", 0, "D800"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud800"}]}',
     "messages[0].content", 3, "D800"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages[0].content[0].text", 0, "D800"),
    ("/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "hi"}]}',
     "messages[0].role", 0, "D800"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt", 0, "D800"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "\udbff"}]}',
     "messages[0].content", 0, "DBFF"),
]


@pytest.mark.parametrize("path, body, param, position, code", LONE_SURROGATES,
                         ids=[f"{c[0]} {c[2]}" for c in LONE_SURROGATES])
def test_a_lone_surrogate_is_400_naming_the_field(base_url, path, body, param, position, code):
    # Before: 500 (protobuf and the tokenizer cannot encode it).
    err = _refusal(_post_raw(base_url, path, body.encode()), 400)
    assert err["param"] == param and err["type"] == "BadRequestError"
    assert err["message"] == (f"{param}: must be valid Unicode: character {position} is a "
                              f"lone surrogate (U+{code})")


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "\xff\xfe"}', "the body is not valid JSON: it is not UTF-8"),
    (b'{"prompt": "caf\xc3"}', "the body is not valid JSON: it is not UTF-8"),
    (b'{"prompt": ', "the body is not valid JSON: Expecting value"),
    (b"[" * 100_000, "the body is not valid JSON: it is nested too deeply"),
], ids=["invalid UTF-8", "truncated UTF-8", "truncated JSON", "nested too deeply"])
def test_an_unparsable_body_is_400_in_the_error_shape(base_url, body, message):
    # Before: FastAPI's {"detail": "There was an error parsing the body"}.
    err = _refusal(_post_raw(base_url, "/v1/completions", body), 400)
    assert err["message"] == message and err["param"] is None


def test_unknown_paths_and_methods_answer_in_the_error_shape(base_url):
    err = _refusal(httpx.get(f"{base_url}/v2/nothing"), 404)
    assert err == {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}
    r = httpx.delete(f"{base_url}/v1/completions")
    assert _refusal(r, 405)["message"] == "Method Not Allowed"
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_400(base_url, path, body, stream):
    # vLLM and OpenAI refuse it too; before, it was accepted and ignored.
    if stream is not None:
        body = {**body, "stream": stream}
    r = httpx.post(f"{base_url}{path}", timeout=60,
                   json={**body, "stream_options": {"include_usage": True}})
    err = _refusal(r, 400)
    assert err["param"] == "stream_options"
    assert err["message"] == "stream_options: only allowed when stream is true"


def test_a_chunked_body_over_the_cap_is_413(base_url):
    # Before: 400 {"detail": "There was an error parsing the body"}.
    from tandem.router.openai_api import MAX_BODY_BYTES

    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert _refusal(r, 413) == {
        "message": f"the request body must be at most {MAX_BODY_BYTES} bytes",
        "type": "RequestTooLargeError", "param": None, "code": 413}
    assert httpx.get(f"{base_url}/health").status_code == 200        # still serving


@pytest.mark.parametrize("kib", [65, 70, 96])
def test_a_head_over_64_kib_is_431(base_url, kib):
    # Before: heads that reached the server in one read passed (h11 checks its cap
    # only on an incomplete head).
    from tandem.router.openai_api import MAX_HEADER_BYTES

    r = httpx.get(f"{base_url}/v1/models", headers={"x-padding": "a" * (kib << 10)}, timeout=60)
    assert _refusal(r, 431)["message"] == (
        f"the request line and headers must be at most {MAX_HEADER_BYTES} bytes")
    ok = httpx.get(f"{base_url}/v1/models", headers={"x-padding": "a" * (63 << 10)}, timeout=60)
    assert ok.status_code == 200


def _raw_exchange(base_url: str, data: bytes) -> tuple[int, dict]:
    """Send ``data`` on a fresh connection and read the answer up to its close:
    ``(status, JSON body)``."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("data, status, message", [
    # Never finished: h11 refuses it once its buffer passes the cap (not the app).
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * (70 << 10), 431,
     "the request line and headers must be at most 65536 bytes"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400,
     "invalid HTTP request"),
], ids=["unfinished head over the cap", "malformed head"])
def test_the_http_servers_own_refusals_have_the_error_shape(base_url, data, status, message):
    # Before: uvicorn's plain-text "400 Invalid HTTP request received." for both.
    got, body = _raw_exchange(base_url, data)
    assert got == status and body["error"]["message"] == message
    assert body["error"]["code"] == status
    assert httpx.get(f"{base_url}/health").status_code == 200        # still serving


def test_openapi_documents_what_the_server_sends(base_url):
    # Before: 422 HTTPValidationError documented (400 {"error": ...} is sent), and
    # /health, /metrics documented as JSON.
    spec = httpx.get(f"{base_url}/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(spec)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    assert spec["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]
    assert set(spec["components"]["schemas"]["ErrorInfo"]["required"]) == {
        "message", "type", "param", "code"}
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                         ("/tokenize", "post"), ("/detokenize", "post"), ("/v1/models", "get"),
                         ("/health", "get"), ("/metrics", "get")]:
        responses = spec["paths"][path][method]["responses"]
        assert "422" not in responses, path
        for code in ("4XX", "5XX"):
            assert responses[code]["content"] == {"application/json": {"schema": error_ref}}
    for path in ("/v1/completions", "/v1/chat/completions"):
        ok = spec["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        assert spec["paths"][path]["post"]["responses"]["429"]["headers"]["Retry-After"]
    for path in ("/health", "/metrics"):
        assert set(spec["paths"][path]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(spec["paths"]["/health"]["get"]["responses"]["503"]["content"]) == {"text/plain"}
    assert httpx.get(f"{base_url}/health").headers["content-type"].startswith("text/plain")


# -- disconnects -----------------------------------------------------------------------------

def _aborts(cluster) -> dict[str, float]:
    """``tandem:request_aborts_total`` by source, and ``request_success`` of ``abort``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(cluster.metrics_text()):
        for smp in fam.samples:
            if smp.name == "tandem:request_aborts_total":
                out[smp.labels["source"]] = smp.value
            elif smp.name == "tandem:request_success_total" and \
                    smp.labels["finished_reason"] == "abort":
                out["success_abort"] = smp.value
    return out


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(cluster, base_url, stream):
    # Non-streaming: two prompts, two requests, two aborts.
    body = {"model": MODEL, "prompt": PROMPT if stream else [PROMPT, "Once upon a time"],
            "max_tokens": 2000, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    before = _aborts(cluster)
    if stream:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            frames = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    frames += 1
                    if frames == 3:
                        break                      # leave mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=3)
    t0 = time.monotonic()
    counts = cluster.wait_idle(30)
    for wid, c in counts.items():
        assert c["num_running"] == c["num_waiting"] == 0, (wid, c)
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)
    assert time.monotonic() - t0 < 30
    after = _aborts(cluster)       # counted before the workers were told to stop
    n = 1 if stream else 2
    assert {k: after[k] - before[k] for k in after} == {
        "http_disconnect": n, "grpc_cancel": 0, "worker": 0, "success_abort": n}


# -- rate limits -----------------------------------------------------------------------------

@pytest.fixture
def limited(cluster):
    """Swap in a rate limiter on the cluster's Redis for one test."""
    from tandem.control.rate_limits import RateLimiter, RateLimits

    http = cluster.server.server.http

    def set_limits(**kw) -> RateLimiter:
        http.limiter = RateLimiter(cluster.server.server.state, RateLimits(**kw))
        return http.limiter
    yield set_limits
    http.limiter = None


def test_rate_limit_answers_429_then_recovers(api, limited, cluster, base_url):
    limiter = limited(rate=0.5, burst=1)              # one request per 2 s
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:   # both admitted within ms
        answers = list(pool.map(lambda _: httpx.post(f"{base_url}/v1/completions", json=body,
                                                     timeout=60), range(2)))
    assert sorted(a.status_code for a in answers) == [200, 429]
    refused = next(a for a in answers if a.status_code == 429)
    err = refused.json()["error"]
    assert err["type"] == "RateLimitError" and "per second" in err["message"]
    assert refused.headers["retry-after"] == "2"
    time.sleep(2.05)                                  # one token refilled
    assert api.completions.create(**body).choices[0].finish_reason == "length"
    text = cluster.metrics_text()
    assert 'tandem:requests_rate_limited_total{model_name="SmolLM2-135M-Instruct",reason="rate"} 1.0' \
        in text
    assert limiter.in_flight("anonymous") == 0


def test_concurrency_cap_answers_429_while_a_stream_holds_the_slot(api, limited, base_url):
    limiter = limited(max_concurrency=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")       # the stream holds the slot
        second = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False})
        assert second.status_code == 429 and "concurrent" in second.json()["error"]["message"]
        assert limiter.in_flight("anonymous") == 1
        assert [x for x in lines if x][-1] == "data: [DONE]"
    deadline = time.monotonic() + 5
    while limiter.in_flight("anonymous") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert limiter.in_flight("anonymous") == 0       # released when the stream ended
    assert api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


def test_an_oversized_body_is_413(base_url):
    from tandem.router.openai_api import MAX_BODY_BYTES

    r = httpx.post(f"{base_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert httpx.get(f"{base_url}/health").status_code == 200        # still serving


def test_echo_with_logprobs_scores_the_prompt(api, base_url):
    """lm-eval-harness's loglikelihood request: echo + logprobs + max_tokens 1."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0, logprobs=3,
              extra_body={"ignore_eos": True})
    plain = api.completions.create(**kw).choices[0]
    echoed = api.completions.create(echo=True, **kw).choices[0]
    n_prompt = _count(base_url, PROMPT)
    lp = echoed.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 3 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == echoed.text == PROMPT + plain.text
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    chunks = [c.choices[0] for c in api.completions.create(echo=True, stream=True, **kw)
              if c.choices]
    assert "".join(c.text for c in chunks) == echoed.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


# -- beam search -----------------------------------------------------------------------------

def test_beam_search_choices_are_the_offline_beams(api, f32_weights):
    """vLLM's ``use_beam_search`` + ``n`` + ``length_penalty``: the choices are the
    beams of :meth:`LLM.beam_search`, best first, on both endpoints."""
    from tandem.engine.llm import LLM
    from tandem.engine.runtime.beam_search import BeamSearchParams

    llm = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    chat_ids = llm.tokenizer.apply_chat_template(CHAT)
    [comp_want, chat_want] = llm.beam_search(
        [PROMPT, {"prompt_token_ids": chat_ids}],
        BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.5))
    beam = {"use_beam_search": True, "length_penalty": 0.5}
    comp = api.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=12,
                                  extra_body=beam)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert [c.text for c in comp.choices] == [s.text for s in comp_want.sequences]
    assert [c.finish_reason for c in comp.choices] == \
        [s.finish_reason for s in comp_want.sequences]
    assert comp.usage.completion_tokens == sum(len(s.output_token_ids)
                                               for s in comp_want.sequences)
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, n=4, max_tokens=12,
                                       extra_body=beam)
    assert [c.message.content for c in chat.choices] == [s.text for s in chat_want.sequences]


@pytest.mark.parametrize("kw,param", [
    ({"n": 17}, "n"),
    ({"n": 4, "temperature": 0.7}, "temperature"),
    ({"n": 4, "stream": True}, "stream"),
    ({"n": 4, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
])
def test_beam_search_refusals_name_the_field(api, kw, param):
    extra = {"use_beam_search": True, **kw.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra, **kw)
    assert _error(e.value)["param"] == param


def test_length_penalty_without_beam_search_is_refused(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                               extra_body={"length_penalty": 0.5})
    assert _error(e.value)["param"] == "length_penalty"
