"""When disaggregation pays: long prompts arriving beside long answers, colocated vs
disaggregated on the same cores, in one run.

For each ``--modes`` entry, ``tandem serve`` (1 + 1 workers disaggregated, one
colocated worker otherwise; ``--cpu-affinity`` splits the cores between the
disaggregated pair) gets the same load through its HTTP API:

* ``--streams`` answer streams: random ``--stream-prompt-len``-token prompts,
  ``--stream-output-len`` tokens each (EOS ignored), all started at once; the
  client records every token's arrival (inter-token gaps, TPOT);
* meanwhile, one long prompt every ``--interval-s`` seconds until the streams end:
  random ``--long-prompt-len``-token prompts asking for ``--long-output-len``
  tokens (a summarisation or RAG-style request), timed to their last token.

Colocated, every long prompt's prefill runs in the same engine steps as the
streams' decodes (chunked prefill), so the streams stall while it runs;
disaggregated, it runs on the prefill worker's cores and the decode worker's
steps go on. The report gives, per mode, the streams' inter-token gap p50 / p90 /
p99 / max, their mean TPOT, the long requests' latency, and the output tokens/s of
the whole run.

    .venv/bin/python benchmarks/disagg_mix.py --dtype bfloat16 --out benchmarks/results/disagg_mix_bf16.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_bench import MODEL_NAME, tandem_server, versions  # noqa: E402
from serving_overhead import pct, random_prompts  # noqa: E402


def _post(port: int, body: dict, on_token=None) -> float:
    """POST /v1/completions (streamed when ``on_token`` is given: called with each
    event's arrival time); returns the request's latency (seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        if on_token is None:
            resp.read()
        else:
            while (line := resp.readline()):
                if line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: ") and json.loads(line[6:]).get("choices"):
                    on_token(time.perf_counter())
        return time.perf_counter() - t0
    finally:
        conn.close()


def run_load(port: int, args, seed: int) -> dict:
    streams = random_prompts(args.streams, args.stream_prompt_len, seed)
    longs = random_prompts(256, args.long_prompt_len, seed + 1)
    arrivals: list[list[float]] = [[] for _ in streams]
    errors: list[str] = []
    done = threading.Event()

    def stream(i: int) -> None:
        try:
            _post(port, {"model": MODEL_NAME, "prompt": streams[i], "stream": True,
                         "max_tokens": args.stream_output_len, "temperature": 0,
                         "ignore_eos": True}, arrivals[i].append)
        except Exception as exc:      # reported below
            errors.append(repr(exc))

    long_latency: list[float] = []

    def long_request(prompt: list[int]) -> None:
        try:
            long_latency.append(_post(port, {"model": MODEL_NAME, "prompt": prompt,
                                             "max_tokens": args.long_output_len,
                                             "temperature": 0, "ignore_eos": True}))
        except Exception as exc:
            errors.append(repr(exc))

    def long_prompts() -> None:
        threads = []
        for prompt in longs:
            if done.wait(args.interval_s):
                break
            t = threading.Thread(target=long_request, args=(prompt,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    t0 = time.perf_counter()
    feeder = threading.Thread(target=long_prompts)
    workers = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
    for t in workers:
        t.start()
    feeder.start()
    for t in workers:
        t.join()
    done.set()
    feeder.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    gaps = [b - a for arr in arrivals for a, b in zip(arr, arr[1:])]
    tpot = [(arr[-1] - arr[0]) / (len(arr) - 1) for arr in arrivals if len(arr) > 1]
    out_tokens = sum(len(a) for a in arrivals) + len(long_latency) * args.long_output_len
    return {
        "stream_gap_ms": {q: pct(gaps, v) * 1e3 for q, v in
                          (("p50", .5), ("p90", .9), ("p99", .99), ("max", 1.0))},
        "stream_tpot_mean_ms": statistics.fmean(tpot) * 1e3,
        "num_long_requests": len(long_latency),
        "long_latency_s": {q: pct(long_latency, v) for q, v in (("p50", .5), ("max", 1.0))}
        if long_latency else None,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-prompt-len", type=int, default=64)
    p.add_argument("--stream-output-len", type=int, default=512)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--interval-s", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-affinity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tandem-model", default=None)
    p.add_argument("--tandem-arg", action="append", default=[])
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--workdir", default="/tmp/tandem-disagg-mix")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        with tandem_server(mode, args, workdir / f"{mode}.log") as srv:
            run_load(srv.port, argparse.Namespace(**{**vars(args), "streams": 2,
                                                     "stream_output_len": 8,
                                                     "interval_s": 0.5}), args.seed + 7)
            results[mode] = run_load(srv.port, args, args.seed)
        r = results[mode]
        print(f"{mode:14s} stream gaps p50 {r['stream_gap_ms']['p50']:.1f} ms, "
              f"p99 {r['stream_gap_ms']['p99']:.1f} ms, max {r['stream_gap_ms']['max']:.1f} ms; "
              f"TPOT {r['stream_tpot_mean_ms']:.1f} ms; {r['num_long_requests']} long prompts, "
              f"latency p50 {r['long_latency_s']['p50'] if r['long_latency_s'] else float('nan'):.2f} s; "
              f"{r['output_tok_s']:.1f} out tok/s", flush=True)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": versions(argparse.Namespace(systems="tandem")), "modes": results,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
