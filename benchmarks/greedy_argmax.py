"""The greedy pick's cost: torch's ``argmax`` against the sampler's two-pass one.

Measures, in one process with the engine's thread count:

* **the op**: ``logits.argmax(dim=-1)`` and
  :func:`~tandem.engine.sampling.sampler.greedy_token_ids` on ``[N, V]`` float32
  logits (V = the default model's 49,152), N in ``--batch``: median of 50 calls,
  milliseconds, after checking both give the same ids;
* **the engine's decode step**: one offline engine, ``--num-seqs`` greedy requests
  (random ``--prompt-len``-token prompts, EOS ignored) decoding together; blocks of
  ``--block`` steps alternate between the sampler's pick and torch's (the sampler's
  module attribute swapped), and the median step of each is reported, so drifting
  machine load falls on both.

    .venv/bin/python benchmarks/greedy_argmax.py --dtype bfloat16 --out benchmarks/results/greedy_argmax.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from serving_overhead import random_prompts  # noqa: E402


def op_ms(fn, x, repeats: int = 50) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="1,16,64,256")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    import tandem.engine.sampling.sampler as sampler_mod
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    two_pass = sampler_mod.greedy_token_ids
    torch_argmax = lambda x: x.argmax(dim=-1)   # noqa: E731
    ops = []
    for n in [int(b) for b in args.batch.split(",")]:
        x = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n))
        if two_pass(x).tolist() != torch_argmax(x).tolist():
            raise SystemExit(f"N={n}: the two picks differ")
        ops.append({"n": n, "torch_argmax_ms": op_ms(torch_argmax, x),
                    "greedy_token_ids_ms": op_ms(two_pass, x)})

    llm = LLM(None, dtype=args.dtype, num_threads=threads, enable_prefix_caching=False)
    eng = llm.engine
    total = args.block * args.blocks + 8
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    reqs = [r for pr in random_prompts(args.num_seqs, args.prompt_len, 3)
            for r in eng.add_request(pr, params)]
    while not all(r.output_token_ids for r in reqs):
        eng.step()
    steps = {"greedy_token_ids": [], "torch_argmax": []}
    for i in range(args.blocks):
        name = "greedy_token_ids" if i % 2 == 0 else "torch_argmax"
        sampler_mod.greedy_token_ids = two_pass if i % 2 == 0 else torch_argmax
        for _ in range(args.block):
            t0 = time.perf_counter()
            eng.step()
            steps[name].append(time.perf_counter() - t0)
    sampler_mod.greedy_token_ids = two_pass
    step_ms = {k: statistics.median(v) * 1e3 for k, v in steps.items()}

    print(f"{args.dtype}, {threads} threads, V={args.vocab}\n")
    print("| N | torch argmax (ms) | two passes (ms) |\n|---|---|---|")
    for o in ops:
        print(f"| {o['n']} | {o['torch_argmax_ms']:.3f} | {o['greedy_token_ids_ms']:.3f} |")
    print(f"\ndecode step, {args.num_seqs} sequences, median of {args.block * args.blocks // 2} "
          f"steps each: two passes {step_ms['greedy_token_ids']:.1f} ms, torch argmax "
          f"{step_ms['torch_argmax']:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": sys.argv, "dtype": args.dtype, "threads": threads, "vocab": args.vocab,
            "cpu_flags": isa_flags(), "ops": ops, "decode_step_ms": step_ms,
            "num_seqs": args.num_seqs, "prompt_len": args.prompt_len}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
