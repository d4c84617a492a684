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


def startup_series(workers: dict[str, str], router: bool = True) -> dict[tuple, float]:
    """Every sample but ``_created`` and ``_bucket`` that a cluster with ``workers``
    (id -> role) exposes before its first request: all of them 0. ``router``: the
    metrics are a running router's (its own in-flight gauge)."""
    from tandem.router.metrics import (ABORT_SOURCES, FINISH_REASONS, PREEMPTION_KINDS,
                                       RATE_LIMIT_REASONS, REQUEST_FIELDS, WORKER_WAIT_OUTCOMES)

    def key(name, **labels):
        return name, tuple(sorted({"model_name": MODEL, **labels}.items()))

    want = [key(f"tandem:{n}_total") for n in ("prompt_tokens", "generation_tokens")]
    want += [key("tandem:request_aborts_total", source=s) for s in ABORT_SOURCES]
    want += [key("tandem:request_success_total", finished_reason=r) for r in FINISH_REASONS]
    want += [key("tandem:invalid_requests_total", field=f) for f in REQUEST_FIELDS]
    want += [key("tandem:requests_rate_limited_total", reason=r) for r in RATE_LIMIT_REASONS]
    want += [key("tandem:request_worker_waits_total", outcome=o) for o in WORKER_WAIT_OUTCOMES]
    want += [key("tandem:requests_waiting_for_worker"), key("tandem:local_prefills_total")]
    if router:
        want += [key("tandem:router_active_requests")]
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
              "request_worker_wait_seconds"):
        want += [key(f"tandem:{h}_count"), key(f"tandem:{h}_sum")]
    for wid, role in workers.items():
        w = dict(worker=wid, role=role)
        want += [key(f"tandem:{g}", **w) for g in ("num_requests_running", "num_requests_waiting",
                                                   "num_requests_swapped", "kv_cache_usage_perc")]
        want += [key("tandem:num_preemptions_total", kind=k, **w) for k in PREEMPTION_KINDS]
        want += [key(f"tandem:prefix_cache_{n}_total", **w) for n in ("queries", "hits")]
        want += [key(f"tandem:{h}_{n}", **w) for n in ("count", "sum") for h in (
            "iteration_tokens_total", "engine_step_seconds", "step_delivery_seconds")]
        want += [key(f"tandem:structured_output_{n}_total", **w) for n in (
            "compiles", "cache_hits", "compile_seconds")]
        want += [key("tandem:worker_restarts_total", worker=wid)]
        if role == "prefill":
            want += [key(f"tandem:kv_transfer_{n}", worker=wid) for n in (
                "bytes_total", "failures_total", "seconds_count", "seconds_sum")]
        else:
            want += [key("tandem:request_migrations_total", worker=wid)]
            want += [key(f"tandem:spec_decode_{n}_total", **w) for n in (
                "num_drafts", "num_draft_tokens", "num_accepted_tokens")]
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
    assert got == startup_series({"colocated-0": "colocated"}, router=False)


def test_counters_exact_after_real_requests(fresh, tokenizer, caplog):
    import logging
    import re

    caplog.set_level(logging.INFO, logger="tandem.requests")
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
                                                  request_id="counters-cancelled",
                                                  sampling=pb.SamplingParams(
                                                      max_tokens=2000, ignore_eos=True)))
    cancel_after(call, 1.0)
    streamed = 0
    with pytest.raises(grpc.RpcError):
        for r in call:
            streamed += len(r.token_ids)
    prompt_tokens += len(tokenizer.encode("Tell me a long story"))
    # The router may have sent a token or two the client never read before it cancelled
    # (in flight): the router's own count of the request's tokens is in its log line.
    fresh.wait_idle()
    line = next(r.getMessage() for r in caplog.records if r.name == "tandem.requests"
                and "id=counters-cancelled " in r.getMessage())
    sent = int(re.search(r"output_tokens=(\d+)", line).group(1))
    assert streamed <= sent <= streamed + 3, (streamed, line)
    assert "finish_reason=abort" in line
    gen_tokens += sent
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
    assert value(m, "tandem:request_aborts_total", source="grpc_cancel") == 1
    assert total(m, "tandem:request_aborts_total") == 1
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
    # Tokens run per step count prompt tokens too: the prefill worker ran every prompt
    # token its prefix cache did not hold, and sampled one token per prompt.
    pre = dict(worker="prefill-0", role="prefill")
    assert value(m, "tandem:iteration_tokens_total_sum", **pre) == \
        prompt_tokens - value(m, "tandem:prefix_cache_hits_total", **pre)
    assert total(m, "tandem:prefix_cache_queries_total") > 0
    # The request timeline's step side: each worker step that ran tokens is timed, and
    # every published step's delivery to the router too (idle stats are not steps).
    dec = dict(worker="decode-0", role="decode")
    steps = value(m, "tandem:engine_step_seconds_count", **dec)
    assert steps >= len(base.token_ids) - 1      # one decode step per token after the first
    assert value(m, "tandem:step_delivery_seconds_count", **dec) >= steps
    assert value(m, "tandem:engine_step_seconds_sum", **dec) > 0
    assert value(m, "tandem:engine_step_seconds_count", worker="prefill-0", role="prefill") >= 6


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


def _worker_series(m: dict, worker_id: str) -> dict[tuple, float]:
    return {k: v for k, v in m.items() if ("worker", worker_id) in k[1]
            and not k[0].endswith(("_created", "_bucket"))}


def test_a_dead_workers_series_go_and_its_replacements_start_at_zero():
    # The exposition follows the registry: a dead worker's gauges must not keep their
    # last values; its failure counters stay until it is removed for good.
    from tandem.engine.runtime.outputs import StepOutput, WorkerStats
    from tandem.router.metrics import Metrics
    from tandem.router.registry import InProcessRegistry, WorkerHandle

    registry = InProcessRegistry([WorkerHandle("prefill-0", "prefill", None),
                                  WorkerHandle("decode-0", "decode", None)])
    metrics = Metrics(MODEL)
    metrics.follow(registry)
    busy = WorkerStats("decode-0", "decode", num_running=3, num_waiting=2, kv_cache_usage=0.75,
                       num_swap_preemptions=2, prefix_cache_queries=40,
                       spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                       spec_decode_num_accepted_tokens=5,
                       spec_decode_num_accepted_tokens_per_pos=(3, 2, 0))
    metrics.worker_step(None, StepOutput((), busy))
    metrics.request_migrated("decode-0")
    metrics.worker_restarted("decode-0")
    metrics.kv_transfer_failed("prefill-0")
    d = dict(worker="decode-0", role="decode")
    assert value(samples(metrics.render().decode()), "tandem:kv_cache_usage_perc", **d) == 0.75
    busy_m = samples(metrics.render().decode())
    assert [value(busy_m, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(p),
                  **d) for p in range(3)] == [3, 2, 0]
    assert value(busy_m, "tandem:spec_decode_num_draft_tokens_total", **d) == 9

    registry.mark_dead("decode-0")
    metrics.worker_step(None, StepOutput((), busy))      # the dead incarnation's last words
    metrics.request_migrated("decode-0")                 # its requests move on
    m = samples(metrics.render().decode())
    of_decode = (("model_name", MODEL), ("worker", "decode-0"))
    fate = {("tandem:request_migrations_total", of_decode): 2.0,
            ("tandem:worker_restarts_total", of_decode): 1.0}
    assert _worker_series(m, "decode-0") == fate
    assert _worker_series(m, "prefill-0") == {                     # untouched
        **_worker_series(startup_series({"prefill-0": "prefill"}), "prefill-0"),
        ("tandem:kv_transfer_failures_total", (("model_name", MODEL), ("worker", "prefill-0"))):
            1.0}

    registry.add(WorkerHandle("decode-0", "decode", None, generation=2))   # the replacement
    m = samples(metrics.render().decode())
    assert _worker_series(m, "decode-0") == {
        **_worker_series(startup_series({"decode-0": "decode"}), "decode-0"), **fate}
    again = WorkerStats("decode-0", "decode", num_swap_preemptions=1)
    metrics.worker_step(None, StepOutput((), again))
    m = samples(metrics.render().decode())
    assert value(m, "tandem:num_preemptions_total", kind="swap", **d) == 1

    registry.remove("prefill-0")                         # scale-down: every series goes
    metrics.kv_transfer_failed("prefill-0")
    m = samples(metrics.render().decode())
    assert _worker_series(m, "prefill-0") == {}
    assert _worker_series(m, "decode-0") != {}


def test_cancel_storm_counts_every_cancel_exactly_once(fresh):
    """Streams cancelled at every stage through real gRPC: before the router read the
    request (a call that sent only its headers), as soon as the router has it (adding
    it to the decode worker, prefill, KV transfer: before its first token),
    mid-stream, plus streams that complete and streams the client cancels only after
    their last token (finished: never an abort). Each cancel counts exactly once,
    with ``source="grpc_cancel"``, and in ``request_success{finished_reason="abort"}``;
    no block leaks."""
    import threading

    srv = fresh.server.server
    grpc.channel_ready_future(fresh.channel).result(timeout=30)
    fresh.wait_idle()
    before = samples(fresh.metrics_text())

    def req(prompt: str, n: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt=prompt, stream=True, sampling=pb.SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True))

    def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.002)

    # 1. Calls whose request message never comes: the router only saw their headers.
    raw = fresh.channel.stream_stream("/tandem.v1.Tandem/Generate",
                                      request_serializer=pb.GenerateRequest.SerializeToString,
                                      response_deserializer=pb.GenerateResponse.FromString)
    release = threading.Event()

    def nothing():
        release.wait(60)
        return
        yield

    unread = [raw(nothing()) for _ in range(3)]
    # 2. Cancelled as soon as the router has them, one at a time (a long prompt for some).
    long_prompt = " ".join(f"w{i}" for i in range(200))
    for i in range(4):
        call = fresh.stub.Generate(req(long_prompt if i % 2 else f"Story {i}:", 500))
        wait_for(lambda: srv.cluster.num_active == 1, "the router to take the request")
        call.cancel()
        wait_for(lambda: srv.cluster.num_active == 0, "the router to drop the request")
        with pytest.raises(grpc.RpcError):
            list(call)
    # 3. Mid-stream (after 1, 2 or 3 tokens), alongside streams that complete and
    # streams cancelled right after their last token.
    def stream(prompt: str, n: int, cancel_after_tokens: int | None) -> str:
        call = fresh.stub.Generate(req(prompt, n))
        got = 0
        try:
            for r in call:
                got += len(r.token_ids)
                if cancel_after_tokens is not None and got >= cancel_after_tokens:
                    call.cancel()
                if r.finish_reason and cancel_after_tokens is None:
                    call.cancel()                            # finished: too late to abort
        except grpc.RpcError as exc:
            return "cancelled" if exc.code() == grpc.StatusCode.CANCELLED else str(exc.code())
        return "ok"

    plan = [(f"Count to ten, take {i}:", 500, 1 + i % 3) for i in range(6)]
    plan += [("Hello there", 4, 10**6), ("The sky is", 4, 10**6)]      # complete
    plan += [("One two three", 3, None), ("A B C", 3, None)]          # cancelled once finished
    results: list = [None] * len(plan)

    def run(i: int) -> None:
        results[i] = stream(*plan[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[:6] == ["cancelled"] * 6 and results[6:8] == ["ok"] * 2, results
    # The completed streams went over the same connection after the header-only calls:
    # the router has seen those; now their clients give up.
    for call in unread:
        call.cancel()
    release.set()

    cancelled = 3 + 4 + 6
    counts = fresh.wait_idle()
    for wid, c in counts.items():
        assert c["num_free_blocks"] == c["num_blocks"] and c.get("num_reserved", 0) == 0, (wid, c)
    assert srv.cluster.num_active == 0

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    deadline = time.monotonic() + 10
    while True:
        after = samples(fresh.metrics_text())
        if delta("tandem:request_aborts_total", source="grpc_cancel") >= cancelled \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta("tandem:request_aborts_total", source="grpc_cancel") == cancelled
    assert total(after, "tandem:request_aborts_total") \
        - total(before, "tandem:request_aborts_total") == cancelled
    assert delta("tandem:request_success_total", finished_reason="abort") == cancelled
    assert delta("tandem:request_success_total", finished_reason="length") == 4
    assert delta("tandem:request_success_total", finished_reason="error") == 0
    # Every request the router read ended once (the header-only calls were never requests).
    assert delta("tandem:e2e_request_latency_seconds_count") == cancelled - 3 + 4
