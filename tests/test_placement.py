"""benchmarks/placement.py's latency model and simulation: one request alone meets an
SLO exactly when the model's own prefill and decode times do, the ring all-reduce
term, and that the placements enumerated fit the device budget."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_placement", Path(__file__).resolve().parents[1] / "benchmarks" / "placement.py")
placement = importlib.util.module_from_spec(_spec)
sys.modules["bench_placement"] = placement
_spec.loader.exec_module(placement)

M = placement.MODELS["llama-3-8b"]
D = placement.DEVICES["a100"]


def _alone(tp: int, td: int) -> tuple[float, float]:
    """TTFT and TPOT of one request with nothing else in the cluster, from the model."""
    n_in, n_out = 512, 16
    ttft = placement.prefill_time(M, D, [n_in], tp)
    steps = [placement.decode_time(M, D, [n_in + g], td) for g in range(1, n_out)]
    kv = D.link_latency + n_in * M.kv_bytes_per_token / D.kv_link_bw
    # The first decode step starts when the KV has arrived; TPOT spans the n_out - 1 steps.
    return ttft, (kv + sum(steps)) / (n_out - 1)


@pytest.mark.parametrize("tp, td", [(1, 1), (2, 1), (1, 4)])
def test_a_lone_request_meets_an_slo_exactly_at_the_models_times(tp, td):
    ttft, tpot = _alone(tp, td)
    pl = ("disagg", tp, 1, td, 1)
    rate = 1e-3                                       # arrivals far apart: never queued
    for eps, want in ((1e-9, 1.0), (-1e-9, 0.0)):
        w = placement.Workload(512, 16, ttft * (1 + eps), tpot * (1 + 1e-9), num_requests=20)
        assert placement.simulate(M, D, w, rate, pl) == want
        w = placement.Workload(512, 16, ttft * (1 + 1e-9), tpot * (1 + eps), num_requests=20)
        assert placement.simulate(M, D, w, rate, pl) == want


def test_ring_all_reduce_and_the_decode_roofline():
    n = 4096 * 2 * 8
    assert placement.all_reduce(n, 1, D) == 0.0
    assert placement.all_reduce(n, 4, D) == pytest.approx(D.link_latency + 1.5 * n / D.link_bw)
    # One short sequence on one rank is bound by reading the weights.
    step = placement.decode_time(M, D, [1], 1)
    assert step == pytest.approx(
        (M.weight_bytes + M.kv_bytes_per_token) / (D.mem_bw * D.mem_eff) + D.step_overhead)


def test_placements_fit_the_budget_and_goodput_is_served():
    pls = placement.placements(M, D, 4)
    assert ("colocated", 4, 1) in pls and ("disagg", 2, 1, 1, 2) in pls
    for pl in pls:
        used = pl[1] * pl[2] + (pl[3] * pl[4] if pl[0] == "disagg" else 0)
        assert used <= 4
    w = placement.Workload(512, 16, 1.0, 0.05, num_requests=60)
    g = placement.goodput(M, D, w, ("disagg", 1, 1, 1, 1), 0.9)
    assert g > 0
    assert placement.simulate(M, D, w, g, ("disagg", 1, 1, 1, 1)) >= 0.9
