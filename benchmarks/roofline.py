"""The engine's steps against this CPU's limits: a roofline table.

Measures, in one process with the engine's thread count:

* **GEMM peak**: the product of two square matrices (``--gemm-size``) in the dtype,
  through oneDNN's packed matmul (the engine's linear layers; ``torch.matmul``
  where that is unavailable), best of several runs: GFLOP/s (2 n^3 per product).
* **memory bandwidth**: a read of a tensor much larger than the caches
  (``--stream-mb``; ``tensor.sum()``, which reads each byte once): GB/s.
* **prefill**: engine steps that run one ``--prefill-len``-token prompt (no cache
  hit): achieved GFLOP/s = 2 x parameters x tokens / step time (the attention's own
  FLOPs are left out: a lower bound of the work done).
* **decode**: engine steps of a steady batch of B requests (each ``--context``
  tokens of context): achieved GB/s = (bytes of every weight + bytes of the batch's
  KV cache read) / step time, since a decode step reads every weight once and each
  request's KV once.

and prints a markdown table (each step kind: its time, achieved rate, and the
fraction of the measured peak), and writes JSON with the CPU's ISA flags.

    .venv/bin/python benchmarks/roofline.py --dtype bfloat16
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
from openai_bench import versions  # noqa: E402
from serving_overhead import random_prompts  # noqa: E402


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_peak_gflops(dtype, n: int, repeats: int = 5) -> float:
    import torch

    from tandem.kernels.cpu.linear import pack_weight, packed_linear, packing_available

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    if packing_available(dtype):
        packed = pack_weight(b)
        return 2 * n ** 3 / best_time(lambda: packed_linear(a, packed), repeats) / 1e9
    return 2 * n ** 3 / best_time(lambda: torch.matmul(a, b), repeats) / 1e9


def stream_gbs(mb: int, repeats: int = 5) -> float:
    import torch

    x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    return x.numel() * 4 / best_time(lambda: x.sum(), repeats) / 1e9


def engine_steps(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[float]]:
    """(prefill step times, decode step times with every request decoding), seconds."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [r for p in prompts for r in llm.engine.add_request(p, params)]
    prefill, decode = [], []
    while llm.engine.has_unfinished_requests():
        decoding = all(r.output_token_ids and not r.is_finished for r in reqs)
        prefilling = not any(r.output_token_ids for r in reqs)
        t0 = time.perf_counter()
        llm.engine.step()
        dt = time.perf_counter() - t0
        (decode if decoding else prefill if prefilling else []).append(dt)
    return prefill, decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--stream-mb", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--context", type=int, default=256, help="decode: prompt tokens per request")
    p.add_argument("--batch", default="1,4,16,64", help="decode batch sizes")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from tandem.engine.llm import LLM

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    peak = gemm_peak_gflops(dtype, args.gemm_size)
    bw = stream_gbs(args.stream_mb)
    llm = LLM(args.model, dtype=args.dtype, num_threads=threads,
              enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prefill_len))
    cfg = llm.engine.model_config
    # From the geometry: the linear layers' weights live in packed (opaque) tensors.
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    embed = cfg.vocab_size * cfg.hidden_size
    params = cfg.num_layers * per_layer + embed * (1 if cfg.tie_word_embeddings else 2)
    # A decode step reads every linear weight and the LM head once (not the embedding).
    weight_bytes = (cfg.num_layers * per_layer + embed) * dtype.itemsize
    kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                          * llm.engine.runner.kv_cache.tensor.element_size())
    rows = []
    engine_steps(llm, random_prompts(1, 64, 1), 4)                 # warm-up
    pre, _ = engine_steps(llm, random_prompts(1, args.prefill_len, 2), 1)
    t = statistics.median(pre)
    gflops = 2 * params * args.prefill_len / t / 1e9
    rows.append({"step": f"prefill {args.prefill_len} tokens", "ms": t * 1e3,
                 "achieved": f"{gflops:.1f} GFLOP/s", "fraction_of_peak": gflops / peak})
    for b in [int(x) for x in args.batch.split(",")]:
        _, dec = engine_steps(llm, random_prompts(b, args.context, 10 + b), 32)
        t = statistics.median(dec)
        read = weight_bytes + b * (args.context + 16) * kv_bytes_per_token
        gbs = read / t / 1e9
        rows.append({"step": f"decode batch {b} ({args.context}-token context)", "ms": t * 1e3,
                     "achieved": f"{gbs:.1f} GB/s", "fraction_of_peak": gbs / bw,
                     "tokens_per_s": b / t})
    result = {"dtype": args.dtype, "threads": threads, "gemm_peak_gflops": peak,
              "stream_read_gbs": bw, "parameters": params, "weight_bytes": weight_bytes,
              "kv_bytes_per_token": kv_bytes_per_token, "rows": rows,
              "machine": versions(argparse.Namespace(systems=[])),
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    print(f"\n{args.dtype}, {threads} threads: GEMM peak {peak:.1f} GFLOP/s "
          f"({args.gemm_size}^3 matmul), memory read {bw:.1f} GB/s ({args.stream_mb} MB sum); "
          f"model {params / 1e6:.1f} M parameters, {weight_bytes / 1e6:.0f} MB of weights read per decode step\n")
    print("| step | time (ms) | achieved | of the measured peak |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['ms']:.1f} | {r['achieved']} | {r['fraction_of_peak']:.0%} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
