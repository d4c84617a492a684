"""Faults in the default deployment: one prefill and one decode worker, so a
request whose decode worker dies has no other to migrate to.

Such requests wait for the supervisor's replacement (``worker_wait_timeout_s``)
and resume there as a migration does: the same tokens as the no-failure run, no
gap, no duplicate; only past the bound do they end with ``UNAVAILABLE``. One
disaggregated cluster (1 + 1 Ray actors, embedded redis-server, supervision on,
float32) serves the module's tests in order. Recovery times are printed (``-s``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import grpc
import pytest

from tests.serving.conftest import greedy, serve_config, serving
from tests.serving.test_fault_tolerance import Stream, _assert_idle, _back_to_size, _handle, _wait

N = 32
PROMPTS = ["Write a short story about a dragon.", "Explain how a bicycle works.",
           "List five facts about the Moon.", "Describe a busy market in the morning.",
           "What is the capital of France?", "Give me three tips for writing clean code.",
           "Why is the sky blue?", "Name four animals that live in the sea."]
WAITS = 'tandem:request_worker_waits_total{model_name="SmolLM2-135M-Instruct",outcome="%s"}'


def _requests():
    """16 streams: every prompt greedy twice (the second hits the prefix cache), but
    one of them seeded with n = 2 and one asking for prompt logprobs (both prefill
    on the decode worker), so the resumed requests cover those paths too.

    The seeded request resumes exactly because n-gram speculation (on in this
    cluster) takes one uniform per token, as plain sampling does
    (``Sampler.verify``), so the resumed sample's skip of one uniform per emitted
    token puts its generator where the lost worker's was. The seed keeps its draws
    away from ties: a resumed sample recomputes its tokens' KV in another batch, so
    its float32 logits differ in the last bits; seed 4's closest draw is 5.9e-4 of
    the mass from a boundary of the cumulative distribution (seed 7 had one at
    3.3e-6)."""
    from tandem.v1 import tandem_pb2 as pb

    reqs = [greedy(p, N) for p in PROMPTS + PROMPTS]
    reqs[-1] = pb.GenerateRequest(prompt=PROMPTS[-1], stream=True, sampling=pb.SamplingParams(
        max_tokens=N, temperature=0.8, seed=4, n=2, ignore_eos=True))
    reqs[-2].sampling.prompt_logprobs = 1
    return reqs


def _streams(cluster) -> list[Stream]:
    return [Stream(cluster.server.address, r.prompt, N, request=r) for r in _requests()]


def _join_unchanged(streams: list[Stream], baseline) -> None:
    """Wait for every stream; each must end OK with its no-failure tokens, sample by
    sample (no gap, no duplicate)."""
    for s in streams:
        s.join(300)
    for i, s in enumerate(streams):
        assert s.code == grpc.StatusCode.OK, (i, s.code, getattr(s, "details", ""))
        assert s.by_index == baseline[i], i


def _metric(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def cluster(ray_session):
    """n-gram speculation is on (3 draft tokens), so the resumed requests also carry
    speculative decoding across the replacement."""
    from tandem.engine.config import SpeculativeConfig

    config = serve_config("disaggregated", transfer_timeout_s=8.0)
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)))
    yield from serving(config)


@pytest.fixture(scope="module")
def baseline(cluster) -> list[dict[int, list[int]]]:
    """Each stream's tokens per sample index, with no failure."""
    streams = _streams(cluster)
    for s in streams:
        s.join(300)
    assert all(s.code == grpc.StatusCode.OK for s in streams), [s.code for s in streams]
    assert [sorted(s.by_index) for s in streams] == [[0]] * 15 + [[0, 1]]
    assert all(len(toks) == N for s in streams for toks in s.by_index.values())
    return [s.by_index for s in streams]


def test_kill_the_only_decode_worker_requests_wait_and_resume(cluster, baseline):
    srv = cluster.server.server
    waits_before = _metric(cluster.metrics_text(), WAITS % "resumed")
    streams = _streams(cluster)
    _wait(lambda: all(len(s.tokens) >= 4 for s in streams), 180, "every stream to start")
    victim = _handle(cluster, "decode-0")
    t_kill = time.monotonic()
    os.kill(victim.info["pid"], signal.SIGKILL)
    _join_unchanged(streams, baseline)
    stall = max(s.max_gap_after(t_kill) for s in streams)
    recovery = _back_to_size(cluster, "decode-0", victim.generation)
    done = max(s.times[-1] for s in streams) - t_kill
    print(f"\nonly decode worker killed: replacement in service after {recovery:.1f} s, "
          f"longest client-visible stall {stall:.1f} s, all 16 streams done {done:.1f} s "
          "after the kill")
    text = cluster.metrics_text()
    assert _metric(text, WAITS % "resumed") >= waits_before + 1
    assert _metric(text, 'tandem:requests_waiting_for_worker{model_name="SmolLM2-135M-Instruct"}') == 0
    assert _metric(text, WAITS % "timed_out") == 0
    assert srv.supervisor.recoveries[-1].worker_id == "decode-0"
    # The replacement's counters start at zero and only the resumed requests ran on
    # it: they were decoded with speculation there too.
    drafts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("tandem:spec_decode_num_drafts_total{")
              and 'worker="decode-0"' in line]
    assert drafts and drafts[0] > 0, drafts
    _assert_idle(cluster)


def test_kill_the_only_prefill_worker(cluster, baseline):
    """kill -9 the prefill worker while the 16 prompts are being prefilled and their
    KV streamed: the decode worker prefills what it lost, every stream ends with the
    no-failure tokens, and the prefill pool is back to size."""
    victim = _handle(cluster, "prefill-0")
    streams = _streams(cluster)
    time.sleep(0.3)                      # prompts are being prefilled and streamed
    t_kill = time.monotonic()
    os.kill(victim.info["pid"], signal.SIGKILL)
    _join_unchanged(streams, baseline)
    done = max(s.times[-1] for s in streams) - t_kill
    recovery = _back_to_size(cluster, "prefill-0", victim.generation)
    print(f"\nonly prefill worker killed: all 16 streams done {done:.1f} s after the kill, "
          f"replacement in service after {recovery:.1f} s")
    _assert_idle(cluster)


def test_sigstop_the_prefill_worker_until_it_is_replaced(cluster, baseline):
    """The prefill worker stops mid-transfer (SIGSTOP) and stays stopped until the
    supervisor has replaced it: it makes no progress, so after the prefill timeout
    (9 s) the decode worker prefills the waiting prompts itself, and every stream
    ends with the no-failure tokens. Its lease lapses meanwhile (10 s), so the
    supervisor replaces it and kills the stopped process; were it continued first,
    what it sent would land nowhere (fenced)."""
    prefill = _handle(cluster, "prefill-0")
    streams = _streams(cluster)
    time.sleep(0.3)                      # prompts are being prefilled and streamed
    t_stop = time.monotonic()
    os.kill(prefill.info["pid"], signal.SIGSTOP)
    try:
        _wait(lambda: all(s.tokens for s in streams), 60, "every stream's first token")
        first = max(s.times[0] for s in streams) - t_stop
        _wait(lambda: (lambda w: w.alive and w.generation > prefill.generation)(
            _handle(cluster, "prefill-0")), 120, "the stopped prefill worker's replacement")
        replaced = time.monotonic() - t_stop
    finally:
        try:
            os.kill(prefill.info["pid"], signal.SIGCONT)
        except ProcessLookupError:     # its lease lapsed: replaced, the stopped one killed
            pass
    _join_unchanged(streams, baseline)
    done = max(s.times[-1] for s in streams) - t_stop
    print(f"\nprefill worker stopped: every stream's first token {first:.1f} s, all 16 done "
          f"{done:.1f} s, a replacement in service {replaced:.1f} s after the stop")
    _assert_idle(cluster)


def test_a_failing_output_pump_loses_no_request(cluster, baseline):
    """An exception in the router's own per-step code (here: the step callback that
    feeds the metrics) kills the decode worker's output pump. Its requests must not
    wait on queues nothing feeds: the worker counts as lost, is replaced, and the
    requests resume there with the no-failure tokens."""
    srv = cluster.server.server
    on_step, armed = srv.cluster.on_step, []

    def failing_once(w, step):
        if armed and w.worker_id == "decode-0" and step.deltas:
            armed.clear()
            raise RuntimeError("injected: a bug in the router's step callback")
        on_step(w, step)

    srv.cluster.on_step = failing_once
    try:
        old_gen = _handle(cluster, "decode-0").generation
        streams = [Stream(cluster.server.address, p, N) for p in PROMPTS[:4]]
        _wait(lambda: all(len(s.tokens) >= 2 for s in streams), 120, "the streams to start")
        armed.append(True)
        for s in streams:
            s.join(300)
    finally:
        srv.cluster.on_step = on_step
    assert not armed, "the injected failure never fired"
    for i, s in enumerate(streams):
        assert s.code == grpc.StatusCode.OK, (i, s.code, getattr(s, "details", ""))
        assert s.tokens == baseline[i][0], i
    _back_to_size(cluster, "decode-0", old_gen)
    _assert_idle(cluster)


def test_the_wait_is_bounded(cluster, baseline):
    """Without a replacement, waiting requests end with UNAVAILABLE at the bound,
    naming the worker and the bound; the cluster serves again once one comes."""
    srv = cluster.server.server
    cluster.server.run(srv.supervisor.stop())
    srv.orchestrator.worker_wait_timeout_s = 1.5
    try:
        streams = [Stream(cluster.server.address, p, N) for p in PROMPTS[:2]]
        _wait(lambda: all(len(s.tokens) >= 2 for s in streams), 120, "the streams to start")
        victim = _handle(cluster, "decode-0")
        os.kill(victim.info["pid"], signal.SIGKILL)
        for s in streams:
            s.join(120)
        for s in streams:
            assert s.code == grpc.StatusCode.UNAVAILABLE, s.code
            assert s.details == ("the request's decode worker decode-0 failed and no decode "
                                 "worker took it over within 1.5 s"), s.details
        assert _metric(cluster.metrics_text(), WAITS % "timed_out") == 2
    finally:
        srv.orchestrator.worker_wait_timeout_s = srv.config.worker_wait_timeout_s
        cluster.server.loop.call_soon_threadsafe(srv.supervisor.start)   # replaces the dead one
    _back_to_size(cluster, "decode-0", victim.generation)
    assert [t for r in cluster.generate(greedy(PROMPTS[0], N)) for t in r.token_ids] \
        == baseline[0][0]
    _assert_idle(cluster)


def test_prompts_queued_at_a_busy_prefill_worker_are_prefilled_once(cluster, baseline):
    """A burst of long prompts queues at the prefill worker for longer than the KV
    transfer timeout (8 s here). The prefill worker makes progress all along, so
    nothing counts as stalled: every prompt is prefilled there exactly once and its
    KV transferred, none falls back to a second prefill on the decode worker."""
    import random

    from tandem.v1 import tandem_pb2 as pb

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(1500)] for _ in range(6)]
    failures = 'tandem:kv_transfer_failures_total{model_name="SmolLM2-135M-Instruct",worker="prefill-0"}'
    failures_before = _metric(cluster.metrics_text(), failures)
    bytes_before = cluster.block_counts()["prefill-0"]["kv_transfer_bytes"]
    t0 = time.monotonic()
    streams = [Stream(cluster.server.address, "", 4, request=pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), stream=True,
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        for ids in prompts]
    for s in streams:
        s.join(300)
    first = sorted(s.times[0] - t0 for s in streams)
    print(f"\nburst of 6 x 1500-token prompts: first tokens after "
          f"{', '.join(f'{t:.1f}' for t in first)} s (transfer timeout 8 s)")
    assert [s.code for s in streams] == [grpc.StatusCode.OK] * 6
    assert all(len(s.tokens) == 4 for s in streams)
    assert first[-1] > 9.0, "the burst did not queue past the timeout: nothing was tested"
    assert _metric(cluster.metrics_text(), failures) == failures_before
    sent = cluster.block_counts()["prefill-0"]["kv_transfer_bytes"] - bytes_before
    layout = _handle(cluster, "decode-0").info["kv_layout"]
    per_token = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"] * 4
    assert sent >= 6 * 1488 * per_token        # every prompt's full blocks came from prefill-0
    _assert_idle(cluster)


def test_a_beam_search_outlives_its_decode_worker(cluster, baseline):
    """A beam search runs whole inside its decode worker and returns its beams at the
    end, so a kill -9 mid-search loses nothing the client saw: the search waits for
    the replacement and runs again there, giving the no-failure beams (float32)."""
    import threading

    from tandem.v1 import tandem_pb2 as pb

    request = pb.GenerateRequest(prompt=PROMPTS[0], sampling=pb.SamplingParams(
        n=4, max_tokens=32, use_beam_search=True, length_penalty=0.5, ignore_eos=True))

    def beams(responses) -> dict[int, list[int]]:
        return {r.index: list(r.token_ids) for r in responses}

    want = beams(cluster.generate(request))
    assert sorted(want) == [0, 1, 2, 3] and all(len(b) == 32 for b in want.values())
    waits_before = _metric(cluster.metrics_text(), WAITS % "resumed")
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(got=cluster.generate(request, 300)))
    call.start()
    _wait(lambda: cluster.block_counts()["decode-0"]["num_running"] > 0, 60,
          "the search to run")
    victim = _handle(cluster, "decode-0")
    os.kill(victim.info["pid"], signal.SIGKILL)
    assert call.is_alive(), "the search ended before the kill: nothing was tested"
    call.join(300)
    assert beams(result["got"]) == want
    assert _metric(cluster.metrics_text(), WAITS % "resumed") >= waits_before + 1
    _back_to_size(cluster, "decode-0", victim.generation)
    _assert_idle(cluster)
