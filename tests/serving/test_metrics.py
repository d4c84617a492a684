"""Metrics through a real scrape: requests go through gRPC, then ``/metrics`` is read
over HTTP and parsed with ``prometheus_client.parser``; counters must be exact."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import tandem_pb2 as pb

from .conftest import Client, cancel_after, serve_config, start_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fresh(ray_session):
    server = start_server(serve_config("disaggregated", num_blocks=256))
    client = Client(server)
    # Before any test sends a request, whatever order the tests run in.
    client.startup_metrics = client.metrics_text()
    yield client
    client.close()
    server.stop()


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    want = tuple(sorted({"model_name": MODEL, **labels}.items()))
    return m.get((name, want), 0.0)


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def startup_series(workers: dict[str, str]) -> dict[tuple, float]:
    """Every sample but ``_created`` and ``_bucket`` that a cluster with ``workers``
    (id -> role) exposes before its first request: all of them 0."""
    from tandem.router.metrics import (FINISH_REASONS, PREEMPTION_KINDS, RATE_LIMIT_REASONS,
                                       REQUEST_FIELDS)

    def key(name, **labels):
        return name, tuple(sorted({"model_name": MODEL, **labels}.items()))

    want = [key(f"tandem:{n}_total") for n in ("prompt_tokens", "generation_tokens", "request_aborts")]
    want += [key("tandem:request_success_total", finished_reason=r) for r in FINISH_REASONS]
    want += [key("tandem:invalid_requests_total", field=f) for f in REQUEST_FIELDS]
    want += [key("tandem:requests_rate_limited_total", reason=r) for r in RATE_LIMIT_REASONS]
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        want += [key(f"tandem:{h}_count"), key(f"tandem:{h}_sum")]
    for wid, role in workers.items():
        w = dict(worker=wid, role=role)
        want += [key(f"tandem:{g}", **w) for g in ("num_requests_running", "num_requests_waiting",
                                                   "num_requests_swapped", "kv_cache_usage_perc")]
        want += [key("tandem:num_preemptions_total", kind=k, **w) for k in PREEMPTION_KINDS]
        want += [key(f"tandem:prefix_cache_{n}_total", **w) for n in ("queries", "hits")]
        want += [key(f"tandem:iteration_tokens_total_{n}", **w) for n in ("count", "sum")]
        want += [key("tandem:worker_restarts_total", worker=wid)]
        if role == "prefill":
            want += [key(f"tandem:kv_transfer_{n}", worker=wid) for n in (
                "bytes_total", "failures_total", "seconds_count", "seconds_sum")]
        else:
            want += [key("tandem:request_migrations_total", worker=wid)]
    assert len(set(want)) == len(want)
    return dict.fromkeys(want, 0.0)


def test_every_series_exists_at_zero_before_the_first_request(fresh):
    m = samples(fresh.startup_metrics)
    got = {k: v for k, v in m.items() if not k[0].endswith(("_created", "_bucket"))}
    assert got == startup_series({"prefill-0": "prefill", "decode-0": "decode"})
    # Each histogram's buckets are there too, empty.
    buckets = {k: v for k, v in m.items() if k[0].endswith("_bucket")}
    assert set(buckets.values()) == {0.0}
    assert {(n[:-len("_bucket")], tuple(kv for kv in labels if kv[0] != "le"))
            for n, labels in buckets} == {(n[:-len("_count")], labels)
                                          for n, labels in got if n.endswith("_count")}


def test_register_worker_creates_one_workers_series_at_zero():
    # A colocated worker has no KV transfer series: those are labelled by prefill worker.
    from tandem.router.metrics import Metrics

    metrics = Metrics(MODEL)
    metrics.register_worker("colocated-0", "colocated")
    m = samples(metrics.render().decode())
    got = {k: v for k, v in m.items() if not k[0].endswith(("_created", "_bucket"))}
    assert got == startup_series({"colocated-0": "colocated"})


def test_counters_exact_after_real_requests(fresh, tokenizer):
    prompts = ["Hello there", "The sky is", "One two three"]
    prompt_tokens = 0
    for p in prompts:
        resp = fresh.generate(pb.GenerateRequest(prompt=p, stream=True, sampling=pb.SamplingParams(
            max_tokens=5, temperature=0, ignore_eos=True)))
        assert sum(len(r.token_ids) for r in resp) == 5
        prompt_tokens += resp[-1].usage.prompt_tokens
    # One that ends on a stop string taken from its own greedy text.
    base = fresh.generate(pb.GenerateRequest(prompt="A B C D E F", stream=False,
                                             sampling=pb.SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True)))[0]
    stop = base.text[4:8]
    stopped = fresh.generate(pb.GenerateRequest(prompt="A B C D E F", stream=False,
                                                sampling=pb.SamplingParams(
                                                    max_tokens=12, temperature=0, ignore_eos=True,
                                                    stop=[stop])))[0]
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    prompt_tokens += base.usage.prompt_tokens * 2
    gen_tokens = 15 + len(base.token_ids) + len(stopped.token_ids)
    # One the client cancels.
    call = fresh.stub.Generate(pb.GenerateRequest(prompt="Tell me a long story", stream=True,
                                                  sampling=pb.SamplingParams(
                                                      max_tokens=2000, ignore_eos=True)))
    cancel_after(call, 1.0)
    streamed = 0
    with pytest.raises(grpc.RpcError):
        for r in call:
            streamed += len(r.token_ids)
    prompt_tokens += len(tokenizer.encode("Tell me a long story"))
    gen_tokens += streamed
    # Two invalid ones.
    for bad in (pb.GenerateRequest(prompt=""), pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=2))):
        with pytest.raises(grpc.RpcError):
            fresh.generate(bad)
    fresh.wait_idle()
    time.sleep(1.5)          # one more stats round from every worker

    m = samples(fresh.metrics_text())
    assert value(m, "tandem:request_success_total", finished_reason="length") == 4   # 3 + the base
    assert value(m, "tandem:request_success_total", finished_reason="stop") == 1
    assert value(m, "tandem:request_success_total", finished_reason="abort") == 1
    assert value(m, "tandem:request_aborts_total") == 1
    assert value(m, "tandem:invalid_requests_total", field="prompt") == 1
    assert value(m, "tandem:invalid_requests_total", field="sampling") == 1
    assert value(m, "tandem:prompt_tokens_total") == prompt_tokens
    assert value(m, "tandem:generation_tokens_total") == gen_tokens
    for h in ("tandem:e2e_request_latency_seconds", "tandem:request_prompt_tokens",
              "tandem:request_generation_tokens", "tandem:time_to_first_token_seconds"):
        assert value(m, h + "_count") == 6, h
    assert value(m, "tandem:request_generation_tokens_sum") == gen_tokens
    # Every token after a request's first is one inter-token gap (one sample per request here).
    assert value(m, "tandem:inter_token_latency_seconds_count") == gen_tokens - 6
    assert value(m, "tandem:kv_transfer_bytes_total", worker="prefill-0") > 0
    assert value(m, "tandem:kv_transfer_seconds_count", worker="prefill-0") == 6
    # Worker gauges are there for both roles, and idle now.
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert ("tandem:num_requests_running",
                tuple(sorted({"model_name": MODEL, "worker": wid, "role": role}.items()))) in m
        assert value(m, "tandem:num_requests_running", worker=wid, role=role) == 0
        assert value(m, "tandem:kv_cache_usage_perc", worker=wid, role=role) == 0
    assert total(m, "tandem:iteration_tokens_total_count") > 0
    assert total(m, "tandem:prefix_cache_queries_total") > 0


def test_one_structured_log_line_per_request_without_prompt_text(fresh, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="tandem.requests")
    secret = "zebra-quartz-unusual-words"
    resp = fresh.generate(pb.GenerateRequest(prompt=secret, request_id="log-check-1", stream=True,
                                             sampling=pb.SamplingParams(max_tokens=3, temperature=0,
                                                                        ignore_eos=True)))
    assert sum(len(r.token_ids) for r in resp) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.requests"
             and "id=log-check-1" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    for field in ("prompt_tokens=", "output_tokens=3", "cached_tokens=", "ttft_s=", "tpot_s=",
                  "finish_reason=length", "prefill_worker=prefill-0", "decode_worker=decode-0"):
        assert field in line, (field, line)
    assert secret not in line and "zebra" not in caplog.text


def test_a_restarted_worker_counts_from_zero_again():
    # Worker stats carry totals since the worker started; a restarted worker's start
    # again from 0, and its first preemption must still count.
    from tandem.engine.runtime.outputs import StepOutput, WorkerStats
    from tandem.router.metrics import Metrics

    metrics = Metrics(MODEL)
    metrics.register_worker("decode-0", "decode")
    metrics.worker_step(None, StepOutput((), WorkerStats("decode-0", "decode", num_swap_preemptions=3,
                                                         prefix_cache_queries=40)))
    metrics.register_worker("decode-0", "decode")
    metrics.worker_step(None, StepOutput((), WorkerStats("decode-0", "decode", num_swap_preemptions=1,
                                                         prefix_cache_queries=16)))
    m = samples(metrics.render().decode())
    w = dict(worker="decode-0", role="decode")
    assert value(m, "tandem:num_preemptions_total", kind="swap", **w) == 4
    assert value(m, "tandem:num_preemptions_total", kind="recompute", **w) == 0
    assert value(m, "tandem:prefix_cache_queries_total", **w) == 56
