"""Tandem and vLLM through the OpenAI API at several concurrencies, in one run, with a plot.

:mod:`openai_bench` at each ``--concurrency`` in turn: each system's server
(``--systems``; Tandem disaggregated, Tandem colocated, ``vllm serve``) is started
once, as ``openai_bench.py`` starts it, and ``vllm bench serve`` runs against it
at every concurrency, the same seed (the same prompts) for every system and
another at each concurrency (``--seed + 1000 x concurrency``: the prompts of one
point are not served from the prefix caches the previous points filled);
``max(--num-prompts, 2 x concurrency)`` prompts at each, as many warm-ups as the
concurrency. With ``--interleave`` every server is started first and the systems
take turns at each concurrency (the first system of the turn rotating), so a
machine whose speed drifts over minutes slows every system's point alike rather
than whichever system ran during the slow minutes; the idle servers' background
threads then run beside each measured one. Writes one JSON (every run's record as ``openai_bench.py`` keeps it,
plus the machine's CPU and ISA flags) and a PNG beside it: output tokens/s, mean
TPOT and mean TTFT against concurrency, one line per system.

    make peers     # once: the vLLM venv and the Hugging Face export in .peers/
    .venv/bin/python benchmarks/openai_sweep.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai_bench as ob  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated")
    p.add_argument("--interleave", action="store_true",
                   help="start every server first, then take turns at each concurrency")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --interleave: every point this many times (turns rotating each "
                        "round, round r's prompts from seed + r), its requests pooled into one "
                        "summary")
    args, rest = p.parse_known_args(argv)
    bench = ob.parse_args(rest)
    bench.interleave, bench.rounds = args.interleave, args.rounds
    if args.rounds < 1 or (args.rounds > 1 and not args.interleave):
        p.error("--rounds: at least 1, and more than 1 only with --interleave")
    bench.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if "--out" not in rest:
        bench.out = str(ob.REPO / "benchmarks" / "results" / f"openai_sweep_{bench.dtype}.json")
    return bench


def run_point(system: str, server, c: int, args, workdir: Path, suffix: str = "") -> dict:
    """``vllm bench serve`` at concurrency ``c`` against ``system``'s running server:
    its record (``error`` instead of a summary when the client failed)."""
    a = copy.copy(args)
    a.max_concurrency, a.num_warmups = c, c
    a.seed = point_seed(args.seed, c)
    a.num_prompts = max(args.num_prompts, 2 * c)
    run = {"system": system, "concurrency": c, "num_prompts": a.num_prompts, "seed": a.seed,
           "startup_s": server.startup_s, "server_cmd": server.cmd}
    try:
        run.update(slim(ob.run_client(system, server, a, workdir, f"_c{c}{suffix}")))
    except Exception as exc:        # recorded; the next point still runs
        run["error"] = f"{type(exc).__name__}: {exc}"
        print(f"==== {system} c={c}: FAILED {run['error'][:2000]}", flush=True)
    return run


def point_seed(seed: int, concurrency: int) -> int:
    """The prompts' seed at one concurrency: every concurrency its own prompts (the
    same for every system), so none is served from the prefix caches an earlier
    point filled (a worker that cached the last point's prompts would look fast)."""
    return seed + 1000 * concurrency


def sweep_system(system: str, args, workdir: Path) -> list[dict]:
    """Every concurrency against one server of ``system``: one record per concurrency."""
    server = ob.make_server(system, args, workdir / f"{system}.log")
    print(f"\n==== {system}: starting {' '.join(server.cmd)}", flush=True)
    runs = []
    try:
        with server:
            print(f"==== {system}: serving after {server.startup_s:.0f} s", flush=True)
            runs = [run_point(system, server, c, args, workdir) for c in args.concurrency]
    except Exception as exc:
        runs.append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
        print(f"==== {system}: FAILED {exc}", flush=True)
    return runs


def turns(systems: list[str], concurrency: list[int]) -> list[tuple[int, str]]:
    """The interleaved order: at the i-th concurrency every system once, starting
    with system ``i mod len(systems)``, so none is always first (after an idle
    wait) or always last."""
    return [(c, systems[(i + j) % len(systems)])
            for i, c in enumerate(concurrency) for j in range(len(systems))]


def pooled(rounds: list[dict]) -> dict:
    """One point's summary from its ``rounds`` (records of :func:`run_point` for the
    same system and concurrency): output tokens/s over the rounds' summed duration,
    and the TTFT and TPOT statistics over every completed request of every round,
    each request's TPOT as ``vllm bench serve`` computes it ((latency - TTFT) /
    (output tokens - 1))."""
    import statistics

    ttfts, tpots = [], []
    duration = out_tokens = completed = failed = 0
    for r in rounds:
        b = r["vllm_bench_result"]
        duration += b["duration"]
        out_tokens += b["total_output_tokens"]
        completed += b["completed"]
        failed += b["failed"]
        for ttft, latency, n, err in zip(b["ttfts"], b["latencies"], b["output_lens"], b["errors"]):
            if err or not n:
                continue
            ttfts.append(ttft * 1000)
            if n > 1:
                tpots.append((latency - ttft) * 1000 / (n - 1))

    def p99(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]
    return {"completed": completed, "failed": failed, "duration": duration,
            "total_output_tokens": out_tokens, "output_throughput": out_tokens / duration,
            "mean_ttft_ms": statistics.fmean(ttfts), "median_ttft_ms": statistics.median(ttfts),
            "p99_ttft_ms": p99(ttfts), "mean_tpot_ms": statistics.fmean(tpots),
            "median_tpot_ms": statistics.median(tpots), "p99_tpot_ms": p99(tpots),
            "rounds": len(rounds)}


def sweep_interleaved(args, workdir: Path) -> list[dict]:
    """Every server started, one after the other, then every (concurrency, system)
    point in :func:`turns` order, ``args.rounds`` times (each round's turns rotated
    by one more); the records in ``--systems`` order. With several rounds a point's
    record holds each round's record under ``rounds`` and :func:`pooled` as its
    summary."""
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for system in args.systems:
            server = ob.make_server(system, args, workdir / f"{system}.log")
            print(f"\n==== {system}: starting {' '.join(server.cmd)}", flush=True)
            try:
                servers[system] = stack.enter_context(server)
            except Exception as exc:
                runs.append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
                print(f"==== {system}: FAILED {exc}", flush=True)
                continue
            print(f"==== {system}: serving after {server.startup_s:.0f} s", flush=True)
        live = [s for s in args.systems if s in servers]
        points: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for c, system in turns(live[r % len(live):] + live[:r % len(live)], args.concurrency):
                print(f"==== round {r + 1}/{args.rounds}, c={c}: {system}", flush=True)
                # Each round its own prompts (seed + round): a repeat of the same
                # prompts would be served from the prefix caches.
                points.setdefault((system, c), []).append(run_point(
                    system, servers[system], c, copy.copy(args) if r == 0 else
                    argparse.Namespace(**{**vars(args), "seed": args.seed + r}), workdir,
                    suffix=f"_r{r}" if args.rounds > 1 else ""))
        for (system, c), rounds in points.items():
            if len(rounds) == 1:
                runs.append(rounds[0])
                continue
            ok = [r for r in rounds if "summary" in r]
            record = {"system": system, "concurrency": c, "num_prompts": rounds[0]["num_prompts"],
                      "server_cmd": rounds[0]["server_cmd"], "rounds": rounds}
            if ok:
                record["summary"] = pooled(ok)
            if len(ok) < len(rounds):
                record["error"] = f"{len(rounds) - len(ok)} of {len(rounds)} rounds failed"
            runs.append(record)
    order = {s: i for i, s in enumerate(args.systems)}
    return sorted(runs, key=lambda r: (order[r["system"]], r.get("concurrency", 0)))


KEPT_PER_REQUEST = ("ttfts", "latencies", "output_lens", "errors")


def slim(run: dict) -> dict:
    """A run's record without the per-token data (generated texts, every ITL): the
    summary, goodput and per-request TTFT, latency and length stay."""
    run = dict(run)
    run.pop("generated_texts", None)
    full = run.get("vllm_bench_result") or {}
    run["vllm_bench_result"] = {k: v for k, v in full.items()
                                if not isinstance(v, list) or k in KEPT_PER_REQUEST}
    return run


def table(runs: list[dict]) -> str:
    rows = ["| system | concurrency | out tok/s | TPOT mean / p99 (ms) | TTFT mean / p99 (ms) | ok / failed |",
            "|---|---|---|---|---|---|"]
    for r in runs:
        s = r.get("summary")
        if s is None:
            rows.append(f"| {r['system']} | {r.get('concurrency', '-')} | failed: "
                        f"{r.get('error', '?')[:60]} | | | |")
            continue
        rows.append(f"| {r['system']} | {r['concurrency']} | {ob._f(s['output_throughput'])} "
                    f"| {ob._f(s['mean_tpot_ms'])} / {ob._f(s['p99_tpot_ms'])} "
                    f"| {ob._f(s['mean_ttft_ms'])} / {ob._f(s['p99_ttft_ms'])} "
                    f"| {s['completed']} / {s['failed']} |")
    return "\n".join(rows)


def plot(report: dict, path: Path) -> None:
    """Output tokens/s, mean TPOT and mean TTFT vs concurrency (log x), one line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r.get("summary")]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, (("output_throughput", "output tokens/s"),
                                       ("mean_tpot_ms", "mean TPOT (ms)"),
                                       ("mean_ttft_ms", "mean TTFT (ms)"))):
        for system in systems:
            pts = sorted((r["concurrency"], r["summary"][key]) for r in runs if r["system"] == system)
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    m = report["machine"]
    isa = " ".join(f for f in m.get("cpu_flags", []) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    r = report["workload"].get("input_range_ratio") or 0.0
    prompts = (f"{report['workload']['input_len']}-token" if not r else
               f"{round(report['workload']['input_len'] * (1 - r))}-"
               f"{round(report['workload']['input_len'] * (1 + r))}-token")
    fig.suptitle(f"{report['dtype']}, {prompts} prompts, "
                 f"{report['workload']['output_len']} output tokens; {m.get('cpu')} x{m.get('cores')} ({isa})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "vllm" in args.systems and not Path(args.hf_model, "config.json").is_file():
        print(f"{args.hf_model}: no checkpoint; run `make peers`", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="openai_sweep_"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.interleave:
        runs = sweep_interleaved(args, workdir)
    else:
        runs = [r for s in args.systems for r in sweep_system(s, args, workdir)]
    report = {"command": [Path(sys.executable).name, *sys.argv],
              "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
              "wall_s": time.time() - t0, "workdir": str(workdir), "machine": ob.versions(args),
              "workload": {"dataset": "random", "input_len": args.input_len,
                           "input_range_ratio": args.input_range_ratio, "output_len": args.output_len,
                           "num_prompts": f"max({args.num_prompts}, 2 x concurrency)",
                           "concurrency": args.concurrency, "request_rate": "inf", "ignore_eos": True,
                           "temperature": 0, "seed": f"{args.seed} + 1000 x concurrency" + (" + round" if args.rounds > 1 else ""),
                           "order": "interleaved" if args.interleave else "one system after the other",
                           "rounds": args.rounds},
              "dtype": args.dtype, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"\n{args.dtype}:\n\n{table(runs)}\n\nwrote {out} and {out.with_suffix('.png')}; "
          f"whole run {report['wall_s']:.0f} s")
    return 0 if all("summary" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
