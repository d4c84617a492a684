"""The planner scaling prefill and decode pools separately on Ray's fake multi-node
autoscaler (``RAY_FAKE_CLUSTER=1``: node types ``prefill`` and ``decode``, each node a
raylet on this machine): the real server, real gRPC load, real Ray node launches.

benchmarks/autoscaling.py ``--scenario test`` drives four phases and records the
pools every half second, the controller's events and every request; it runs in a
process session of its own, killed by session afterwards (the fake nodes are
daemons of its Ray head). Asserted here:

* prompt-heavy load grows the prefill pool, never the decode pool;
* answer-heavy load grows the decode pool, never the prefill pool (which shrinks back);
* the same load held: no pool changes (no flapping);
* light load: both pools shrink to their minimum, and Ray removes the idle nodes;
* no request fails, through every scale-up and scale-down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_multinode import kill_session

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscaling.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("autoscaling") / "result.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(BENCH), "--scenario", "test", "--out", str(out)],
                            start_new_session=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=540)
    finally:
        proc.kill()
        left = kill_session(proc.pid)
    assert proc.returncode == 0, log[-4000:]
    assert left == [], f"processes left behind: {left}"
    result = json.loads(out.read_text())
    result["log"] = log         # the server's own account of a failed request is in it
    return result


def _tracebacks(log: str, limit: int = 6000) -> str:
    """The benchmark process's logged tracebacks (the router logs an unexpected error
    of a request with its traceback), for a failure message."""
    at = log.find("Traceback")
    return log[max(0, at - 500):at + limit] if at >= 0 else "(no traceback logged)"


def _phase(run, name):
    return [t for t in run["timeline"] if t["phase"] == name]


def _events(run, name):
    (span,) = [p for p in run["phases"] if p["phase"] == name]
    return [e for e in run["events"] if span["start"] <= e["t"] < span["end"]]


def _size(t, pool):
    return t[f"{pool}_ready"] + t[f"{pool}_pending"]


def test_prompt_heavy_load_scales_the_prefill_pool_only(run):
    rows = _phase(run, "prompt_heavy")
    assert rows[0]["prefill_ready"] == 1 and rows[0]["decode_ready"] == 1
    assert max(t["prefill_ready"] for t in rows) == 2
    assert max(_size(t, "decode") for t in rows) == 1
    assert all(e["pool"] == "prefill" for e in _events(run, "prompt_heavy"))
    # The new worker's node was added by Ray's autoscaler for its `prefill` resource.
    assert max(t["prefill_nodes"] for t in rows) == 2


def test_answer_heavy_load_scales_the_decode_pool_only(run):
    rows = _phase(run, "answer_heavy")
    start_prefill = _size(rows[0], "prefill")
    assert max(t["decode_ready"] for t in rows) == 2
    assert max(_size(t, "prefill") for t in rows) <= start_prefill
    assert {e["action"] for e in _events(run, "answer_heavy") if e["pool"] == "prefill"} \
        <= {"draining", "retired"}
    assert rows[-1]["prefill_ready"] == 1


def test_constant_load_does_not_flap(run):
    rows = _phase(run, "steady")
    assert _events(run, "steady") == []
    assert {(t["prefill_ready"], t["decode_ready"]) for t in rows} == {(1, 2)}


def test_pools_shrink_to_their_minimum_when_load_goes(run):
    rows = _phase(run, "light")
    last = rows[-1]
    assert (last["prefill_ready"], last["decode_ready"]) == (1, 1)
    retired = [e for e in _events(run, "light") if e["action"] == "retired"]
    assert [e["pool"] for e in retired] == ["decode"]
    # Ray's autoscaler removed the nodes the retired workers left idle.
    assert (last["prefill_nodes"], last["decode_nodes"]) == (1, 1)
    assert all(p["condition_met"] for p in run["phases"] if p["phase"] != "steady")


def test_no_request_fails_during_scaling(run):
    failed = [r for r in run["requests"] if not r["ok"]]
    assert failed == [], f"{failed}\n{_tracebacks(run['log'])}"
    by_phase = {p["phase"]: 0 for p in run["phases"]}
    for r in run["requests"]:
        by_phase[r["phase"]] += 1
    assert all(n > 0 for n in by_phase.values()), by_phase
    # A decode worker was retired while the light load ran: requests were in flight
    # across it, and every one finished with all its tokens.
    (decode_gone,) = [e for e in run["events"] if e["action"] == "retired" and e["pool"] == "decode"]
    assert any(r["start"] < decode_gone["t"] and r["phase"] == "light" for r in run["requests"])
