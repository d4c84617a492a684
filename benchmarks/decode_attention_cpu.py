"""The compiled CPU paged decode attention kernel against this machine's memory
bandwidth.

A decode step's attention must read every cached K and V row of the batch once:
``B x L x Hkv x D x 2`` elements per layer. This times
``tandem.kernels.cpu.ops.paged_decode_attention`` over ``--layers`` separate layer
caches in turn (so the rows come from memory, as in a model's step, not from a
cache warmed by the previous call; one tensor in transparent huge pages, as the
engine's), with block tables in a random order (as a
long-running block pool hands them out), and reports milliseconds per layer and
the achieved GB/s of K/V reads, beside the machine's read bandwidth (a 1 GiB
``sum``, best of 5) measured in the same process.

    python benchmarks/decode_attention_cpu.py --out benchmarks/results/decode_attention_cpu.json
    # the AVX2 + FMA tier on an AVX-512 machine (the kernels rebuilt for haswell):
    TANDEM_CPU_MARCH=haswell python benchmarks/decode_attention_cpu.py
    # a kernel change against git ref REF, in one process, calls alternated:
    python benchmarks/decode_attention_cpu.py --against REF

``--against REF`` compiles ``kernels/cpu/csrc`` as it is at REF (same compiler and
flags) into a second library and times it beside the working tree's, round by
round in turn, on the same caches and tables: on a host whose speed drifts
between runs, only such interleaved timings compare two versions fairly. It also
checks that both give the same outputs.

Shapes ``hq/hkv/d`` (query heads, KV heads, head dim): SmolLM2-135M's 9/3/64 by
default; ``--shapes 32/8/128 28/4/128`` for Llama-3-8B's and Qwen2.5-7B's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402

from tandem.engine.runtime.huge_pages import zeros_in_huge_pages  # noqa: E402
from tandem.kernels.cpu import build, ops  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def library_at(ref: str, workdir: str) -> ctypes.CDLL:
    """The CPU kernels as they are at git ref ``ref``, compiled like the working
    tree's (:data:`tandem.kernels.cpu.build.FLAGS`) into ``workdir`` and loaded, with
    ``tandem_decode_attention_*``'s argument types declared.

    Raises:
        subprocess.CalledProcessError: ``ref`` unknown, or the sources at ``ref`` do
            not compile.
    """
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "kernels/cpu/csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", workdir], input=archive, check=True)
    csrc = Path(workdir) / "kernels" / "cpu" / "csrc"
    so = Path(workdir) / "against.so"
    subprocess.run([build.find_compiler(), *build.FLAGS, "-o", str(so),
                    *map(str, sorted(csrc.glob("*.cpp")))], check=True)
    lib = ctypes.CDLL(str(so))
    for suffix in ("f32", "bf16"):
        fn = getattr(lib, f"tandem_decode_attention_{suffix}")
        fn.argtypes, fn.restype = build._SIGNATURES["decode_attention"], None
    return lib


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
        layers: int, rounds: int, seed: int = 0, against: ctypes.CDLL | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    per_seq = (ctx + bs - 1) // bs
    nb = batch * per_seq + 8
    # One tensor for all layers in transparent huge pages, as the engine's cache
    # (KVCache: zeros_in_huge_pages), so that TLB misses count as they do there.
    cache = zeros_in_huge_pages((layers, 2, nb, bs, hkv, d), dtype)
    for layer in range(layers):
        cache[layer].copy_(torch.randn(2, nb, bs, hkv, d, generator=g))
    kcs, vcs = list(cache[:, 0]), list(cache[:, 1])
    tables = torch.randperm(nb, generator=g)[:batch * per_seq].to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    out = torch.empty_like(q)

    def step():
        for k, v in zip(kcs, vcs):
            ops.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, out=out)

    kv_bytes = batch * ctx * hkv * d * 2 * kcs[0].element_size()
    row = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": ctx,
           "hq": hq, "hkv": hkv, "head_dim": d, "block_size": bs, "kv_bytes_per_layer": kv_bytes}
    step()
    if against is None:
        t = median_s(step, rounds) / layers
        return {**row, "ms_per_layer": t * 1e3, "gb_s": kv_bytes / t / 1e9}
    # Both libraries called alike, straight through ctypes with the arguments
    # ops.paged_decode_attention passes (its Python checks would add to one side only).
    name = "tandem_decode_attention_" + ("bf16" if dtype == torch.bfloat16 else "f32")
    out_ref = torch.empty_like(q)

    def calls(o):
        return [(o.data_ptr(), hq * d, q.data_ptr(), hq * d, k.data_ptr(), v.data_ptr(),
                 tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, hq, hkv, d, bs,
                 d ** -0.5, 0, 0.0, torch.get_num_threads()) for k, v in zip(kcs, vcs)]

    def direct(fn, args):
        def go():
            for a in args:
                fn(*a)
        return go

    step = direct(getattr(build.load_library(), name), calls(out))
    step_ref = direct(getattr(against, name), calls(out_ref))
    step_ref()
    now, ref = [], []
    for _ in range(rounds):
        now.append(median_s(step, 1) / layers)
        ref.append(median_s(step_ref, 1) / layers)
    t, t_ref = sorted(now)[rounds // 2], sorted(ref)[rounds // 2]
    return {**row, "ms_per_layer": t * 1e3, "gb_s": kv_bytes / t / 1e9,
            "against_ms_per_layer": t_ref * 1e3, "against_gb_s": kv_bytes / t_ref / 1e9,
            "outputs_equal": bool(torch.equal(out, out_ref))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--shapes", nargs="+", default=["9/3/64"], help="hq/hkv/head_dim")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--against", metavar="REF", default=None,
                    help="also time the kernels at git ref REF, alternating rounds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    workdir = tempfile.TemporaryDirectory()
    against = library_at(args.against, workdir.name) if args.against else None

    bandwidth = read_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {bandwidth:.1f} GB/s, "
          f"TANDEM_CPU_MARCH={os.environ.get('TANDEM_CPU_MARCH', 'native')}")
    if against is None:
        print("| dtype | batch | context | hq/hkv/d | ms per layer | GB/s | of bandwidth |")
        print("|---|---|---|---|---|---|---|")
    else:
        print(f"| dtype | batch | context | hq/hkv/d | {args.against}: ms per layer (GB/s) "
              "| now: ms per layer (GB/s) | outputs equal |")
        print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.dtypes:
        for shape in args.shapes:
            hq, hkv, d = (int(x) for x in shape.split("/"))
            for b in args.batch_sizes:
                r = run(getattr(torch, name), b, args.context, hq, hkv, d, args.block_size,
                        args.layers, args.rounds, against=against)
                rows.append(r)
                if against is None:
                    print(f"| {name} | {b} | {args.context} | {shape} | {r['ms_per_layer']:.3f} | "
                          f"{r['gb_s']:.1f} | {r['gb_s'] / bandwidth:.0%} |", flush=True)
                else:
                    print(f"| {name} | {b} | {args.context} | {shape} | "
                          f"{r['against_ms_per_layer']:.3f} ({r['against_gb_s']:.1f}) | "
                          f"{r['ms_per_layer']:.3f} ({r['gb_s']:.1f}) | {r['outputs_equal']} |",
                          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": ["python", "benchmarks/decode_attention_cpu.py", *(argv or sys.argv[1:])],
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": len(os.sched_getaffinity(0)), "cpu_flags": isa_flags(),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpu_march": os.environ.get("TANDEM_CPU_MARCH", "native"),
                        "read_bandwidth_gb_s": bandwidth},
            "against": args.against, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
