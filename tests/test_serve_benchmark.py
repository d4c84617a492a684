"""The serving benchmark's pure parts (metrics, arrivals, workloads), its process
handling, and, once the server exists, one short run against ``tandem serve``."""

from __future__ import annotations

import importlib.util
import math
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = serve   # dataclasses look their module up by name
_spec.loader.exec_module(serve)


def record(start, chunks, end, *, group="random", prompt_len=10, success=True, error=""):
    """A record from (arrival time, tokens) pairs; times chosen exact in binary."""
    return serve.RequestRecord(group, prompt_len, sum(k for _, k in chunks), start, end,
                               [t for t, _ in chunks], [k for _, k in chunks], success, error)


# --------------------------------------------------------------------------- metrics


def test_request_metrics_one_itl_sample_per_message():
    # 5 tokens in 4 messages; the third message carries 2 tokens.
    r = record(10.0, [(10.5, 1), (10.75, 1), (11.0, 2), (11.125, 1)], 11.25)
    m = serve.request_metrics(r)
    assert m.ttft == 0.5
    assert m.e2e == 1.25
    assert m.output_tokens == 5
    assert m.tpot == 0.75 / 4
    # The 2-token message is one gap, not two half-gaps.
    assert m.itls == (0.25, 0.25, 0.125)


def test_request_metrics_first_message_with_several_tokens_and_single_token_output():
    m = serve.request_metrics(record(0.0, [(0.25, 3), (0.5, 1)], 0.5))
    assert (m.ttft, m.e2e, m.output_tokens, m.itls) == (0.25, 0.5, 4, (0.25,))
    assert m.tpot == 0.25 / 3
    one = serve.request_metrics(record(0.0, [(0.5, 1)], 0.625))
    assert one.tpot is None and one.itls == () and one.ttft == 0.5 and one.e2e == 0.625


def test_request_metrics_needs_a_token():
    with pytest.raises(ValueError):
        serve.request_metrics(record(0.0, [], 1.0))


def test_distribution_exact_percentiles():
    d = serve.distribution(range(101))          # 0..100: percentile p is exactly p
    assert d == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    d = serve.distribution([4.0, 1.0, 3.0, 2.0])  # linear interpolation between order statistics
    assert d["mean"] == 2.5 and d["p50"] == 2.5
    assert d["p90"] == pytest.approx(3.7, abs=1e-12)
    assert d["p99"] == pytest.approx(3.97, abs=1e-12)
    assert serve.distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _run_records():
    return [
        # ttft 0.5, tpot 0.25, itls 0.25 x2
        record(0.0, [(0.5, 1), (0.75, 1), (1.0, 1)], 1.0, prompt_len=100),
        # ttft 1.0 (misses a 0.75 s TTFT SLO), tpot 0.125
        record(1.0, [(2.0, 1), (2.125, 1), (2.25, 1)], 2.25, prompt_len=200),
        # ttft 0.25, one token: no TPOT, meets the TPOT SLO
        record(2.0, [(2.25, 1)], 2.5, prompt_len=50),
        # ttft 0.25, tpot 0.5 (misses a 0.3 s TPOT SLO)
        record(3.0, [(3.25, 1), (3.75, 1)], 3.75, prompt_len=30),
        # failed: counts as a request, not in any latency or token total
        record(3.5, [(3.75, 1)], 4.0, prompt_len=999, success=False, error="UNAVAILABLE: gone"),
    ]


def test_summarize_counts_throughputs_and_goodput():
    recs = _run_records()
    recs[0].cached_tokens, recs[4].cached_tokens = 64, 512     # a failed request's do not count
    s = serve.summarize(recs, slo_ttft=0.75, slo_tpot=0.3)
    assert s["duration_s"] == 4.0                   # first start 0.0 -> last end 4.0
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (5, 4, 1)
    assert s["num_wrong_length"] == 0
    assert s["errors"] == ["UNAVAILABLE: gone"]
    assert s["total_input_tokens"] == 380 and s["total_output_tokens"] == 9
    assert s["total_cached_tokens"] == 64
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 9 / 4
    assert s["total_token_throughput"] == 389 / 4
    assert s["goodput"] == 2 / 4                    # requests 1 and 3 meet both SLOs
    assert s["ttft_s"]["p50"] == 0.375 and s["ttft_s"]["mean"] == 0.5
    assert s["tpot_s"]["mean"] == (0.25 + 0.125 + 0.5) / 3
    assert s["itl_s"]["mean"] == (0.25 + 0.25 + 0.125 + 0.125 + 0.5) / 5
    assert s["e2e_s"]["p50"] == 0.875


def test_summarize_counts_outputs_shorter_than_asked():
    r = record(0.0, [(0.5, 1), (0.75, 1)], 1.0)
    r.output_len = 3
    assert serve.summarize([r])["num_wrong_length"] == 1


def test_goodput_with_one_slo_and_without_any():
    recs = _run_records()
    assert serve.summarize(recs, slo_ttft=0.75)["goodput"] == 3 / 4
    assert serve.summarize(recs, slo_tpot=0.3)["goodput"] == 3 / 4
    assert serve.summarize(recs)["goodput"] is None
    # An explicit duration replaces the records' span.
    assert serve.summarize(recs, slo_ttft=10.0, duration=8.0)["goodput"] == 0.5


def test_summarize_groups_share_the_run_duration():
    recs = _run_records()
    recs[0].group = recs[1].group = "long-gen"
    groups = serve.summarize_groups(recs, None, None)
    assert sorted(groups) == ["long-gen", "random"]
    assert groups["long-gen"]["duration_s"] == 4.0
    assert groups["long-gen"]["num_completed"] == 2
    assert groups["long-gen"]["itl_s"]["p50"] == 0.1875   # gaps 0.25, 0.25, 0.125, 0.125
    assert serve.summarize_groups(_run_records(), None, None) == {}


# --------------------------------------------------------------------------- arrivals


def test_arrivals_start_at_zero_increase_and_are_seeded():
    a = serve.arrival_offsets(50, 2.0, 1.0, seed=7)
    assert len(a) == 50 and a[0] == 0.0
    assert all(y >= x for x, y in zip(a, a[1:]))
    assert a == serve.arrival_offsets(50, 2.0, 1.0, seed=7)
    assert a != serve.arrival_offsets(50, 2.0, 1.0, seed=8)
    assert serve.arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0] * 4
    assert serve.arrival_offsets(0, 2.0, 1.0, seed=0) == []
    with pytest.raises(ValueError):
        serve.arrival_offsets(3, 2.0, 0.0, seed=0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_variance_set_by_burstiness(burstiness):
    rate, n = 4.0, 20001
    gaps = np.diff(serve.arrival_offsets(n, rate, burstiness, seed=3))
    # Gamma(k, 1/(k*rate)): mean 1/rate, squared coefficient of variation 1/k.
    # Bounds are > 5 standard errors of each estimate at n = 20000.
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(burstiness * (n - 1))
    cv2 = gaps.var() / gaps.mean() ** 2
    assert abs(cv2 - 1 / burstiness) < 0.2 / burstiness


# --------------------------------------------------------------------------- workloads


def test_random_workload_lengths_ids_and_seed():
    w = serve.random_workload(300, (3, 6), (2, 4), seed=1)
    assert w.leading == () and len(w.paced) == 300
    assert {len(s.prompt_ids) for s in w.paced} == {3, 4, 5, 6}   # every length in range, nothing else
    assert {s.output_len for s in w.paced} == {2, 3, 4}
    ids = [t for s in w.paced for t in s.prompt_ids]
    assert min(ids) >= 100 and max(ids) <= 49151
    assert {s.group for s in w.paced} == {"random"}
    assert w == serve.random_workload(300, (3, 6), (2, 4), seed=1)
    assert w != serve.random_workload(300, (3, 6), (2, 4), seed=2)


def test_shared_prefix_workload_shares_exactly_the_prefix():
    w = serve.shared_prefix_workload(40, 64, (1, 8), (5, 5), seed=0)
    prompts = [s.prompt_ids for s in w.paced]
    assert len(prompts) == 40
    prefix = prompts[0][:64]
    assert all(p[:64] == prefix for p in prompts)
    assert {len(p) - 64 for p in prompts} <= set(range(1, 9))
    assert len({p[64:] for p in prompts}) == 40                   # suffixes all distinct
    assert {s.output_len for s in w.paced} == {5}
    assert all(100 <= t <= 49151 for p in prompts for t in p)
    with pytest.raises(ValueError, match="distinct suffixes"):
        serve.shared_prefix_workload(49053, 4, (1, 1), (1, 1), seed=0)   # only 49052 one-token suffixes


def test_shared_prefix_workload_with_several_prefixes():
    k, n, plen = 5, 23, 32
    w = serve.shared_prefix_workload(n, plen, (1, 8), (3, 3), seed=4, num_prefixes=k)
    prompts = [s.prompt_ids for s in w.paced]
    assert len(prompts) == n
    prefixes = {p[:plen] for p in prompts}
    assert len(prefixes) == k                                     # exactly K distinct prefixes
    assert all(any(p[:plen] == q for q in prefixes) for p in prompts)   # each starts with one
    assert {len(p) - plen for p in prompts} <= set(range(1, 9))
    assert len({p[plen:] for p in prompts}) == n                  # suffixes all distinct
    # Rounds of K: every prefix used n // K or n // K + 1 times, each round all K.
    counts = sorted(sum(p[:plen] == q for p in prompts) for q in prefixes)
    assert counts == [n // k] * (k - n % k) + [n // k + 1] * (n % k)
    assert all(len({p[:plen] for p in prompts[i:i + k]}) == k for i in range(0, n - n % k, k))
    assert {s.output_len for s in w.paced} == {3} and {s.group for s in w.paced} == {"shared-prefix"}
    # Seeded: the same seed gives the same workload, another seed other prefixes.
    assert w == serve.shared_prefix_workload(n, plen, (1, 8), (3, 3), seed=4, num_prefixes=k)
    other = serve.shared_prefix_workload(n, plen, (1, 8), (3, 3), seed=5, num_prefixes=k)
    assert {p[:plen] for p in (s.prompt_ids for s in other.paced)}.isdisjoint(prefixes)
    # One prefix is the default, and draws what it always drew.
    one = serve.shared_prefix_workload(n, plen, (1, 8), (3, 3), seed=4)
    assert one == serve.shared_prefix_workload(n, plen, (1, 8), (3, 3), seed=4, num_prefixes=1)
    assert len({s.prompt_ids[:plen] for s in one.paced}) == 1
    with pytest.raises(ValueError, match="num_prefixes"):
        serve.shared_prefix_workload(4, plen, (1, 8), (3, 3), seed=0, num_prefixes=0)
    with pytest.raises(ValueError, match="distinct prefixes"):
        serve.shared_prefix_workload(4, 1, (1, 8), (3, 3), seed=0, num_prefixes=49053)


def test_prefill_heavy_workload_leads_with_long_generations():
    w = serve.prefill_heavy_workload(3, 32, 256, 10, (512, 1024), 8, seed=0)
    assert [(len(s.prompt_ids), s.output_len, s.group) for s in w.leading] == [(32, 256, "long-gen")] * 3
    assert len(w.paced) == 10
    assert all(512 <= len(s.prompt_ids) <= 1024 and s.output_len == 8 and s.group == "long-prompt"
               for s in w.paced)
    assert w.requests == w.leading + w.paced


# --------------------------------------------------------------------------- report


def test_json_has_no_infinity_and_table_has_a_row_per_run():
    assert serve._jsonable({"r": [math.inf, 1.5], "x": (1, "a")}) == {"r": ["inf", 1.5], "x": [1, "a"]}
    recs = _run_records()
    run = {"mode": "colocated", "request_rate": 2.0, "summary": serve.summarize(recs),
           "groups": {"long-gen": serve.summarize(recs[:2])}}
    table = serve.comparison_table([run, dict(run, mode="disaggregated")]).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| colocated | 2.0 | 4/5 | 1.00 | 2.2 |")
    assert table[2].endswith("| 187.5 / 250.0 |")   # long-gen ITL p50 / p99, ms


def test_parse_args_rates_modes_and_serve_args():
    a = serve.parse_args(["--launch", "disaggregated,colocated", "--request-rate", "0.5,inf",
                          "--serve-arg=--foo", "--serve-arg", "bar"])
    assert a.modes == ["disaggregated", "colocated"]
    assert a.num_prefixes == 1
    assert serve.parse_args(["--endpoint", "127.0.0.1:1", "--workload", "shared-prefix",
                             "--num-prefixes", "8"]).num_prefixes == 8
    assert a.request_rate == [0.5, math.inf]
    assert a.serve_arg == ["--foo", "bar"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--launch", "colocated,fast"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--endpoint", "127.0.0.1:1", "--request-rate", "0"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--endpoint", "127.0.0.1:1", "--num-prefixes", "0"])


# --------------------------------------------------------------------------- process handling

# Stands in for the `tandem serve` executable only to test process-group cleanup: it
# starts a child that ignores SIGINT and SIGTERM (as a stuck daemon would) and a
# grandchild that leaves the process group with setsid; each writes its pid once set up.
_STUBBORN = """\
import os, subprocess, sys, time
pids = os.environ["PIDS_DIR"]
ignore = ("import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
          "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          f"open('{pids}/child', 'w').write(str(os.getpid())); time.sleep(60)")
escape = f"import os, time; open('{pids}/escaped', 'w').write(str(os.getpid())); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", ignore])
subprocess.Popen([sys.executable, "-c", escape], start_new_session=True)
time.sleep(60)
"""


def _script(tmp_path, body):
    path = tmp_path / "fake-tandem"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_stop_leaves_no_process_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PIDS_DIR", str(tmp_path))
    server = serve.ServerProcess("colocated", tmp_path / "log", _script(tmp_path, _STUBBORN),
                                 grace_s=1.0, term_s=1.0)
    # The server picks its own port (0) and prints it; nothing is chosen in advance.
    assert server.cmd[server.cmd.index("--port") + 1] == "0" and server.endpoint is None
    server.start()
    leader = server.proc.pid
    files = [tmp_path / "child", tmp_path / "escaped"]
    deadline = time.monotonic() + 30
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [leader, *(int(f.read_text()) for f in files)]
    assert all(serve._proc_stat(p) is not None for p in pids)
    t0 = time.monotonic()
    server.stop()
    assert [p for p in pids if serve._proc_stat(p) is not None] == []
    assert server.proc is None
    assert time.monotonic() - t0 < 1.0 + 1.0 + 5.0 + 1.0   # each stage bounded


def test_wait_ready_reports_an_early_exit_with_the_log(tmp_path):
    server = serve.ServerProcess("colocated", tmp_path / "log",
                                 _script(tmp_path, "print('no model here'); raise SystemExit(3)"),
                                 ready_timeout_s=30)
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*no model here"):
        with server:
            pass
    assert server.proc is None


# --------------------------------------------------------------------------- real server


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "router" / "server.py").exists(), reason="tandem serve not built yet")
def test_four_requests_against_colocated_server(tmp_path):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args = serve.parse_args(["--launch", "colocated", "--workload", "random", "--num-prompts", "4",
                             "--prompt-len", "8", "24", "--output-len", "4", "6", "--request-rate", "inf",
                             "--num-warmup", "1", "--request-timeout", "120"])
    with serve.ServerProcess("colocated", tmp_path / "serve.log", args.tandem_bin, args.dtype) as server:
        pgid = server.proc.pid
        runs = serve.benchmark_endpoint(server.endpoint, "colocated", args)
    assert not serve._group_alive(pgid)
    (run,) = runs
    s = run["summary"]
    assert (s["num_completed"], s["num_failed"]) == (4, 0), s["errors"]
    want = serve.random_workload(4, (8, 24), (4, 6), seed=0)
    assert s["total_output_tokens"] == sum(r.output_len for r in want.paced)
    assert s["total_input_tokens"] == sum(len(r.prompt_ids) for r in want.paced)
    assert [q["output_tokens"] for q in run["requests"]] == [r.output_len for r in want.paced]
    assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
