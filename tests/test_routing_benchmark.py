"""benchmarks/routing.py's pure parts: the kill report, counter arithmetic, the banner."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_routing", ROOT / "benchmarks" / "routing.py")
routing = importlib.util.module_from_spec(_spec)
sys.modules["bench_routing"] = routing
_spec.loader.exec_module(routing)
serve = sys.modules["serve"]     # routing.py imports serve.py by name


def rec(start, times, end, success=True):
    return serve.RequestRecord("random", 10, len(times), start, end, list(times), [1] * len(times), success)


def test_kill_report_stall_spans_the_kill_and_only_in_flight_streams_count():
    t_kill = 10.0
    records = [
        rec(0.0, [1.0, 2.0, 3.0], 3.0),                  # done before the kill: not in flight
        rec(8.0, [8.5, 9.0, 9.5, 12.5, 12.75], 12.75),    # stalls 9.5 -> 12.5 across the kill
        rec(9.0, [9.25, 9.75, 10.25, 10.75], 10.75),      # on the other worker: 0.5 s gap
        rec(9.9, [11.5, 11.75], 11.75),                   # no token before the kill
        rec(11.0, [11.25, 13.25], 13.25),                 # sent after the kill; a wide gap of its own
    ]
    r = routing.kill_report(records, t_kill)
    assert (r["num_in_flight"], r["num_streaming"], r["num_in_flight_failed"]) == (3, 2, 0)
    assert r["stall_spanning_kill_s"] == {"max": 3.0, "sorted": [3.0, 0.5]}
    assert r["max_itl_in_flight_s"] == 3.0
    assert r["max_itl_not_in_flight_s"] == 2.0                    # the post-kill request's gap
    assert r["ttft_in_flight_without_token_s"] == [pytest.approx(1.6)]
    assert [(x["request"], x["tokens_before_kill"], x["stall_s"], x["next_gaps_s"])
            for x in r["streams_at_kill"]] == [(1, 3, 3.0, [0.25]), (2, 2, 0.5, [0.5])]
    assert routing.stall_at(records[0], t_kill) is None
    rows = routing.request_rows(records)
    assert [row["start_s"] for row in rows] == [0.0, 8.0, 9.0, 9.9, 11.0]


def test_counter_increase_and_hit_rate():
    before = {routing.PREFIX_HITS: {"w0": 10.0}, routing.PREFIX_QUERIES: {"w0": 20.0}}
    after = {routing.PREFIX_HITS: {"w0": 70.0, "w1": 0.0}, routing.PREFIX_QUERIES: {"w0": 100.0, "w1": 40.0}}
    inc = routing.counter_increase(before, after)
    assert inc == {routing.PREFIX_HITS: {"w0": 60.0, "w1": 0.0},
                   routing.PREFIX_QUERIES: {"w0": 80.0, "w1": 40.0}}
    h = routing.hit_rate(inc)
    assert (h["hit_tokens"], h["queried_tokens"], h["hit_rate"]) == (60.0, 120.0, 0.5)
    assert h["per_worker"]["w0"]["hit_rate"] == 0.75 and h["per_worker"]["w1"]["hit_rate"] == 0.0
    assert routing.hit_rate({})["hit_rate"] is None


def test_banner_regex_and_args():
    line = "tandem: serving disaggregated on 127.0.0.1:5 (cluster state redis://127.0.0.1:6379/0), metrics"
    assert routing.BANNER_REDIS.search(line).group(1) == "redis://127.0.0.1:6379/0"
    a = routing.parse_args(["policies", "--policies", "prefix_aware"])
    assert a.policies == ["prefix_aware"] and a.num_prefixes == 8 and a.dtype == "float32"
    assert routing.parse_args(["recovery"]).victim == "decode-0"
    with pytest.raises(SystemExit):
        routing.parse_args(["policies", "--policies", "round_robin"])
