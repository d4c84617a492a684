"""Fault tests on real processes under load: kill -9 a decode actor, a prefill actor, a
router; restart redis-server; two routers under a burst.

One disaggregated cluster (1 prefill + 2 decode Ray actors, an embedded
redis-server, supervision on) serves every test in order. Every request either
completes with exactly the tokens of the no-failure run or, for a killed
router's own clients, ends with a clean gRPC status; each test ends with the
pools back to size and block counts idle on every live worker. Recovery times
are printed (``-s``) and recorded in benchmarks/README.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tests.serving.conftest import Client, greedy, serve_config, start_server

PROMPTS = ["Write a short story about a dragon.", "Explain how a bicycle works.",
           "List five facts about the Moon.", "Describe a busy market in the morning."]
N = 24


@pytest.fixture(scope="module")
def cluster(ray_session):
    server = start_server(serve_config("disaggregated", num_decode=2, transfer_timeout_s=3.0))
    client = Client(server)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def baseline(cluster) -> dict[str, list[int]]:
    """Each prompt's greedy tokens with no failure."""
    streams = [Stream(cluster.server.address, p) for p in PROMPTS]
    for s in streams:
        s.join(300)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == N for s in streams)
    return {s.prompt: s.tokens for s in streams}


def _ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


class Stream(threading.Thread):
    """A streaming request on its own thread: tokens, arrival times, final status."""

    def __init__(self, address: str, prompt: str, n: int = N, request=None):
        super().__init__(daemon=True)
        self.address, self.prompt, self.n = address, prompt, n
        self.request = request if request is not None else greedy(prompt, n)
        self.tokens: list[int] = []
        self.by_index: dict[int, list[int]] = {}     # sample index -> its tokens
        self.times: list[float] = []
        self.code = None
        self.finish = None
        self.start()

    def run(self) -> None:
        from tandem.v1 import tandem_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.address) as ch:
            try:
                for r in pb_grpc.TandemStub(ch).Generate(self.request, timeout=300):
                    self.tokens.extend(r.token_ids)
                    self.by_index.setdefault(r.index, []).extend(r.token_ids)
                    self.times.extend([time.monotonic()] * len(r.token_ids))
                    if r.finish_reason:
                        self.finish = r.finish_reason
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code = exc.code()
                self.details = exc.details()

    def max_gap_after(self, t: float) -> float:
        """The longest wait between tokens that spans ``t`` (seconds)."""
        before = [x for x in self.times if x <= t]
        after = [x for x in self.times if x > t]
        return (after[0] - before[-1]) if before and after else 0.0


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _handle(cluster, worker_id: str):
    return cluster.server.server.registry.get(worker_id)


def _back_to_size(cluster, worker_id: str, old_generation: int, timeout_s: float = 180):
    """Wait until ``worker_id`` is back in service with a newer generation; the seconds
    the supervisor took."""
    srv = cluster.server.server
    rec = _wait(lambda: next((r for r in srv.supervisor.recoveries if r.worker_id == worker_id
                              and _handle(cluster, worker_id).generation > old_generation), None),
                timeout_s, f"{worker_id} to be replaced")
    w = _handle(cluster, worker_id)
    assert w.alive and w.generation > old_generation
    return rec.seconds


def _assert_idle(cluster) -> None:
    counts = cluster.wait_idle(30)
    for wid, c in counts.items():
        assert c["num_running"] == c["num_waiting"] == c.get("num_reserved", 0) == 0, (wid, c)
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)


def _health(cluster) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2_grpc.HealthStub(cluster.channel).Check(
        health_pb2.HealthCheckRequest(service="")).status


def test_kill_decode_actor_requests_migrate_unchanged(cluster, baseline):
    srv = cluster.server.server
    # The exposition at the moment the router sees decode-0 go (listeners run in order:
    # the metrics' own first), before the supervisor replaces it.
    at_death: list[str] = []
    srv.registry.add_worker_down_listener(
        lambda wid: at_death.append(srv.metrics.render().decode())
        if wid == "decode-0" and not at_death else None)
    streams = [Stream(cluster.server.address, p) for p in PROMPTS]
    _wait(lambda: all(len(s.tokens) >= 4 for s in streams), 120, "every stream to start")
    victim = _handle(cluster, "decode-0")
    old_gen = victim.generation
    t_kill = time.monotonic()
    os.kill(victim.info["pid"], signal.SIGKILL)
    for s in streams:
        s.join(300)
    for s in streams:
        assert s.code == grpc.StatusCode.OK, (s.prompt, s.code)
        assert s.tokens == baseline[s.prompt], s.prompt       # no gap, no duplicate, same tokens
    gap = max(s.max_gap_after(t_kill) for s in streams)
    recovery = _back_to_size(cluster, "decode-0", old_gen)
    print(f"\ndecode kill: longest client-visible stall {gap:.2f} s; pool back to size "
          f"in {recovery:.1f} s")
    text = cluster.metrics_text()
    assert 'tandem:request_migrations_total{model_name="SmolLM2-135M-Instruct",worker="decode-0"}' \
        in text
    # Dead, its series were gone (its gauges kept no last value) but for its failure
    # counters; replaced, they are back.
    dead = [line.split("{")[0] for line in at_death[0].splitlines()
            if 'worker="decode-0"' in line and not line.startswith("#")]
    assert dead and set(dead) <= {"tandem:request_migrations_total",
                                  "tandem:request_migrations_created",
                                  "tandem:worker_restarts_total",
                                  "tandem:worker_restarts_created"}, dead
    assert 'tandem:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct",role="decode",' \
           'worker="decode-0"}' in text
    assert 'tandem:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct",role="decode",' \
           'worker="decode-1"}' in at_death[0]
    _assert_idle(cluster)
    assert _ids(cluster.generate(greedy(PROMPTS[0], N))) == baseline[PROMPTS[0]]


def test_kill_prefill_actor_degrades_then_recovers(cluster, baseline):
    from grpc_health.v1 import health_pb2

    srv = cluster.server.server
    victims = [_handle(cluster, "prefill-0")]
    streams = [Stream(cluster.server.address, p) for p in PROMPTS]
    time.sleep(0.3)                   # prompts are being prefilled and their KV streamed
    for v in victims:                 # the whole prefill pool
        os.kill(v.info["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    # While the prefill pool is empty requests are served (the decode workers prefill
    # for themselves), so health stays SERVING: NOT_SERVING means refused requests.
    _wait(lambda: not any(_handle(cluster, v.worker_id).alive for v in victims), 30,
          "the prefill workers to be seen dead")
    if srv.supervisor.restarting:
        assert _health(cluster) == health_pb2.HealthCheckResponse.SERVING
        assert _ids(cluster.generate(greedy(PROMPTS[1], N))) == baseline[PROMPTS[1]]
    for s in streams:
        s.join(300)
    for s in streams:
        assert s.code == grpc.StatusCode.OK, (s.prompt, s.code)
        assert s.tokens == baseline[s.prompt], s.prompt
    recovery = max(_back_to_size(cluster, v.worker_id, v.generation) for v in victims)
    print(f"\nprefill kill: pool back to size in {recovery:.1f} s "
          f"({time.monotonic() - t_kill:.1f} s after the kill)")
    _wait(lambda: _health(cluster) == health_pb2.HealthCheckResponse.SERVING, 30, "SERVING")
    before = sum(cluster.block_counts()[v.worker_id]["kv_transfer_bytes"] for v in victims)
    assert _ids(cluster.generate(greedy(PROMPTS[2], N))) == baseline[PROMPTS[2]]
    after = sum(cluster.block_counts()[v.worker_id]["kv_transfer_bytes"] for v in victims)
    assert after > before                                       # disaggregated again
    _assert_idle(cluster)


def test_zombie_prefill_writes_nothing_after_its_transfer_was_given_up(cluster, baseline):
    """SIGSTOP the prefill worker while a long prompt's KV streams (layers go out as the
    forward pass computes them); the decode side's load times out and frees the
    reserved blocks, the router has the decode worker prefill the prompt itself, and
    other requests take blocks meanwhile (prefilled on the decode workers once their
    remote prefill times out too). SIGCONT: no output changes; late layers that still
    arrive are dropped (counted on the decode side; printed, since whether any arrive
    is a race). (tests/test_kv_fencing.py pins the exact reuse of the very blocks, and
    the drop of late layers, in one process.)"""
    srv = cluster.server.server
    long_prompt = " ".join(f"item{i}" for i in range(700))      # ~2.7k tokens
    ref = _ids(cluster.generate(greedy(long_prompt, 8)))
    decode = [w.worker_id for w in srv.registry.workers("decode")]
    prefill = [_handle(cluster, "prefill-0")]

    def decode_counts() -> list[dict]:       # never through a busy prefill worker's loop
        return [cluster.server.run(_handle(cluster, d).actor.check_invariants.remote())
                for d in decode]
    dropped = sum(c["kv_layers_dropped"] for c in decode_counts())
    a = Stream(cluster.server.address, long_prompt, 8)
    _wait(lambda: any(c["num_reserved"] for c in decode_counts()), 60,
          "the long prompt's reservation")
    time.sleep(0.4)                                             # mid-forward, mid-transfer
    for p in prefill:
        os.kill(p.info["pid"], signal.SIGSTOP)
    try:
        time.sleep(3.5)                                         # past the transfer timeout
        others = [Stream(cluster.server.address, p) for p in PROMPTS]
        time.sleep(1.5)
    finally:
        for p in prefill:
            os.kill(p.info["pid"], signal.SIGCONT)
    for s in [a, *others]:
        s.join(300)
    assert a.code == grpc.StatusCode.OK and a.tokens == ref
    for s in others:
        assert s.code == grpc.StatusCode.OK and s.tokens == baseline[s.prompt], s.prompt
    # Whether the zombie's remaining layers arrive at all is a race: the decode side's
    # receive of the next layer may time out while the sender is stopped, breaking the
    # pair first (then nothing more arrives). Either way nothing reached the cache:
    # the outputs above are unchanged, and tests/test_kv_fencing.py pins the drop of
    # late layers exactly, in one process.
    deadline, late = time.monotonic() + 5, 0       # reported, not asserted: a short look
    while time.monotonic() < deadline and not late:
        late = sum(c["kv_layers_dropped"] for c in decode_counts()) - dropped
        time.sleep(0.5)
    print(f"\nzombie prefill: {late} late KV layers dropped on the decode side")
    # The stopped worker kept its lease (stopped < TTL): still in service, same generation.
    assert all(_handle(cluster, p.worker_id).generation == p.generation for p in prefill)
    _assert_idle(cluster)


def test_redis_restart_loses_no_worker_and_no_request(cluster, baseline):
    srv = cluster.server.server
    gens = {w.worker_id: w.generation for w in srv.registry.workers()}
    restarts = len(srv.supervisor.recoveries)
    streams = [Stream(cluster.server.address, p) for p in PROMPTS]
    _wait(lambda: all(len(s.tokens) >= 2 for s in streams), 120, "every stream to start")
    t0 = time.monotonic()
    srv.redis.restart()
    for s in streams:
        s.join(300)
    for s in streams:
        assert s.code == grpc.StatusCode.OK, (s.prompt, s.code)
        assert s.tokens == baseline[s.prompt], s.prompt
    # Every worker re-asserts its record with the same generation; none was purged.
    records = _wait(lambda: (lambda rs: rs if len(rs) == 3 and all(r.alive for r in rs) else None)(
        srv.state.workers()), 30, "the workers to re-register")
    print(f"\nredis restart: every worker re-registered {time.monotonic() - t0:.1f} s after")
    assert {r.worker_id: r.generation for r in records} == gens
    assert all(w.alive for w in srv.registry.workers())
    assert len(srv.supervisor.recoveries) == restarts
    assert _ids(cluster.generate(greedy(PROMPTS[3], N))) == baseline[PROMPTS[3]]
    _assert_idle(cluster)


@pytest.fixture(scope="module")
def router2(cluster):
    """A second router (``tandem router``) in its own process over the same workers."""
    srv = cluster.server.server
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.router.cli", "router", "--redis-url", srv.redis.url,
         "--port", "0", "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines = []
    deadline = time.monotonic() + 120
    address = None
    while address is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(lines)
        lines.append(line)
        m = re.search(r"tandem: router \S+ on (\S+):(\d+)", line)
        if m:
            address = f"{m.group(1)}:{m.group(2)}"
        assert time.monotonic() < deadline, "".join(lines)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    yield proc, address
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_two_routers_burst_stays_balanced(cluster, router2, baseline):
    from tandem.control.reservations import RedisReservations

    srv = cluster.server.server
    _, address2 = router2
    reservations = RedisReservations(srv.state)
    ids = ["decode-0", "decode-1"]
    prompts = [f"{p} Part {i}." for i in range(4) for p in PROMPTS[:2]]      # 8 per router
    streams = [Stream(a, p, 24) for p in prompts for a in (cluster.server.address, address2)]
    peak = {}

    def all_admitted():
        counts = reservations.inflight("decode", ids)
        if sum(counts.values()) > sum(peak.values()):
            peak.clear()
            peak.update(counts)
        return sum(counts.values()) == len(streams)
    _wait(all_admitted, 60, "every request to be reserved")
    print(f"\ntwo routers, burst of {len(streams)}: in-flight per decode worker {peak}")
    assert max(peak.values()) - min(peak.values()) <= 2, peak
    for s in streams:
        s.join(300)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 24 for s in streams)
    # Both routers' streams of one prompt agree (greedy).
    by_prompt = {}
    for s in streams:
        by_prompt.setdefault(s.prompt, []).append(s.tokens)
    assert all(a == b for a, b in by_prompt.values())
    _assert_idle(cluster)


def _seeded_samples(prompt: str, num_tokens: int):
    """A streaming seeded parallel-sampling request: 3 samples of ``num_tokens``."""
    from tandem.v1 import tandem_pb2 as pb

    return pb.GenerateRequest(prompt=prompt, stream=True, sampling=pb.SamplingParams(
        n=3, max_tokens=num_tokens, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True))


def test_scale_down_migrates_both_routers_requests_unchanged(cluster, router2, baseline):
    """Retiring a decode worker with no time to drain: requests of this router and of
    the second one that run on it move to the other decode worker, token-exact, a
    seeded ``n = 3`` request sample by sample; no request fails. (Adding a worker is
    exercised by tests/cluster/test_autoscaling.py; the tests after this one need
    one decode worker only.)"""
    from tandem.control.journal import RedisJournal

    srv = cluster.server.server
    _, address2 = router2
    # 32 tokens each: the worker is retired a few tokens in (once every stream has 3),
    # which leaves each request some 25 tokens to decode after the move.
    parallel = _seeded_samples(PROMPTS[3], 32)
    ref = Stream(cluster.server.address, PROMPTS[3], request=parallel)
    ref.join(300)
    assert ref.code == grpc.StatusCode.OK and sorted(ref.by_index) == [0, 1, 2]
    assert all(len(t) == 32 for t in ref.by_index.values())
    assert len({tuple(t) for t in ref.by_index.values()}) == 3      # the samples differ
    sampled = Stream(cluster.server.address, PROMPTS[3], request=parallel)
    streams = [Stream(cluster.server.address, p, 32) for p in PROMPTS] + \
        [Stream(address2, p, 32) for p in PROMPTS[:2]]
    _wait(lambda: all(len(s.tokens) >= 3 for s in [*streams, sampled]), 120,
          "every stream to start")
    # Retire the decode worker that runs the parallel-sampling request (the journal
    # says which); the routers spread the others over both workers.
    journal = RedisJournal(srv.state)
    entries = [e for e in map(journal.load, journal.active()) if e is not None]
    (victim,) = {e.worker_id for e in entries if e.record["sampling_params"]["n"] == 3}
    (survivor,) = {"decode-0", "decode-1"} - {victim}
    assert srv.cluster.reservations.inflight("decode", [victim])[victim] > 1
    left = cluster.server.run(srv.retire_worker(victim, drain_timeout_s=0), 60)
    assert left > 0
    for s in [*streams, sampled]:
        s.join(300)
    for s in streams:
        assert s.code == grpc.StatusCode.OK, (s.prompt, s.code)
        assert len(s.tokens) == 32 and s.tokens[:N] == baseline[s.prompt], s.prompt
    assert sampled.code == grpc.StatusCode.OK, sampled.details
    assert sampled.by_index == ref.by_index         # each sample resumed where it was
    assert [w.worker_id for w in srv.registry.workers("decode")] == [survivor]
    assert victim not in srv.actors and srv.state.draining() == {}
    _assert_idle(cluster)
    assert _ids(cluster.generate(greedy(PROMPTS[1], N))) == baseline[PROMPTS[1]]


def test_kill_router_affects_only_its_own_clients(cluster, router2, baseline):
    proc, address2 = router2
    mine = [Stream(cluster.server.address, p) for p in PROMPTS[:2]]
    theirs = [Stream(address2, p, 64) for p in PROMPTS[2:]]
    _wait(lambda: all(len(s.tokens) >= 3 for s in mine + theirs), 120, "every stream to start")
    proc.kill()                                          # kill -9 the second router
    for s in mine + theirs:
        s.join(300)
    for s in mine:
        assert s.code == grpc.StatusCode.OK and s.tokens == baseline[s.prompt], s.prompt
    for s in theirs:                                     # a clean status, not a hang
        assert s.code == grpc.StatusCode.UNAVAILABLE, s.code
    # The workers drop the dead router's requests once it stops polling; their blocks
    # come back.
    t0 = time.monotonic()
    counts = cluster.wait_idle(60)
    print(f"\nrouter kill: its requests' blocks freed {time.monotonic() - t0:.1f} s after")
    for wid, c in counts.items():
        assert c["num_running"] == c["num_waiting"] == 0, (wid, c)
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)
    assert _ids(cluster.generate(greedy(PROMPTS[0], N))) == baseline[PROMPTS[0]]
