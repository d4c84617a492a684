"""The compiled CPU paged decode attention kernel against this machine's memory
bandwidth.

A decode step's attention must read every cached K and V row of the batch once:
``B x L x Hkv x D x 2`` elements per layer. This times
``tandem.kernels.cpu.ops.paged_decode_attention`` over ``--layers`` separate layer
caches in turn (so the rows come from memory, as in a model's step, not from a
cache warmed by the previous call), with block tables in a random order (as a
long-running block pool hands them out), and reports milliseconds per layer and
the achieved GB/s of K/V reads, beside the machine's read bandwidth (a 1 GiB
``sum``, best of 5) measured in the same process.

    python benchmarks/decode_attention_cpu.py --out benchmarks/results/decode_attention_cpu.json
    # the AVX2 + FMA tier on an AVX-512 machine (the kernels rebuilt for haswell):
    TANDEM_CPU_MARCH=haswell python benchmarks/decode_attention_cpu.py

Shapes ``hq/hkv/d`` (query heads, KV heads, head dim): SmolLM2-135M's 9/3/64 by
default; ``--shapes 32/8/128 28/4/128`` for Llama-3-8B's and Qwen2.5-7B's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402

from tandem.kernels.cpu import ops  # noqa: E402


def median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def read_bandwidth_gbs() -> float:
    """GB/s of a 1 GiB float32 ``sum`` on torch's threads, best of 5."""
    x = torch.ones(256 * 1024 * 1024)
    best = min(median_s(x.sum, 1) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def run(dtype: torch.dtype, batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int,
        layers: int, rounds: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    per_seq = (ctx + bs - 1) // bs
    nb = batch * per_seq + 8
    kcs = [torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(layers)]
    vcs = [torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(layers)]
    tables = torch.randperm(nb, generator=g)[:batch * per_seq].to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    out = torch.empty_like(q)

    def step():
        for k, v in zip(kcs, vcs):
            ops.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, out=out)

    step()
    t = median_s(step, rounds) / layers
    kv_bytes = batch * ctx * hkv * d * 2 * kcs[0].element_size()
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": ctx,
            "hq": hq, "hkv": hkv, "head_dim": d, "block_size": bs,
            "ms_per_layer": t * 1e3, "kv_bytes_per_layer": kv_bytes, "gb_s": kv_bytes / t / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--shapes", nargs="+", default=["9/3/64"], help="hq/hkv/head_dim")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    bandwidth = read_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {bandwidth:.1f} GB/s, "
          f"TANDEM_CPU_MARCH={os.environ.get('TANDEM_CPU_MARCH', 'native')}")
    print("| dtype | batch | context | hq/hkv/d | ms per layer | GB/s | of bandwidth |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.dtypes:
        for shape in args.shapes:
            hq, hkv, d = (int(x) for x in shape.split("/"))
            for b in args.batch_sizes:
                r = run(getattr(torch, name), b, args.context, hq, hkv, d, args.block_size,
                        args.layers, args.rounds)
                rows.append(r)
                print(f"| {name} | {b} | {args.context} | {shape} | {r['ms_per_layer']:.3f} | "
                      f"{r['gb_s']:.1f} | {r['gb_s'] / bandwidth:.0%} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": ["python", "benchmarks/decode_attention_cpu.py", *(argv or sys.argv[1:])],
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": len(os.sched_getaffinity(0)), "cpu_flags": isa_flags(),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpu_march": os.environ.get("TANDEM_CPU_MARCH", "native"),
                        "read_bandwidth_gb_s": bandwidth},
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
