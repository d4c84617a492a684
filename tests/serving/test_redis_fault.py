"""Redis failures on real processes, in the default deployment (1 prefill + 1 decode
Ray actor, gRPC over loopback, the real model, greedy float32):

* ``kill -9`` the embedded redis-server with streams in flight: it is restarted on
  the same port (a new pid), the workers re-assert their records under the same
  generations, every stream completes with the no-failure tokens, later requests
  too, health stays SERVING and the KV cache goes back to idle;
* an external Redis (``redis_url``) that dies and stays away past the lease TTL:
  requests are still served on the routers' last view, no worker is declared dead
  or replaced, health stays SERVING; when it is back the state is re-asserted.

Recovery times are printed (``-s``) and recorded in benchmarks/README.md.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis

from tests.serving.conftest import Client, greedy, serve_config, start_server
from tests.serving.test_fault_tolerance import Stream, _assert_idle, _health, _ids, _wait

PROMPTS = ["Write a short story about a dragon.", "Explain how a bicycle works.",
           "List five facts about the Moon.", "Describe a busy market in the morning.",
           "What is the capital of France?", "Give me three tips for writing clean code.",
           "Why is the sky blue?", "Name four animals that live in the sea."]
N = 24


def _serve(**kw) -> Client:
    return Client(start_server(serve_config("disaggregated", transfer_timeout_s=3.0, **kw)))


def _baseline(client: Client, prompts: list[str] = PROMPTS) -> dict[str, list[int]]:
    streams = [Stream(client.server.address, p, N) for p in prompts]
    for s in streams:
        s.join(300)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == N for s in streams)
    return {s.prompt: s.tokens for s in streams}


def _http_health(client: Client) -> int:
    url = f"http://127.0.0.1:{client.server.server.metrics_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _assert_serving(client: Client) -> None:
    from grpc_health.v1 import health_pb2

    assert _health(client) == health_pb2.HealthCheckResponse.SERVING
    assert _http_health(client) == 200


def _registered(srv, gens: dict[str, int]):
    """The workers' records once every one is back alive under its generation."""
    try:
        records = srv.state.workers()
    except redis.exceptions.RedisError:
        return None
    got = {r.worker_id: r.generation for r in records if r.alive}
    return records if got == gens else None


@pytest.fixture
def embedded(ray_session):
    client = _serve()
    yield client
    client.close()
    client.server.stop()


def test_kill9_embedded_redis_with_streams_in_flight(embedded):
    client, srv = embedded, embedded.server.server
    baseline = _baseline(client)
    gens = {w.worker_id: w.generation for w in srv.registry.workers()}
    assert sorted(gens) == ["decode-0", "prefill-0"]
    port, old_pid = srv.redis.port, srv.redis.pid
    restarts = len(srv.supervisor.recoveries)
    # 16 streams: every prompt twice (the second hits the prefix cache).
    streams = [Stream(client.server.address, p, N) for p in PROMPTS + PROMPTS]
    _wait(lambda: all(len(s.tokens) >= 2 for s in streams), 120, "every stream to start")
    t0 = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    during = Stream(client.server.address, PROMPTS[0], N)       # sent into the outage
    _wait(lambda: srv.redis.pid not in (None, old_pid), 30, "redis-server to be restarted")
    t_redis = time.monotonic() - t0
    _wait(lambda: _registered(srv, gens), 30, "the workers to re-assert their records")
    t_state = time.monotonic() - t0
    for s in [*streams, during]:
        s.join(300)
    for s in [*streams, during]:
        assert s.code == grpc.StatusCode.OK, (s.prompt, s.code, getattr(s, "details", None))
        assert s.tokens == baseline[s.prompt], s.prompt
    # The same server again: same port, a new process, answering as itself.
    assert srv.redis.port == port and srv.redis.pid != old_pid
    assert redis.Redis(port=port).info("server")["process_id"] == srv.redis.pid
    [rec] = srv.redis.restarts
    assert (rec.old_pid, rec.new_pid, rec.exit_code) == (old_pid, srv.redis.pid, -9)
    # Nobody was declared dead or replaced; the cluster state is whole again.
    assert len(srv.supervisor.recoveries) == restarts
    assert {w.worker_id: (w.generation, w.alive) for w in srv.registry.workers()} == \
        {wid: (g, True) for wid, g in gens.items()}
    _wait(lambda: srv.state.redis.get(srv.state.key("ray_address")), 10, "the Ray address")
    _assert_serving(client)
    assert _ids(client.generate(greedy(PROMPTS[1], N))) == baseline[PROMPTS[1]]
    _assert_idle(client)
    print(f"\nredis kill -9: redis-server back (new pid, port {port}) {t_redis:.2f} s after "
          f"the kill ({rec.down_s:.2f} s to restart); every worker re-asserted "
          f"{t_state:.1f} s after")


@pytest.fixture
def external(ray_session, private_redis_server):
    client = _serve(redis_url=private_redis_server.url, lease_ttl_s=2.0)
    yield client, private_redis_server
    client.close()
    client.server.stop()


@pytest.fixture
def private_redis_server():
    """A redis-server nobody supervises: it stands for an external Redis."""
    from tandem.control.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    yield server
    server.stop()


def test_external_redis_lost_requests_still_served_then_state_reasserted(external):
    from tandem.control.state import LEASE_TTL_S

    client, ext = external
    srv = client.server.server
    ttl = srv.config.lease_ttl_s
    assert ttl < LEASE_TTL_S and srv.redis is None
    baseline = _baseline(client, PROMPTS[:4])          # the prompts this test sends
    gens = {w.worker_id: w.generation for w in srv.registry.workers()}
    restarts = len(srv.supervisor.recoveries)
    streams = [Stream(client.server.address, p, N) for p in PROMPTS[:4]]
    _wait(lambda: all(len(s.tokens) >= 2 for s in streams), 120, "every stream to start")
    ext.kill()                                  # gone, and nothing brings it back
    t_kill = time.monotonic()
    for s in streams:
        s.join(300)
    for s in streams:
        assert s.code == grpc.StatusCode.OK and s.tokens == baseline[s.prompt], s.prompt
    # Past two lease TTLs without Redis: requests are served, nobody is dead.
    time.sleep(max(0.0, 2 * ttl + 1 - (time.monotonic() - t_kill)))
    assert _ids(client.generate(greedy(PROMPTS[2], N))) == baseline[PROMPTS[2]]
    assert not srv.registry.state_reachable
    assert srv.registry.state_error.startswith(
        f"cluster state (Redis) unreachable at 127.0.0.1:{ext.port}/0")
    assert all(w.alive for w in srv.registry.workers())
    assert len(srv.supervisor.recoveries) == restarts
    _assert_serving(client)
    # Back (empty, same port): the workers re-assert under the same generations.
    t0 = time.monotonic()
    ext.restart()
    _wait(lambda: _registered(srv, gens), 30, "the workers to re-assert their records")
    t_state = time.monotonic() - t0
    _wait(lambda: srv.registry.state_reachable, 10, "the router to reach Redis again")
    assert len(srv.supervisor.recoveries) == restarts
    assert {w.worker_id: w.generation for w in srv.registry.workers()} == gens
    assert _ids(client.generate(greedy(PROMPTS[3], N))) == baseline[PROMPTS[3]]
    _assert_serving(client)
    _assert_idle(client)
    print(f"\nexternal redis down {t0 - t_kill:.1f} s (lease TTL {ttl} s): every request "
          f"served; every worker re-asserted {t_state:.1f} s after it was back")
