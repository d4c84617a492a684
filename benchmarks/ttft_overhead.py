"""What the serving path adds to the time to first token, one request at a time.

A served request's TTFT at concurrency 1 is its prompt's prefill plus what the
path around the engine adds (HTTP, validation, routing, the worker call, the
first token's way back). This measures the two side by side, alternated so that
the machine's drifting speed falls on both: a ``tandem serve`` (``--mode``) and an
offline :class:`~tandem.engine.llm.LLM` in this process (same dtype, idle while
the server works and the other way round), each given its own random prompt of
``--prompt-len`` token ids in turn: the server as a streaming ``/v1/completions``
request (TTFT = the first SSE event), the engine as ``generate`` of one token.
Reports both medians and the median of the paired differences (served - offline,
ms).

    .venv/bin/python benchmarks/ttft_overhead.py --dtype float32
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_bench import MODEL_NAME, tandem_server, versions  # noqa: E402


def served_ttft_ms(port: int, prompt: list[int]) -> float:
    """One streaming greedy request; ms from sending it to its first SSE event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "stream": True,
                       "temperature": 0, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    while True:
        line = resp.fp.readline()
        if not line:
            break
        if first is None and line.startswith(b"data:"):
            first = time.perf_counter() - t0
    conn.close()
    if first is None:
        raise RuntimeError(f"no event in the answer (HTTP {resp.status})")
    return first * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--num-pairs", type=int, default=12)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu-affinity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tandem-model", default=None)
    p.add_argument("--tandem-arg", action="append", default=[])
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(model=args.tandem_model, dtype=args.dtype)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(args.seed)
    n = args.warmups + args.num_pairs
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(2 * n)]
    served, offline = [], []
    workdir = Path(tempfile.mkdtemp(prefix="ttft_overhead_"))
    with tandem_server(args.mode, args, workdir / "tandem.log") as srv:
        for i in range(n):
            s = served_ttft_ms(srv.port, prompts[2 * i])
            t0 = time.perf_counter()
            llm.generate([prompts[2 * i + 1]], one)
            o = (time.perf_counter() - t0) * 1000
            if i >= args.warmups:
                served.append(s)
                offline.append(o)
    diffs = [s - o for s, o in zip(served, offline)]
    report = {"command": [Path(sys.executable).name, *sys.argv], "mode": args.mode,
              "dtype": args.dtype, "prompt_len": args.prompt_len,
              "machine": versions(argparse.Namespace(systems="tandem")),
              "served_ttft_ms": served, "offline_prefill_ms": offline,
              "median_served_ms": statistics.median(served),
              "median_offline_ms": statistics.median(offline),
              "median_paired_difference_ms": statistics.median(diffs)}
    print(f"{args.mode} {args.dtype}, {args.prompt_len}-token prompts, {args.num_pairs} pairs: "
          f"served TTFT median {report['median_served_ms']:.1f} ms, offline prefill median "
          f"{report['median_offline_ms']:.1f} ms, paired difference median "
          f"{report['median_paired_difference_ms']:+.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
