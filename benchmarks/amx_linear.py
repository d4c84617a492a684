"""Linear layers on AMX tiles (``amx_linear``) against oneDNN's packed matmul,
bfloat16, on an AMX host (on an AVX-512 BF16 host without AMX, ``dpbf16_linear``
over the same panels; ``--dtype float32``: ``avx512_f32_linear`` on an AVX-512F
host): the kernels alone at decode and prompt sizes (with each one's first call
at a row count new to the process), then the offline engine's decode step
(``--num-seqs`` given no values: the kernels only).

Kernels: SmolLM2-135M's four linear layers of a decoder layer (QKV 960 x 576, O
576 x 576, gate-up 3072 x 576, down 576 x 1536), 30 layers of separate random
weights (so that every call reads its weight from memory, as in a step), each
size of ``--rows`` through both, rounds alternated; milliseconds for the 30 layers
and the weight GB/s.

Engine: one engine with ``small_batch_linear=True``, a second sharing its
weights; the second's decode steps run with the layers' panel copies hidden (so
oneDNN's matmul), both decode the same prompts in turn (``decode_race.py``).
The outputs are not required to be equal (the two sum in different orders): the
share of equal greedy tokens is reported.

    .venv/bin/python benchmarks/amx_linear.py --out benchmarks/results/amx_linear_amx.json

The JSON's keys name the panel kernel that ran: ``amx_ms``, ``dpbf16_ms`` or
``avx512_f32_ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from decode_race import print_race, race, race_engine_kwargs  # noqa: E402

from tandem.kernels.cpu.linear import (amx_linear, amx_linear_usable,  # noqa: E402
                                       avx512_f32_linear, avx512_f32_linear_usable,
                                       dpbf16_linear, dpbf16_linear_usable,
                                       pack_invariant_weight, pack_weight, packed_linear)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (N, K) of one layer


def panel_kernel(dtype: str = "bfloat16") -> tuple[str, object] | None:
    """(name, function) of the panel kernel this machine runs for ``dtype``, AMX first;
    None: none."""
    if dtype == "float32":
        return ("avx512_f32", avx512_f32_linear) if avx512_f32_linear_usable(576) else None
    if amx_linear_usable(576):
        return "amx", amx_linear
    if dpbf16_linear_usable(576):
        return "dpbf16", dpbf16_linear
    return None


def kernel_rows(rows: list[int], layers: int, rounds: int,
                dtype: str = "bfloat16") -> list[dict]:
    kname, small = panel_kernel(dtype)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).to(dt) for n, k in SHAPES]
               for _ in range(layers)]
    onednn = [[pack_weight(w) for w in layer] for layer in weights]
    panels = [[pack_invariant_weight(w) for w in layer] for layer in weights]
    nbytes = sum(n * k * dt.itemsize for n, k in SHAPES) * layers
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(dt) for _, k in SHAPES}

        def run_onednn():
            for layer in onednn:
                for (n, k), w in zip(SHAPES, layer):
                    packed_linear(xs[k], w)

        def run_panels():
            for layer in panels:
                for (n, k), w in zip(SHAPES, layer):
                    small(xs[k], w, n)
        times: dict[str, list[float]] = {"onednn": [], kname: []}
        first = {}
        for name, fn in (("onednn", run_onednn), (kname, run_panels)):
            t0 = time.perf_counter()    # a row count new to the process: oneDNN
            fn()                        # creates (JIT-compiles) its primitives here
            first[name] = time.perf_counter() - t0
        for _ in range(rounds):
            for name, fn in (("onednn", run_onednn), (kname, run_panels)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        close = max((small(xs[k], panels[0][i], n).float()
                     - packed_linear(xs[k], onednn[0][i]).float()).abs().max().item()
                    for i, (n, k) in enumerate(SHAPES))
        out.append({"rows": m, "onednn_ms": med["onednn"] * 1e3, f"{kname}_ms": med[kname] * 1e3,
                    "onednn_first_ms": first["onednn"] * 1e3,
                    f"{kname}_first_ms": first[kname] * 1e3,
                    "onednn_gb_s": nbytes / med["onednn"] / 1e9,
                    f"{kname}_gb_s": nbytes / med[kname] / 1e9, "max_abs_diff": close})
    return out


class _Panels:
    """An engine whose steps run with its layers' panel copies hidden (``hide``: so
    oneDNN's matmul) or left in place; both do the same bookkeeping per step."""

    def __init__(self, engine, layers, hide: bool):
        self.engine, self.layers, self.hide = engine, layers, hide

    def step(self):
        saved = [layer.panel_weight for layer in self.layers]
        for layer, w in zip(self.layers, saved):
            layer.panel_weight = None if self.hide else w
        try:
            return self.engine.step()
        finally:
            for layer, w in zip(self.layers, saved):
                layer.panel_weight = w

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--num-seqs", type=int, nargs="*", default=[1, 4, 16, 32],
                   help="decode steps of this many sequences (none: the kernels only)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    threads, kw = race_engine_kwargs(args)
    if panel_kernel(args.dtype) is None:
        print(f"no {args.dtype} panel linear kernel on this machine (bfloat16: AMX-BF16 or "
              "AVX-512 BF16; float32: AVX-512F)")
        return 1
    kname = panel_kernel(args.dtype)[0]
    kernels = kernel_rows(args.rows, args.layers, args.rounds, args.dtype)
    print(f"{args.dtype}, {threads} threads, {args.layers} layers of SmolLM2-135M's "
          "linear shapes\n")
    print(f"| rows | oneDNN ms (GB/s) | {kname}_linear ms (GB/s) | oneDNN, {kname}_linear first "
          "call ms | max abs diff |")
    print("|---|---|---|---|---|")
    for r in kernels:
        print(f"| {r['rows']} | {r['onednn_ms']:.2f} ({r['onednn_gb_s']:.1f}) | "
              f"{r[kname + '_ms']:.2f} ({r[kname + '_gb_s']:.1f}) | {r['onednn_first_ms']:.1f}, "
              f"{r[kname + '_first_ms']:.1f} | {r['max_abs_diff']:.4f} |")

    steps = None
    if args.num_seqs:
        steps = _decode_race(args, kw)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": sys.argv, "dtype": args.dtype, "threads": threads,
            "cpu_flags": isa_flags(),
            "kernels": kernels, "decode_steps": steps, "prompt_len": args.prompt_len,
            "block": args.block, "blocks": args.blocks}, indent=1) + "\n")
    return 0


def _decode_race(args, kw) -> list:
    from tandem.engine.llm import LLM
    from tandem.engine.model.linear import Linear

    kname = panel_kernel(args.dtype)[0] + "_linear"
    panels = LLM(None, small_batch_linear=True, **kw)
    other = LLM(None, small_batch_linear=True, weights_from=panels, **kw)
    layers = [m for m in panels.engine.model.modules()
              if isinstance(m, Linear) and m.panel_weight is not None]
    engines = {"onednn": _Panels(other.engine, layers, hide=True),
               kname: _Panels(panels.engine, layers, hide=False)}
    steps = race(engines, args)
    print(f"\n{len(layers)} layers with a panel copy\n")
    print_race(steps, {"onednn": "oneDNN", kname: kname})
    return steps


if __name__ == "__main__":
    raise SystemExit(main())
