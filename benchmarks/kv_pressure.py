"""KV memory under pressure: prefix caching on vs off, and swap vs recompute preemption.

Offline engine (``LLMEngine``, one process), default model, greedy, EOS ignored.
All requests are queued at t = 0 and the engine steps until idle.

* ``prefix``: ``--prefix-requests`` requests share a ``--system-prompt-len``-token
  system prompt followed by a distinct 16-48-token user part, ``--prefix-output-len``
  tokens each, run once with prefix caching on and once off (the same prompts).
  TTFT is from t = 0 to the step that returned the request's first token.
* ``pressure``: ``--pressure-requests`` requests of 190-210-token prompts,
  ``--pressure-output-len`` tokens each, in a pool of 4 sequences' worth of blocks,
  under each preemption mode (``swap`` with room for every request, ``recompute``,
  ``auto`` with room for one), next to the same requests in an unconstrained pool.
  Every run's outputs are compared with the unconstrained run's. "Recomputed" is
  the tokens run beyond each request's prompt and outputs once; "swapped" the
  bytes copied between device and host, both directions.
* ``cost model``: the two speeds the ``auto`` mode's cost model compares, measured
  here: prefill tokens/s of one 512-token prompt, and bytes/s of swapping 64
  blocks out and back in.

Throughput is output tokens / wall seconds of the run. Usage::

    python benchmarks/kv_pressure.py --out /tmp/kv_pressure.json

Prints one markdown table per part.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch


def random_prompt(rng: random.Random, n: int) -> list[int]:
    # Skip the first ids (special/control tokens in most vocabularies).
    return [rng.randrange(100, 49000) for _ in range(n)]


def run(engine, prompts, params) -> dict:
    """Queue every prompt, step until idle; times in seconds from the first add.

    Steps as ``LLMEngine.step`` does (schedule, execute, update), counting the
    tokens run and the blocks swapped on the way.
    """
    sch, runner = engine.scheduler, engine.runner
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    first: dict[str, float] = {}
    steps = tokens_run = blocks_swapped = 0
    while engine.has_unfinished_requests():
        out = sch.schedule()
        changed = sch.update(out, runner.execute(out).sampled) if not out.is_empty else []
        steps += 1
        tokens_run += out.num_tokens
        blocks_swapped += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        now = time.perf_counter() - t0
        for r in changed:
            first.setdefault(r.request_id, now)
    wall = time.perf_counter() - t0
    ttft = [first[r.request_id] for r in reqs]
    out_tokens = sum(r.num_output_tokens for r in reqs)
    # Without preemption each request runs its uncached prompt tokens and all but
    # its last output token once; anything beyond that was recomputed.
    needed = sum(r.num_prompt_tokens - r.num_cached_tokens + r.num_output_tokens - 1
                 for r in reqs)
    stats = engine.stats()
    kv = engine.kv_cache
    return {
        "seconds": wall, "steps": steps, "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "cached_tokens": sum(r.num_cached_tokens for r in reqs),
        "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
        "tokens_recomputed": tokens_run - needed,
        "swap_bytes": blocks_swapped * kv.bytes_per_block(engine.model_config, kv.block_size,
                                                          kv.tensor.dtype),
        "num_swap_preemptions": stats.num_swap_preemptions,
        "num_recompute_preemptions": stats.num_recompute_preemptions,
        "loadavg_1min_after": os.getloadavg()[0],
        "outputs": [r.output_token_ids for r in reqs],
    }


def make_engine(args, base=None, **kw):
    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.runtime.llm_engine import LLMEngine

    cache = {k: kw.pop(k) for k in ("num_blocks", "enable_prefix_caching", "num_host_blocks")
             if k in kw}
    config = EngineConfig(dtype=args.dtype, cache=CacheConfig(**cache),
                          scheduler=SchedulerConfig(**kw))
    return LLMEngine(config, weights_from=base)


def print_prefix_row(r: dict) -> None:
    print(f"| {'on' if r['prefix_caching'] else 'off'} | {r['cached_tokens']} / "
          f"{r['prompt_tokens']} | {r['ttft_mean_s']:.2f} / {r['ttft_p50_s']:.2f} / "
          f"{r['ttft_max_s']:.2f} | {r['output_tok_s']:.1f} | {r['seconds']:.1f} "
          f"| {r['steps']} |", flush=True)


def print_pressure_row(r: dict) -> None:
    print(f"| {r['mode']} | {r['num_blocks']} / {r['num_host_blocks']} | "
          f"{r['num_swap_preemptions']} / {r['num_recompute_preemptions']} | "
          f"{r['tokens_recomputed']} | {r['swap_bytes'] / 1e6:.1f} | "
          f"{r['output_tok_s']:.1f} | {r['seconds']:.1f} | {r['steps']} | "
          f"{r.get('outputs_identical', '-')} |", flush=True)


def bench_prefix(args, base) -> list[dict]:
    from tandem.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    system = random_prompt(rng, args.system_prompt_len)
    prompts = [system + random_prompt(rng, rng.randint(16, 48))
               for _ in range(args.prefix_requests)]
    params = SamplingParams(max_tokens=args.prefix_output_len, temperature=0.0, ignore_eos=True)
    print(f"\nprefix caching: {args.prefix_requests} requests, {args.system_prompt_len}-token "
          f"system prompt + 16-48 user tokens, {args.prefix_output_len} output tokens each")
    print("| prefix caching | cached / prompt tokens | TTFT mean / p50 / max (s) "
          "| out tok/s | wall (s) | steps |")
    print("|---|---|---|---|---|---|", flush=True)
    rows = []
    for caching in (True, False):
        engine = make_engine(args, base, num_blocks=2048, enable_prefix_caching=caching)
        res = run(engine, prompts, params)
        res["prefix_caching"] = caching
        rows.append(res)
        print_prefix_row(res)
    assert rows[0]["outputs"] == rows[1]["outputs"], "prefix caching changed an output"
    return rows


def bench_pressure(args, base) -> list[dict]:
    from tandem.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(args.seed + 1)
    prompts = [random_prompt(rng, rng.randint(190, 210)) for _ in range(args.pressure_requests)]
    params = SamplingParams(max_tokens=args.pressure_output_len, temperature=0.0,
                            ignore_eos=True)
    seq_blocks = -(-(210 + args.pressure_output_len) // 16)
    print(f"\npreemption: {args.pressure_requests} requests, 190-210-token prompts, "
          f"{args.pressure_output_len} output tokens each, a pool of 4 sequences")
    print("| mode | device / host blocks | preemptions swap / recompute | tokens recomputed "
          "| MB swapped | out tok/s | wall (s) | steps | outputs = unconstrained |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for mode, pool, host in (("unconstrained", 2048, 0),
                             ("swap", 4 * seq_blocks, args.pressure_requests * seq_blocks),
                             ("recompute", 4 * seq_blocks, 0),
                             ("auto", 4 * seq_blocks, seq_blocks)):
        engine = make_engine(args, base, num_blocks=pool, num_host_blocks=host,
                             preemption_mode="recompute" if mode == "unconstrained" else mode)
        res = run(engine, prompts, params)
        res.update(mode=mode, num_blocks=pool, num_host_blocks=host)
        if rows:
            res["outputs_identical"] = res["outputs"] == rows[0]["outputs"]
        rows.append(res)
        print_pressure_row(res)
    return rows


def bench_cost_model(args, base) -> dict:
    from tandem.engine.sampling.sampling_params import SamplingParams

    engine = make_engine(args, base, num_blocks=256, num_host_blocks=64,
                         enable_prefix_caching=False)
    rng = random.Random(args.seed + 2)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    run(engine, [random_prompt(rng, 512)], params)           # warm-up
    prefill = run(engine, [random_prompt(rng, 512)], params)
    kv = engine.kv_cache
    pairs = [(2 * i, i) for i in range(64)]
    kv.swap_out(pairs)                                        # warm-up (first touch)
    t0 = time.perf_counter()
    kv.swap_out(pairs)
    kv.swap_in([(h, d) for d, h in pairs])
    swap_s = time.perf_counter() - t0
    nbytes = 2 * 64 * kv.bytes_per_block(engine.model_config, kv.block_size, kv.tensor.dtype)
    return {"prefill_tokens_per_s": 512 / prefill["seconds"],
            "swap_bytes_per_s": nbytes / swap_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--system-prompt-len", type=int, default=300)
    parser.add_argument("--prefix-output-len", type=int, default=16)
    parser.add_argument("--pressure-requests", type=int, default=12)
    parser.add_argument("--pressure-output-len", type=int, default=96)
    parser.add_argument("--out", help="write the numbers as JSON")
    args = parser.parse_args()

    from tandem.engine.runtime.llm_engine import LLMEngine  # noqa: F401  (import cost before timing)

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    base = make_engine(args, num_blocks=16)
    prefix = bench_prefix(args, base)
    pressure = bench_pressure(args, base)
    cost = bench_cost_model(args, base)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "dtype": args.dtype,
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
            "total_seconds": time.perf_counter() - t0}

    print(f"\ncost model speeds: prefill {cost['prefill_tokens_per_s']:.0f} tokens/s, "
          f"swap {cost['swap_bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"\n{meta}")
    if args.out:
        for r in prefix + pressure:
            r.pop("outputs")
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "prefix": prefix, "pressure": pressure,
                       "cost_model": cost}, f, indent=1)


if __name__ == "__main__":
    main()
