"""Structured outputs through the served APIs of a disaggregated cluster (the prefill
worker samples the first token under the grammar, the decode worker's matcher
replays it): the ``openai`` SDK's ``response_format`` and vLLM's ``guided_*`` fields
on both endpoints, gRPC's ``constraint`` oneof, and refusals naming the field."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from tests.serving.conftest import Client, serve_config, start_server
from tests.test_structured_outputs import SCHEMAS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_session):
    server = start_server(serve_config("disaggregated", http_port=0))
    client = Client(server)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def api(cluster) -> openai.OpenAI:
    url = f"http://127.0.0.1:{cluster.server.server.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _chat(api, question: str, **kw):
    return api.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=120, **kw).choices[0]


def test_openai_sdk_json_schema_regex_and_choice(api, cluster):
    for i, schema in enumerate(SCHEMAS[:4]):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                      "strict": True}}
        kw = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0}
        c = _chat(api, "Describe a person from Paris in JSON.", response_format=fmt, **kw)
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    c = _chat(api, "What is the capital of France? Reply in JSON.",
              response_format={"type": "json_object"}, temperature=0.0)
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)
    c = _chat(api, "Is the sky blue?", temperature=0.0,
              extra_body={"guided_choice": ["yes", "no"]})
    assert c.message.content in ("yes", "no") and c.finish_reason == "stop"
    comp = api.completions.create(model="SmolLM2-135M-Instruct", prompt="My phone number is",
                                  max_tokens=30, temperature=0.0,
                                  extra_body={"guided_regex": r"\(0[1-9]\) [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\(0[1-9]\) [0-9]{3}-[0-9]{4}", comp.choices[0].text)
    stream = api.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=40, temperature=0.0, stream=True,
        extra_body={"guided_json": SCHEMAS[5]})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[5])
    counts = cluster.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values())
    # Both workers compiled (or found cached) each of the 8 grammars: the prefill worker
    # samples the first token under it, the decode worker goes on from there.
    m = _scrape(cluster)
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        labels = (("model_name", "SmolLM2-135M-Instruct"), ("role", role), ("worker", wid))
        compiles = m[("tandem:structured_output_compiles_total", labels)]
        hits = m[("tandem:structured_output_cache_hits_total", labels)]
        assert compiles >= 1 and compiles + hits >= 8, (wid, compiles, hits)
        assert m[("tandem:structured_output_compile_seconds_total", labels)] > 0


def _scrape(cluster) -> dict:
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    time.sleep(1.5)          # one more stats round from every worker
    url = f"http://127.0.0.1:{cluster.server.server.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_bad_constraints_are_refused_by_name(api, cluster):
    from tandem.v1 import tandem_pb2 as pb

    cases = [({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
              "response_format"),
             ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
             ({"extra_body": {"guided_grammar": "root ::= nowhere"}}, "guided_grammar"),
             ({"response_format": {"type": "json_object"},
               "extra_body": {"guided_choice": ["a"]}}, "guided_choice")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(api, "Hi", **kw)
        assert e.value.response.json()["error"]["param"] == param
    with pytest.raises(grpc.RpcError) as e:
        cluster.generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
            json_schema='{"type": "objectx"}')))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.json_schema: ")
    [resp] = cluster.generate(pb.GenerateRequest(prompt="The answer is", sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=10, choice=pb.Choices(choices=["yes", "no"]))))
    assert resp.text in ("yes", "no") and resp.finish_reason == pb.FINISH_REASON_STOP
