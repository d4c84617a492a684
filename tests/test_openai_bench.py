"""benchmarks/openai_bench.py without vLLM: goodput counting, the client's command,
the report, and starting/stopping a server process group (a stand-in HTTP server)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_openai", ROOT / "benchmarks" / "openai_bench.py")
ob = importlib.util.module_from_spec(_spec)
sys.modules["bench_openai"] = ob
_spec.loader.exec_module(ob)


def test_goodput_counts_as_vllm_bench_serve_does():
    result = {"duration": 10.0,
              "ttfts": [0.5, 0.5, 1.5, 0.2, 0.9, None],
              "latencies": [6.7, 7.0, 2.0, 0.2, 20.0, 0.0],
              "output_lens": [64, 64, 64, 1, 64, 0],
              "errors": ["", "", "", "", "", "timeout"]}
    # TPOT = (latency - ttft) / 63: 98 ms, 103 ms, 7.9 ms (TTFT too slow), 0 (one token), 303 ms
    assert ob.goodput(result, 1000, 100) == pytest.approx(2 / 10)
    assert ob.goodput(result, 1000, 110) == pytest.approx(3 / 10)
    assert ob.goodput(result, 2000, 400) == pytest.approx(5 / 10)
    assert ob.goodput({"duration": 0, "ttfts": []}, 1000, 100) is None


def test_client_command_and_defaults():
    args = ob.parse_args(["--num-prompts", "8", "--slo-ttft-ms", "1200"])
    assert args.systems == list(ob.SYSTEMS) and args.dtype == "float32"
    assert args.num_warmups == args.max_concurrency == 4
    assert args.out.endswith("benchmarks/results/openai_bench_float32.json")
    cmd = ob.bench_cmd("http://127.0.0.1:8000", Path("/tmp/x"), "r.json", "vllm", args)
    assert cmd[:4] == [args.vllm_python, ob.VLLM_CLI, "bench", "serve"]

    def flag(name, n=1):
        i = cmd.index(name)
        return cmd[i + 1] if n == 1 else cmd[i + 1:i + 1 + n]
    assert flag("--backend") == "openai" and flag("--endpoint") == "/v1/completions"
    assert flag("--model") == "SmolLM2-135M-Instruct" and flag("--tokenizer") == str(ROOT / ".peers" / "smollm2-hf")
    assert (flag("--random-input-len"), flag("--random-output-len"), flag("--num-prompts"),
            flag("--max-concurrency")) == ("256", "64", "8", "4")
    assert flag("--goodput", 2) == ["ttft:1200", "tpot:150"]
    assert flag("--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert {"--ignore-eos", "--save-result", "--save-detailed"} <= set(cmd)
    with pytest.raises(SystemExit):
        ob.parse_args(["--systems", "tandem,sglang"])


def test_each_tandem_system_gets_its_serve_flags(tmp_path):
    args = ob.parse_args(["--max-prefill-queue-tokens", "512", "--systems",
                          "tandem-disaggregated,tandem-disaggregated-remote,tandem-colocated,"
                          "tandem-disaggregated-pinned"])

    def serve_flags(system):
        cmd = ob.make_server(system, args, tmp_path / "log").cmd
        return cmd[cmd.index("serve") + 1:]

    def value(flags, name):
        return flags[flags.index(name) + 1] if name in flags else None
    disagg, remote, coloc, pinned = (serve_flags(s) for s in args.systems)
    assert value(disagg, "--mode") == "disaggregated" and "--lend-idle-cores" in disagg
    assert value(disagg, "--max-prefill-queue-tokens") == "512"
    assert "--prefer-local-prefill" in disagg
    assert value(remote, "--mode") == "disaggregated" and "--lend-idle-cores" in remote
    assert "--max-prefill-queue-tokens" not in remote and "--prefer-local-prefill" not in remote
    assert value(coloc, "--mode") == "colocated" and "--cpu-affinity" in coloc
    # No prefill worker to choose.
    assert "--max-prefill-queue-tokens" not in coloc and "--prefer-local-prefill" not in coloc
    off = ob.parse_args(["--no-prefer-local-prefill"])
    assert "--prefer-local-prefill" not in ob.make_server(
        "tandem-disaggregated", off, tmp_path / "log").cmd
    assert "--cpu-affinity" in pinned and "--lend-idle-cores" not in pinned


def test_cpu_list_matches_affinity():
    cores = sorted(os.sched_getaffinity(0))
    listed = []
    for part in ob.cpu_list().split(","):
        lo, _, hi = part.partition("-")
        listed += range(int(lo), int(hi or lo) + 1)
    assert listed == cores


def _summary(**kw):
    s = {k: 1.0 for k in ob.SUMMARY_KEYS}
    s.update(completed=4, failed=0, **kw)
    return s


def test_table_rows_failed_run_and_matching_outputs():
    runs = [{"system": "tandem-disaggregated", "summary": _summary(mean_ttft_ms=812.25),
             "loadavg_1min_before_after": [2.0, 2.1], "goodput_at": {"a": 0.5, "b": None},
             "generated_texts": ["x", "y", "z", "w"]},
            {"system": "tandem-colocated", "error": "TimeoutError: not serving"},
            {"system": "vllm", "summary": _summary(), "loadavg_1min_before_after": [2.0, 2.0],
             "goodput_at": {"a": 0.25, "b": 0.0}, "generated_texts": ["x", "y", "q", "w"]}]
    text = ob.table(runs, 1000, 100)
    lines = text.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|") == 11
    assert "| tandem-disaggregated | 4 / 0 |" in lines[2] and "812.2 / 1.0" in lines[2]
    assert "failed: TimeoutError" in lines[3]
    assert "TTFT <= 1000 ms and TPOT <= 100 ms" in text
    assert "equal to tandem-disaggregated's (same prompts, greedy): vllm 3/4." in text
    assert "| vllm | 0.250 | 0.000 |" in text and "| tandem-disaggregated | 0.500 | - |" in text


FAKE_SERVER = textwrap.dedent("""
    import http.server, json, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)      # a server slow to stop
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "SmolLM2-135M-Instruct"}]}).encode()
            self.send_response(200 if self.path in ("/v1/models", "/health") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    return ob._proc_stat(pid) is not None          # None: gone, or a zombie


def test_server_ready_then_whole_group_stopped(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = ob.free_port()
    server = ob.Server("fake", [sys.executable, str(script), str(port)], dict(os.environ),
                       tmp_path / "fake.log", port, ready_timeout_s=30, grace_s=0.5, term_s=0.5)
    with server:
        assert server.startup_s is not None and server.startup_s < 30
        pid = server.proc.pid
        child = int((tmp_path / "fake.log").read_text().split()[0])
        assert _alive(pid) and _alive(child)
    deadline = time.monotonic() + 5
    while (_alive(pid) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and not _alive(child)


def test_server_that_exits_is_reported_with_its_log(tmp_path):
    port = ob.free_port()
    server = ob.Server("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                       dict(os.environ), tmp_path / "b.log", port, ready_timeout_s=30)
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*no model here"):
        with server:
            pass


def test_server_whose_port_was_taken_starts_again_on_another(tmp_path):
    """The picked port taken before the server binds it: a new port, the same command."""
    script = tmp_path / "fake_server.py"       # without the child and the deaf SIGTERM
    script.write_text("\n".join(line for line in FAKE_SERVER.splitlines()
                                 if not line.startswith(("signal.signal", "child", "print(child"))))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))       # bound, not listening: connections refused
        port = taken.getsockname()[1]
        server = ob.Server("fake", [sys.executable, str(script), "--port", str(port)],
                           dict(os.environ), tmp_path / "fake.log", port, ready_timeout_s=30,
                           grace_s=0.5, term_s=0.5, port_flag="--port")
        # The fake server reads its port as the last argument.
        with server:
            assert server.port != port
            assert server.cmd[-2:] == ["--port", str(server.port)]
            assert server._get("/health")[0] == 200
    # Without a port option nothing is retried: the bind error is the failure.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))       # bound, not listening: connections refused
        port = taken.getsockname()[1]
        server = ob.Server("fake", [sys.executable, str(script), str(port)], dict(os.environ),
                           tmp_path / "fake2.log", port, ready_timeout_s=30, grace_s=0.5,
                           term_s=0.5)
        with pytest.raises(RuntimeError, match="(?s)exited with 1.*Address already in use"):
            with server:
                pass


def test_client_report_is_the_result_block():
    log = "\n".join(["Starting initial single prompt test run...", "noise",
                     "============ Serving Benchmark Result ============",
                     "Successful requests:                     8",
                     "---------------Time to First Token----------------",
                     "Mean TTFT (ms):                          5805.54",
                     "==================================================",
                     "nanobind: leaked 4 instances!"])
    report = ob.client_report(log).splitlines()
    assert report[0].startswith("=") and "Serving Benchmark Result" in report[0]
    assert report[-1] == "=" * 50 and len(report) == 5
    assert ob.client_report("no result") == ""


def test_every_point_of_a_sweep_has_its_own_prompts():
    # A point served from the prefix caches an earlier point filled would look fast.
    spec = importlib.util.spec_from_file_location(
        "bench_openai_sweep", ROOT / "benchmarks" / "openai_sweep.py")
    openai_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(openai_sweep)
    seeds = [openai_sweep.point_seed(0, c) + r for c in (1, 4, 16, 64) for r in range(2)]
    assert len(set(seeds)) == len(seeds)
