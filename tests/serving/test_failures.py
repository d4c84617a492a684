"""Failure paths through the real cluster: a KV layout mismatch at start-up (C09), a
broken KV transfer (the request is prefilled again on the decode worker), and a
decode worker that dies and is replaced (health flips and comes back)."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

from .conftest import greedy, serve_config, serving, start_server

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("field,prefill_change,expect", [
    ("block_size", {"block_size": 32}, "block_size prefill=32 decode=16"),
])
def test_c09_layout_mismatch_refused_at_startup(ray_session, field, prefill_change, expect):
    from tandem.kvtransfer.layout import KVLayoutMismatchError

    cfg = serve_config("disaggregated", num_blocks=64)
    prefill = dataclasses.replace(cfg.engine, cache=dataclasses.replace(cfg.engine.cache,
                                                                        **prefill_change))
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        start_server(dataclasses.replace(cfg, prefill_engine=prefill))
    assert time.monotonic() - t0 < 120            # refused, not hung
    assert isinstance(err.value, KVLayoutMismatchError) or \
        isinstance(getattr(err.value, "cause", None), KVLayoutMismatchError)
    assert expect in str(err.value)


def test_c09_dtype_mismatch_named(ray_session):
    cfg = serve_config("disaggregated", num_blocks=64)
    prefill = dataclasses.replace(cfg.engine, dtype="bfloat16")
    with pytest.raises(Exception) as err:
        start_server(dataclasses.replace(cfg, prefill_engine=prefill))
    assert "dtype prefill=bfloat16 decode=float32" in str(err.value)


@pytest.fixture(scope="module")
def fragile(ray_session):
    # No supervision: the health test replaces the dead worker itself.
    yield from serving(serve_config("disaggregated", num_blocks=256, transfer_timeout_s=3.0,
                                    supervise=False))


def _ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_broken_transfer_falls_back_to_decode_prefill(fragile):
    req = greedy("The three primary colours are", 12)
    baseline = _ids(fragile.generate(req))
    srv = fragile.server.server
    prefill = srv.cluster.prefill[0]
    assert fragile.server.run(prefill.actor.close_kv_channel.remote("decode-0"))
    t0 = time.monotonic()
    got = _ids(fragile.generate(req))
    assert got == baseline                         # same tokens, prefilled on the decode worker
    assert time.monotonic() - t0 < 30              # never hangs
    counts = fragile.wait_idle(15)                 # the reservation is freed after the timeout
    for c in counts.values():
        assert c["num_free_blocks"] == c["num_blocks"] and c.get("num_reserved", 0) == 0, counts
    text = fragile.metrics_text()
    assert 'tandem:kv_transfer_failures_total{model_name="SmolLM2-135M-Instruct",worker="prefill-0"} 1.0' in text
    fragile.server.run(srv.reconnect_kv("prefill-0", "decode-0"))
    before = fragile.block_counts()["prefill-0"]["kv_transfer_bytes"]
    assert _ids(fragile.generate(req)) == baseline
    assert fragile.block_counts()["prefill-0"]["kv_transfer_bytes"] > before


def test_health_flips_when_decode_dies_and_returns_when_replaced(fragile):
    import ray
    import urllib.error
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(fragile.channel)
    serving = health_pb2.HealthCheckResponse.SERVING

    def status():
        return health.Check(health_pb2.HealthCheckRequest(service="")).status

    def http_health():
        port = fragile.server.server.metrics_port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status() == serving and http_health() == 200
    srv = fragile.server.server
    ray.kill(srv.cluster.decode[0].actor)
    deadline = time.monotonic() + 30
    while status() == serving:
        assert time.monotonic() < deadline, "health did not flip"
        time.sleep(0.2)
    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert http_health() == 503
    # The router saw it die: its series left /metrics (no gauge keeps its last value),
    # but for the counters of its failures; the prefill worker's are all there.
    series = _worker_series(fragile.metrics_text())
    assert {name for name, _ in series["decode-0"]} == {"tandem:worker_restarts_total",
                                                        "tandem:request_migrations_total"}
    assert set(series["prefill-0"]) == set(_fresh_series("prefill-0", "prefill"))
    with pytest.raises(grpc.RpcError) as err:
        fragile.generate(greedy("Hello", 3))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    fragile.server.run(srv.restart_worker("decode-0"), timeout_s=180)
    deadline = time.monotonic() + 30
    while status() != serving:
        assert time.monotonic() < deadline, "health did not come back"
        time.sleep(0.2)
    assert http_health() == 200
    # Its replacement's series are back, from 0.
    series = _worker_series(fragile.metrics_text())
    assert set(series["decode-0"]) == set(_fresh_series("decode-0", "decode"))
    assert all(v == 0 for (name, _), v in series["decode-0"].items()
               if name in _GAUGES or name.startswith("tandem:num_preemptions")), series
    assert len(_ids(fragile.generate(greedy("Hello", 3)))) == 3


_GAUGES = ("tandem:num_requests_running", "tandem:num_requests_waiting",
           "tandem:num_requests_swapped", "tandem:kv_cache_usage_perc")


def _fresh_series(worker_id: str, role: str) -> dict[tuple, float]:
    """What :func:`_worker_series` gives for a worker that just registered."""
    from tandem.router.metrics import Metrics

    metrics = Metrics("SmolLM2-135M-Instruct")
    metrics.register_worker(worker_id, role)
    return _worker_series(metrics.render().decode())[worker_id]


def _worker_series(text: str) -> dict[str, dict[tuple, float]]:
    """worker id -> {(sample name, role or None): value} of a /metrics scrape (one
    sample per family and worker: the preemption kinds summed, histograms by count)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            wid = smp.labels.get("worker")
            if wid is None or smp.name.endswith(("_created", "_bucket", "_sum")):
                continue
            key = (smp.name, smp.labels.get("role"))
            per = out.setdefault(wid, {})
            per[key] = per.get(key, 0.0) + smp.value
    return out
