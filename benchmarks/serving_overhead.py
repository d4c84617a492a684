"""What the serving path adds to the engine's decode step, on one machine, in one run.

Two measurements of the same work, a steady batch of ``--num-streams`` greedy
requests (random prompts of ``--prompt-len`` tokens, ``--output-len`` tokens each,
EOS ignored), one after the other:

* **offline**: one :class:`~tandem.engine.llm.LLM` in this process (the engine
  ``tandem serve`` builds, same dtype and threads) runs the requests step by step;
  the decode step time is each step's wall time while every request is decoding.
* **served**: ``tandem serve`` (``--mode``, default colocated, ``--cpu-affinity``)
  gets the same requests at once as streaming HTTP ``/v1/completions`` (token-id
  prompts, ``stream: true``); the client's inter-token gap is the time between
  two consecutive SSE events of a stream while every stream is decoding.

It reports both distributions, their p50 ratio (served / offline: 1.0 means the
serving path costs nothing), and the server's own view from its ``/metrics``
(engine step time, step delivery to the router, inter-token latency), then stops
the server. Several ``--rounds`` alternate the two, so drifting machine load falls
on both.

    .venv/bin/python benchmarks/serving_overhead.py --dtype bfloat16 --out benchmarks/results/serving_overhead_bf16.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_bench import MODEL_NAME, tandem_server, versions  # noqa: E402
from serve import _descendants  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn from the vocabulary's ordinary range."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def offline_decode_steps(llm, prompts: list[list[int]], output_len: int) -> list[float]:
    """Wall times (seconds) of the engine steps in which every request decodes."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    reqs = [r for p in prompts for r in llm.engine.add_request(p, params)]
    times = []
    while llm.engine.has_unfinished_requests():
        decoding = all(r.output_token_ids and not r.is_finished for r in reqs)
        t0 = time.perf_counter()
        llm.engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    return times


def _stream(port: int, prompt: list[int], output_len: int, arrivals: list[float],
            errors: list[str], start: threading.Barrier) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        start.wait()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            errors.append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            return
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if event.get("choices"):
                arrivals.append(time.perf_counter())
    except Exception as exc:     # reported, the run goes on
        errors.append(repr(exc))
    finally:
        conn.close()


def served_gaps(port: int, prompts: list[list[int]], output_len: int) -> list[float]:
    """Inter-token gaps (seconds) the streaming clients see while every stream decodes."""
    arrivals = [[] for _ in prompts]
    errors: list[str] = []
    start = threading.Barrier(len(prompts))
    threads = [threading.Thread(target=_stream, args=(port, p, output_len, a, errors, start))
               for p, a in zip(prompts, arrivals)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"streams failed: {errors}")
    lo = max(a[0] for a in arrivals)         # every stream has its first token
    hi = min(a[-1] for a in arrivals)        # no stream has finished
    return [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if a >= lo and b <= hi]


def scrape(port: int) -> dict[str, float]:
    """Mean and p50 (interpolated in the buckets, as PromQL's histogram_quantile) of
    the server's step and latency histograms, summed over workers (seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base.endswith(("_sum", "_count")):
            sums[base] = sums.get(base, 0.0) + float(value)
        elif base.endswith("_bucket"):
            le = float(name.split('le="', 1)[1].split('"', 1)[0])
            b = buckets.setdefault(base.removesuffix("_bucket"), {})
            b[le] = b.get(le, 0.0) + float(value)
    out = {}
    for h in ("tandem:engine_step_seconds", "tandem:step_delivery_seconds",
              "tandem:inter_token_latency_seconds"):
        n = sums.get(h + "_count", 0.0)
        if not n:
            continue
        short = h.split(":", 1)[1]
        out[short + "_mean"] = sums[h + "_sum"] / n
        cum = sorted(buckets.get(h, {}).items())
        prev_le, prev_c = 0.0, 0.0
        for le, c in cum:
            if c >= n / 2:
                out[short + "_p50"] = prev_le + (le - prev_le) * (n / 2 - prev_c) / max(c - prev_c, 1e-9)
                break
            prev_le, prev_c = le, c
    return out


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first.split(".", 1)[0].split(" ", 1)[0]   # ray::DecodeWorker, ray::IDLE, ...
    if "python" in Path(first).name and len(argv) > 2:
        return " ".join(a.decode(errors="replace") for a in argv[1:4])
    return Path(first).name


def cpu_times(root: int) -> dict[tuple[str, str], float]:
    """CPU seconds (user + system) so far of ``root`` and every descendant, per
    (process name, thread name): the server's router, Ray's daemons, Redis and
    the workers, each thread apart."""
    out: dict[tuple[str, str], float] = {}
    for pid in [root, *_descendants(root)]:
        name = _name(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            key = (f"{name} [{pid}]", comm)
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def cpu_report(before: dict, after: dict, wall_s: float) -> list[dict]:
    """Cores used per process (and its busiest threads) between two :func:`cpu_times`."""
    procs: dict[str, dict[str, float]] = {}
    for (proc, thread), t in after.items():
        used = (t - before.get((proc, thread), 0.0)) / wall_s
        if used > 0:
            procs.setdefault(proc, {})[thread] = procs.setdefault(proc, {}).get(thread, 0.0) + used
    rows = [{"process": p, "cores": round(sum(th.values()), 3),
             "threads": {k: round(v, 3) for k, v in sorted(th.items(), key=lambda kv: -kv[1])[:6]}}
            for p, th in procs.items()]
    return sorted(rows, key=lambda r: -r["cores"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    p.add_argument("--num-streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-affinity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tandem-model", default=None)
    p.add_argument("--tandem-arg", action="append", default=[])
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--workdir", default="/tmp/tandem-serving-overhead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from tandem.engine.llm import LLM

    prompts = random_prompts(args.num_streams, args.prompt_len, args.seed)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.tandem_model, dtype=args.dtype, num_threads=len(os.sched_getaffinity(0)))
    offline_decode_steps(llm, prompts, 8)                       # warm-up
    offline, served, server_view = [], [], {}
    with tandem_server(args.mode, args, workdir / "tandem.log") as srv:
        served_gaps(srv.port, prompts, 8)                       # warm-up
        served_wall, served_cpu = 0.0, {}
        for r in range(args.rounds):
            offline += offline_decode_steps(llm, prompts, args.output_len)
            before, t0 = cpu_times(srv.proc.pid), time.monotonic()
            served += served_gaps(srv.port, prompts, args.output_len)
            wall = time.monotonic() - t0
            after = cpu_times(srv.proc.pid)
            for k, v in after.items():
                served_cpu[k] = served_cpu.get(k, 0.0) + v - before.get(k, 0.0)
            served_wall += wall
            print(f"round {r + 1}: offline step p50 {pct(offline, .5) * 1e3:.1f} ms, "
                  f"served gap p50 {pct(served, .5) * 1e3:.1f} ms", flush=True)
        server_view = scrape(srv.port)
    result = {
        "dtype": args.dtype, "mode": args.mode, "num_streams": args.num_streams,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
        "machine": versions(argparse.Namespace(systems=args.mode)),
        "offline_step_ms": {q: pct(offline, v) * 1e3 for q, v in (("p10", .1), ("p50", .5), ("p90", .9))},
        "served_gap_ms": {q: pct(served, v) * 1e3 for q, v in (("p10", .1), ("p50", .5), ("p90", .9))},
        "num_offline_steps": len(offline), "num_served_gaps": len(served),
        "offline_step_mean_ms": statistics.fmean(offline) * 1e3,
        "served_gap_mean_ms": statistics.fmean(served) * 1e3,
        "ratio_p50": pct(served, .5) / pct(offline, .5),
        "ratio_mean": statistics.fmean(served) / statistics.fmean(offline),
        "server_metrics_s": server_view,
        "served_cpu_cores": cpu_report({}, served_cpu, served_wall),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
