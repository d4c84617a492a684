"""The compiled CPU prefill attention kernel against torch's CPU flash attention.

Whole prompts (causal, no cached prefix), ``B`` sequences of ``S`` tokens, the same
K/V: ``tandem.kernels.cpu.ops.paged_prefill_attention`` reading them from a paged
cache, and ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal``,
``enable_gqa``: torch's fused CPU flash kernel, what the engine ran before) on
contiguous tensors. Median of ``--rounds`` calls each, alternated, milliseconds
per layer, and the attention FLOPs per second (``4 x S^2 / 2 x D`` per query head
and sequence: the causal half of QK^T and PV). On a CPU with AMX the compiled
bfloat16 kernel is the AMX one; the AVX-512 BF16 kernel is then timed too, in the
same rounds.

    python benchmarks/prefill_attention_cpu.py --out benchmarks/results/prefill_attention_cpu.json

Cases ``B/S/hq/hkv/d``: SmolLM2-135M's heads (9/3/64) at 256 and 512 tokens, the
MoE benchmark's (``moe.py``: 8/2/64, 4 x 256 tokens) and Llama-3-8B's (32/8/128).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from vllm_cpu_kernels import alternate  # noqa: E402

from tandem.kernels.cpu import ops  # noqa: E402

CASES = ("1/256/9/3/64", "1/512/9/3/64", "4/256/8/2/64", "1/512/32/8/128")


def run(dtype: torch.dtype, b: int, s: int, hq: int, hkv: int, d: int, rounds: int,
        bs: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    nb = b * s // bs
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.arange(nb, dtype=torch.int32).view(b, s // bs)
    q = torch.randn(b * s, hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    qsl, lens = [i * s for i in range(b + 1)], [s] * b
    k4, v4 = (c.view(b, s, hkv, d).transpose(1, 2).contiguous() for c in (kc, vc))
    q4 = q.view(b, s, hq, d).transpose(1, 2).contiguous()

    def compiled():
        ops.paged_prefill_attention(q, kc, vc, tables, qsl, lens, d ** -0.5, out=out)

    def avx512():
        ops.paged_prefill_attention(q, kc, vc, tables, qsl, lens, d ** -0.5, out=out,
                                    use_amx=False)

    def sdpa():
        F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=hq != hkv)

    fns = {"compiled": compiled, "sdpa": sdpa}
    if dtype == torch.bfloat16 and ops.amx_prefill_usable(d):
        fns["avx512"] = avx512          # "compiled" is the AMX kernel here
    flops = 4 * b * hq * (s * (s + 1) / 2) * d
    row = {"dtype": str(dtype).removeprefix("torch."), "batch": b, "tokens": s, "hq": hq,
           "hkv": hkv, "head_dim": d}
    for name, t in alternate(fns, rounds).items():
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_gflops"] = flops / t / 1e9
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="B/S/hq/hkv/d")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    print(f"threads {torch.get_num_threads()}")
    print("| dtype | B x S | hq/hkv/d | compiled ms (GFLOP/s) | torch SDPA ms (GFLOP/s) | speedup |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for case in args.cases:
            b, s, hq, hkv, d = (int(x) for x in case.split("/"))
            if not ops.has_prefill_attention(dtype, d):
                print(f"| {name} | {b} x {s} | {hq}/{hkv}/{d} | (no kernel on this CPU) | | |")
                continue
            r = run(dtype, b, s, hq, hkv, d, args.rounds)
            rows.append(r)
            print(f"| {name} | {b} x {s} | {hq}/{hkv}/{d} | {r['compiled_ms']:.3f} "
                  f"({r['compiled_gflops']:.0f}) | {r['sdpa_ms']:.3f} ({r['sdpa_gflops']:.0f}) | "
                  f"{r['sdpa_ms'] / r['compiled_ms']:.2f}x |"
                  + (f" AVX-512 BF16 kernel {r['avx512_ms']:.3f} ms" if "avx512_ms" in r else ""),
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": ["python", "benchmarks/prefill_attention_cpu.py", *(argv or sys.argv[1:])],
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": len(os.sched_getaffinity(0)), "cpu_flags": isa_flags(),
                        "torch": torch.__version__, "threads": torch.get_num_threads()},
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
