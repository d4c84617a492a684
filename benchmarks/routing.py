"""Routing benchmarks against ``tandem serve``: KV-aware vs least-loaded routing, and
recovery after a decode worker is killed.

Both start the server with serve.py's :class:`ServerProcess` and measure it through
gRPC with serve.py's client (:func:`run_load`, :func:`summarize`): same metrics,
same definitions (see serve.py's docstring).

``policies``: for each routing policy in turn (``--policies``, default
``least_loaded,prefix_aware``), ``tandem serve --mode colocated --num-decode 2``
(two workers that prefill for themselves) with ``--num-blocks`` KV blocks per
worker, then the same seeded workload: ``--num-prefixes`` distinct prefixes of
``--prefix-len`` tokens, each request one of them plus a distinct suffix, Poisson
arrivals at ``--request-rate``. The defaults size the pool so that one worker
cannot hold every prefix but can hold half of them: a router that keeps each
prefix on one worker finds it cached, one that spreads requests by load evicts
what it will need next. Before and after the measured requests it scrapes the
router's ``/metrics`` for ``tandem:prefix_cache_hits_total`` and
``tandem:prefix_cache_queries_total`` per worker (tokens; a request that waits
is looked up again at each try, and every lookup counts) and reports their
increase; the client side's own count is the prompt tokens the responses say
came from the cache (``usage.cached_tokens``).

``recovery``: ``tandem serve --mode disaggregated --num-prefill 1 --num-decode 2``;
a steady load, and ``--kill-after`` seconds after the first request
``SIGKILL`` to the victim decode worker's process (its pid from the cluster state
in Redis, whose URL the server's banner prints). Reports the failed requests
(the router moves a dead worker's requests to another one), the longest
client-visible stall of the streams in flight at the kill, TTFT/ITL of the run,
and the seconds from the kill until the cluster state lists the worker as dead
and then alive again under a newer generation.

Usage::

    python benchmarks/routing.py policies --out benchmarks/results/routing_float32.json
    python benchmarks/routing.py recovery --out benchmarks/results/recovery_float32.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import (RequestRecord, ServerProcess, _descendants, _jsonable, _ms, _num,  # noqa: E402
                   _request_row, check_fits, free_port, model_info, random_workload, run_load,
                   shared_prefix_workload, summarize)

POLICIES = ("least_loaded", "prefix_aware")
BANNER_REDIS = re.compile(r"\(cluster state (redis://\S+?)\)")
PREFIX_HITS, PREFIX_QUERIES = "tandem:prefix_cache_hits_total", "tandem:prefix_cache_queries_total"
MIGRATIONS, RESTARTS = "tandem:request_migrations_total", "tandem:worker_restarts_total"


# --------------------------------------------------------------------------- server helpers


def cli_wrapper(directory: Path) -> str:
    """An executable that runs ``python -m tandem.router.cli`` with this interpreter, so
    the server runs the same installation as the benchmark whatever an installed
    ``tandem`` script's shebang names."""
    path = directory / "tandem"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tandem.router.cli "$@"\n')
    path.chmod(0o755)
    return str(path)


def scrape_counters(metrics_port: int, names: tuple[str, ...], timeout_s: float = 5.0
                    ) -> dict[str, dict[str, float]]:
    """``{sample name: {worker label: value}}`` of the named samples on the router's
    ``/metrics`` (``tandem:..._total`` counters; a sample without a worker label is
    keyed ``""``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {n: {} for n in names}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name][s.labels.get("worker", "")] = s.value
    return out


def counter_increase(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                     ) -> dict[str, dict[str, float]]:
    return {n: {w: v - before.get(n, {}).get(w, 0.0) for w, v in ws.items()} for n, ws in after.items()}


def settled_counters(metrics_port: int, names: tuple[str, ...], settle_s: float = 1.0,
                     timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """Counters once two scrapes ``settle_s`` apart agree (worker stats reach the router
    with the steps after the last request's tokens), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = scrape_counters(metrics_port, names)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = scrape_counters(metrics_port, names)
        if now == last:
            return now
        last = now
    return last


def redis_url_from_log(server: ServerProcess, timeout_s: float = 30.0) -> str:
    """The cluster state's URL from the server's banner in its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = BANNER_REDIS.search(server.log_tail(100_000))
        if m:
            return m.group(1)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no '(cluster state redis://...)' banner in {server.log_path}:\n"
                               f"{server.log_tail()}")
        time.sleep(0.2)


def warm_up(endpoint: str, n: int, seed: int, timeout_s: float, tag: str) -> None:
    """``n`` short random requests at once, from a seed of their own, so that no measured
    prompt is cached by them; every worker gets to run its first steps."""
    if n <= 0:
        return
    recs = asyncio.run(run_load(endpoint, random_workload(n, (16, 256), (4, 8), seed), math.inf, 1.0, 0,
                                None, 0.0, timeout_s, tag))
    if not all(r.success for r in recs):
        raise SystemExit(f"warm-up failed: {sorted({r.error for r in recs})}")


def _machine(args, argv: list[str] | None) -> dict:
    return {"command": " ".join(sys.argv if argv is None else ["benchmarks/routing.py", *argv]),
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "machine": platform.machine(), "num_cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_jsonable(result), f, indent=1, allow_nan=False)


# --------------------------------------------------------------------------- policies


def hit_rate(increase: dict[str, dict[str, float]]) -> dict:
    """Prefix-cache hit rate (tokens) overall and per worker from counter increases."""
    hits, queries = increase.get(PREFIX_HITS, {}), increase.get(PREFIX_QUERIES, {})
    per_worker = {w: {"hit_tokens": hits.get(w, 0.0), "queried_tokens": q,
                      "hit_rate": hits.get(w, 0.0) / q if q else None}
                  for w, q in sorted(queries.items())}
    total_q, total_h = sum(queries.values()), sum(hits.values())
    return {"hit_tokens": total_h, "queried_tokens": total_q,
            "hit_rate": total_h / total_q if total_q else None, "per_worker": per_worker}


def run_policy(policy: str, args, bin_path: str, log_dir: Path) -> dict:
    metrics_port = free_port()
    serve_args = ("--num-decode", str(args.num_workers), "--routing-policy", policy,
                  "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
                  "--metrics-port", str(metrics_port))
    server = ServerProcess("colocated", log_dir / f"serve-{policy}.log", bin_path, args.dtype,
                           serve_args=serve_args, ready_timeout_s=args.server_timeout)
    print(f"starting: {' '.join(server.cmd)}  (log {server.log_path})", flush=True)
    t = time.perf_counter()
    with server:
        print(f"{policy}: serving after {time.perf_counter() - t:.1f} s", flush=True)
        info = asyncio.run(model_info(server.endpoint))
        workload = shared_prefix_workload(args.num_prompts, args.prefix_len, tuple(args.suffix_len),
                                          tuple(args.output_len), args.seed, args.num_prefixes)
        check_fits(workload, info)
        warm_up(server.endpoint, args.num_warmup, args.seed - 1, args.request_timeout, f"warmup-{policy}")
        names = (PREFIX_HITS, PREFIX_QUERIES)
        before = settled_counters(metrics_port, names)
        load_before = os.getloadavg()[0]
        records = asyncio.run(run_load(server.endpoint, workload, args.request_rate, args.burstiness,
                                       args.seed, None, 0.0, args.request_timeout, policy))
        load_after = os.getloadavg()[0]
        increase = counter_increase(before, settled_counters(metrics_port, names))
    s = summarize(records)
    cache = hit_rate(increase)
    cache["client_cached_tokens"] = s["total_cached_tokens"]
    cache["client_prompt_tokens"] = s["total_input_tokens"]
    cache["client_cached_fraction"] = (s["total_cached_tokens"] / s["total_input_tokens"]
                                       if s["total_input_tokens"] else None)
    run = {"policy": policy, "endpoint": server.endpoint, "seed": args.seed,
           "loadavg_1min_before_after": [load_before, load_after],
           "model": {"name": info.model_name, "dtype": info.dtype, "max_model_len": info.max_model_len,
                     "block_size": info.block_size},
           "summary": s, "prefix_cache": cache, "requests": request_rows(records)}
    print_policy_run(run)
    return run


def print_policy_run(run: dict) -> None:
    s, c = run["summary"], run["prefix_cache"]
    la = run["loadavg_1min_before_after"]
    print(f"\n==== {run['policy']} ====  ok {s['num_completed']}/{s['num_requests']}  "
          f"duration {s['duration_s']:.1f} s  load avg {la[0]:.2f} -> {la[1]:.2f}")
    if s["errors"]:
        print(f"errors: {s['errors'][:3]}")
    for w, pw in c["per_worker"].items():
        print(f"  {w}: prefix cache {pw['hit_tokens']:.0f} / {pw['queried_tokens']:.0f} tokens "
              f"(hit rate {_num(pw['hit_rate'], '.3f')})")
    print(f"  responses: {c['client_cached_tokens']} of {c['client_prompt_tokens']} prompt tokens cached")


def policies_table(runs: list[dict]) -> str:
    head = ("| policy | ok | TTFT p50 / p90 / p99 (ms) | ITL p50 (ms) | out tok/s | req/s "
            "| prefix-cache hit rate (server) | cached prompt tokens (responses) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        s, c, t = run["summary"], run["prefix_cache"], run["summary"]["ttft_s"]
        frac = c["client_cached_fraction"]
        lines.append(
            f"| {run['policy']} | {s['num_completed']}/{s['num_requests']} "
            f"| {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | {_ms(s['itl_s']['p50'])} "
            f"| {_num(s['output_throughput'], '.1f')} | {_num(s['request_throughput'])} "
            f"| {_num(c['hit_rate'], '.3f')} | {'-' if frac is None else f'{frac:.3f}'} |")
    return "\n".join(lines)


def cmd_policies(args, argv: list[str] | None = None) -> int:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-routing-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    bin_path = args.tandem_bin or cli_wrapper(log_dir)
    runs = [run_policy(p, args, bin_path, log_dir) for p in args.policies]
    print("\n" + policies_table(runs))
    _write(args.out, {**_machine(args, argv), "runs": runs})
    return 0 if all(r["summary"]["num_failed"] == 0 for r in runs) else 1


# --------------------------------------------------------------------------- recovery


class StateWatcher(threading.Thread):
    """Polls the cluster state every ``interval_s`` and notes (``time.perf_counter()``)
    when ``worker_id`` is first seen dead and first seen alive under a generation
    above ``old_generation``."""

    def __init__(self, url: str, worker_id: str, old_generation: int, interval_s: float = 0.1):
        super().__init__(daemon=True, name="state-watcher")
        from tandem.control.state import ClusterState

        self.state = ClusterState(url)
        self.worker_id, self.old_generation, self.interval_s = worker_id, old_generation, interval_s
        self.seen_dead: float | None = None
        self.back: float | None = None
        self.new_record = None
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set() and self.back is None:
                try:
                    rec = next((r for r in self.state.workers() if r.worker_id == self.worker_id), None)
                except Exception as exc:   # Redis unreachable for a moment: note it, keep polling
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    rec = None
                now = time.perf_counter()
                if rec is not None:
                    if self.seen_dead is None and (not rec.alive or rec.generation > self.old_generation):
                        self.seen_dead = now
                    if rec.alive and rec.generation > self.old_generation:
                        self.back, self.new_record = now, rec
                self._halt.wait(self.interval_s)
        finally:
            self.state.close()

    def stop(self) -> None:
        self._halt.set()


def stall_at(r: RequestRecord, t: float) -> float | None:
    """The gap between the last token before ``t`` and the first one after it; None for a
    stream without tokens on both sides of ``t``."""
    before = [x for x in r.chunk_times if x <= t]
    after = [x for x in r.chunk_times if x > t]
    return after[0] - before[-1] if before and after else None


def kill_report(records: list[RequestRecord], t_kill: float) -> dict:
    """What the streams in flight at ``t_kill`` saw."""
    in_flight = [r for r in records if r.start <= t_kill and (r.end == 0.0 or r.end > t_kill)]
    streaming = [r for r in in_flight if r.chunk_times and r.chunk_times[0] <= t_kill]
    stalls = [x for r in streaming if (x := stall_at(r, t_kill)) is not None]
    widest = [max(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))
              for r in in_flight if len(r.chunk_times) > 1]
    untouched = [r for r in records if r not in in_flight and r.success and len(r.chunk_times) > 1]
    other_itls = sorted(b - a for r in untouched for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    waiting_ttft = [r.chunk_times[0] - r.start for r in in_flight if r not in streaming and r.chunk_times]
    per_stream = []
    for i, r in enumerate(records):
        if r in streaming:
            n_before = sum(k for x, k in zip(r.chunk_times, r.chunk_tokens) if x <= t_kill)
            later = [x for x in r.chunk_times if x > t_kill]
            per_stream.append({"request": i, "tokens_before_kill": n_before, "stall_s": stall_at(r, t_kill),
                               "next_gaps_s": [b - a for a, b in zip(later, later[1:4])]})
    return {
        "num_in_flight": len(in_flight), "num_streaming": len(streaming),
        "num_in_flight_failed": sum(1 for r in in_flight if not r.success),
        # The gap that spans the kill, per stream that had tokens before and after it.
        "stall_spanning_kill_s": {"max": max(stalls, default=None),
                                  "sorted": sorted(stalls, reverse=True)},
        # The widest gap anywhere in each in-flight stream.
        "max_itl_in_flight_s": max(widest, default=None),
        "max_itl_not_in_flight_s": other_itls[-1] if other_itls else None,
        "ttft_in_flight_without_token_s": sorted(waiting_ttft, reverse=True),
        # Per stream that had tokens at the kill: the gap across it and the next three.
        "streams_at_kill": sorted(per_stream, key=lambda x: -(x["stall_s"] or 0.0)),
    }


def request_rows(records: list[RequestRecord], t0: float | None = None) -> list[dict]:
    """serve.py's per-request rows plus ``start_s``, the send time after ``t0`` (default:
    the first send)."""
    if t0 is None:
        t0 = min((r.start for r in records), default=0.0)
    return [dict(_request_row(r), start_s=r.start - t0) for r in records]


def cmd_recovery(args, argv: list[str] | None = None) -> int:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-recovery-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    bin_path = args.tandem_bin or cli_wrapper(log_dir)
    metrics_port = free_port()
    serve_args = ("--num-prefill", str(args.num_prefill), "--num-decode", str(args.num_decode),
                  "--metrics-port", str(metrics_port))
    server = ServerProcess("disaggregated", log_dir / "serve-recovery.log", bin_path, args.dtype,
                           serve_args=serve_args, ready_timeout_s=args.server_timeout)
    print(f"starting: {' '.join(server.cmd)}  (log {server.log_path})", flush=True)
    t = time.perf_counter()
    from tandem.control.state import ClusterState

    with server:
        print(f"serving after {time.perf_counter() - t:.1f} s", flush=True)
        url = redis_url_from_log(server)
        state = ClusterState(url)
        try:
            workers_before = state.workers()
        finally:
            state.close()
        victim = next((w for w in workers_before if w.worker_id == args.victim), None)
        if victim is None or not victim.alive:
            raise SystemExit(f"{args.victim} not alive in the cluster state: {workers_before}")
        pid = int(victim.info["pid"])
        if pid not in _descendants(server.proc.pid):
            raise SystemExit(f"{args.victim}'s pid {pid} is not a process of this server")
        print(f"cluster state {url}: " + ", ".join(f"{w.worker_id} (gen {w.generation}, pid "
                                                   f"{w.info.get('pid')})" for w in workers_before))
        info = asyncio.run(model_info(server.endpoint))
        workload = random_workload(args.num_prompts, tuple(args.prompt_len), (args.output_len, args.output_len),
                                   args.seed)
        check_fits(workload, info)
        warm_up(server.endpoint, args.num_warmup, args.seed - 1, args.request_timeout, "warmup")
        names = (MIGRATIONS, RESTARTS)
        counters_before = settled_counters(metrics_port, names)
        watcher = StateWatcher(url, args.victim, victim.generation)
        kill: dict = {}

        async def load_and_kill() -> list[RequestRecord]:
            task = asyncio.create_task(run_load(server.endpoint, workload, args.request_rate,
                                                args.burstiness, args.seed, None, 0.0,
                                                args.request_timeout, "recovery"))
            await asyncio.sleep(args.kill_after)
            watcher.start()
            kill["t"] = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            print(f"SIGKILL {args.victim} (pid {pid}) {args.kill_after:.1f} s into the load", flush=True)
            return await task

        load_before = os.getloadavg()[0]
        try:
            records = asyncio.run(load_and_kill())
            load_after = os.getloadavg()[0]
            deadline = time.monotonic() + args.recovery_timeout
            while watcher.back is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            watcher.stop()
            watcher.join(10)
        counters = counter_increase(counters_before, settled_counters(metrics_port, names))
        # One request once the pool is whole again: does the cluster still serve?
        after = asyncio.run(run_load(server.endpoint, random_workload(1, (32, 32), (8, 8), args.seed + 1),
                                     math.inf, 1.0, 0, None, 0.0, args.request_timeout, "after"))[0]
    t_kill = kill["t"]
    s = summarize(records)

    def rel(x: float | None) -> float | None:
        return None if x is None else x - t_kill
    recovery = {
        "victim": args.victim, "pid": pid, "old_generation": victim.generation,
        "new_generation": watcher.new_record.generation if watcher.new_record else None,
        "new_pid": watcher.new_record.info.get("pid") if watcher.new_record else None,
        "kill_after_first_send_s": t_kill - min(r.start for r in records),
        "seen_dead_after_kill_s": rel(watcher.seen_dead),
        "back_after_kill_s": rel(watcher.back),
        "state_poll_errors": watcher.errors[:5],
        "migrations": counters[MIGRATIONS], "restarts": counters[RESTARTS],
        "request_after_recovery_ok": after.success, "request_after_recovery_error": after.error,
        **kill_report(records, t_kill),
    }
    result = {**_machine(args, argv), "endpoint": server.endpoint, "redis_url": url,
              "loadavg_1min_before_after": [load_before, load_after],
              "model": {"name": info.model_name, "dtype": info.dtype, "max_model_len": info.max_model_len},
              "workers_before": [{"worker_id": w.worker_id, "role": w.role, "generation": w.generation,
                                  "pid": w.info.get("pid"), "alive": w.alive} for w in workers_before],
              "summary": s, "recovery": recovery, "requests": request_rows(records)}
    print_recovery(result)
    _write(args.out, result)
    return 0 if s["num_failed"] == 0 and recovery["back_after_kill_s"] is not None else 1


def print_recovery(result: dict) -> None:
    s, r = result["summary"], result["recovery"]
    la = result["loadavg_1min_before_after"]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"
    print(f"\n==== recovery: SIGKILL {r['victim']} ====  load avg {la[0]:.2f} -> {la[1]:.2f}")
    print(f"requests ok / failed        {s['num_completed']} / {s['num_failed']}"
          f"   wrong length {s['num_wrong_length']}")
    if s["errors"]:
        print(f"errors                      {s['errors'][:3]}")
    print(f"kill at                     {r['kill_after_first_send_s']:.2f} s after the first request; "
          f"{r['num_in_flight']} in flight ({r['num_streaming']} streaming)")
    print(f"longest stall (spans kill)  {sec(r['stall_spanning_kill_s']['max'])}"
          f"   widest gap in flight {sec(r['max_itl_in_flight_s'])}"
          f"   (others {sec(r['max_itl_not_in_flight_s'])})")
    print(f"migrations / restarts       {sum(r['migrations'].values()):.0f} / {sum(r['restarts'].values()):.0f}")
    print(f"seen dead / back after kill {sec(r['seen_dead_after_kill_s'])} / {sec(r['back_after_kill_s'])}"
          f"   generation {r['old_generation']} -> {r['new_generation']}")
    print(f"request after recovery      {'ok' if r['request_after_recovery_ok'] else r['request_after_recovery_error']}")
    print(f"TTFT p50 / p90 / p99        {_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p90'])} / "
          f"{_ms(s['ttft_s']['p99'])} ms")
    print(f"ITL  p50 / p90 / p99        {_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p90'])} / "
          f"{_ms(s['itl_s']['p99'])} ms")
    print(f"output tok/s, req/s         {_num(s['output_throughput'], '.1f')}, {_num(s['request_throughput'])}")


# --------------------------------------------------------------------------- driver


def _policies(s: str) -> list[str]:
    out = [p.strip() for p in s.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"policies from {POLICIES}, got {s!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--request-rate", type=float, default=2.0, help="req/s (Poisson unless --burstiness)")
        p.add_argument("--burstiness", type=float, default=1.0)
        p.add_argument("--num-warmup", type=int, default=4, help="untimed requests before the run")
        p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--tandem-bin", default=None,
                       help="the tandem executable (default: `python -m tandem.router.cli` of this "
                            "interpreter)")
        p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
        p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
        p.add_argument("--out", default=None, help="write the results as JSON here")

    p = sub.add_parser("policies", help="KV-aware vs least-loaded routing")
    common(p)
    p.add_argument("--policies", type=_policies, default=list(POLICIES))
    p.add_argument("--num-workers", type=int, default=2, help="colocated workers")
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 16], metavar=("MIN", "MAX"))
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("recovery", help="a decode worker killed under load")
    common(p)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--victim", default="decode-0", help="worker id to SIGKILL")
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds after the first request")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--recovery-timeout", type=float, default=180.0,
                   help="seconds to wait after the load for the victim to be back")
    p.set_defaults(func=cmd_recovery)
    args = ap.parse_args(argv)
    if not args.request_rate > 0:
        ap.error("--request-rate must be > 0 (inf sends all at once)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args, argv)


if __name__ == "__main__":
    sys.exit(main())
