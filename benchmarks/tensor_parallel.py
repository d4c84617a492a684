"""Tensor parallelism on one machine: a decode step's time with the model on 1 rank
vs sharded over ``--tp`` ranks, and what the ranks send each other.

Offline (``LLM``), default model, greedy, EOS ignored. For each batch size ``B``,
``B`` prompts of 16-24 random tokens are queued at once and run for
``--output-len`` tokens; a *decode step* is an engine step that scheduled no
prompt token (every sequence decoding one token), timed from ``LLM.generate``'s
step callback to the next. Reported: the median decode step (ms) per run.

The same runs count rank 0's collectives per decode step
(``TorchDistributedCommunicator.calls`` / ``.bytes``) and check them against
Megatron-LM's cost of a layer (Shoeybi et al. 2019, sec. 3): two all-reduces of
``B x hidden_size`` activations per decoder layer (attention's output projection,
the MLP's down projection), plus one for the vocabulary-parallel embedding, each
``B * hidden_size * dtype bytes``; plus the step's broadcasts (the model input and
the LM head's rows) and the gather of ``B x V / tp`` logits to rank 0.

Threads: rank-1 runs get ``--threads`` torch threads (the machine's cores by
default); a ``tp``-rank run gives each rank ``threads / tp``. Usage::

    python benchmarks/tensor_parallel.py --batch-sizes 1 4 16 --out /tmp/tp.json
    # GPUs: rank r on cuda:r, the collectives through NCCL (no Ray needed); exits 2
    # with fewer than --tp devices
    python benchmarks/tensor_parallel.py --device cuda --dtype bfloat16 --batch-sizes 1 8 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time


def _decode_steps(llm, prompts, params) -> list[dict]:
    """Run the prompts; per decode step: seconds, the batch, and rank 0's collective
    counts and bytes in it (when sharded).

    All prompts fit one step's token budget, so the first step prefills them all and
    every later step that leaves all of them running decoded one token for each."""
    engine = llm.engine
    comm = engine.parallel.comm if engine.parallel is not None else None
    steps: list[dict] = []

    def snapshot():
        return (dict(comm.calls), dict(comm.bytes)) if comm is not None else ({}, {})

    state = {"t": time.perf_counter(), "counters": snapshot(), "n": 0}

    def on_step(_engine):
        now, counters = time.perf_counter(), snapshot()
        state["n"] += 1
        if state["n"] > 1 and len(engine.scheduler.running) == len(prompts):
            (prev_calls, prev_bytes), (calls, nbytes) = state["counters"], counters
            steps.append({
                "seconds": now - state["t"],
                "calls": {k: v - prev_calls.get(k, 0) for k, v in calls.items()},
                "bytes": {k: v - prev_bytes.get(k, 0) for k, v in nbytes.items()},
            })
        state["t"], state["counters"] = now, counters

    llm.generate([{"prompt_token_ids": p} for p in prompts], params, step_callback=on_step)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: rank r on GPU r, NCCL collectives (needs --tp GPUs)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.tp:
            print(f"tensor_parallel.py: --device cuda --tp {args.tp} needs {args.tp} GPUs, "
                  f"this machine has {torch.cuda.device_count()}", file=sys.stderr)
            sys.exit(2)

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(0)
    prompt_sets = {b: [[rng.randrange(100, 49000) for _ in range(rng.randint(16, 24))]
                       for _ in range(b)] for b in args.batch_sizes}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results = {"dtype": args.dtype, "threads": args.threads, "output_len": args.output_len,
               "device": args.device,
               "machine": platform.processor() or platform.machine(),
               "cpu_flags_avx512": "avx512f" in open("/proc/cpuinfo").read(), "runs": []}
    if args.device == "cuda":
        results["gpus"] = [torch.cuda.get_device_name(i) for i in range(args.tp)]
    outputs: dict[tuple[int, int], list] = {}
    for tp in (1, args.tp):
        llm = LLM(dtype=args.dtype, tensor_parallel_size=tp, device=args.device,
                  num_threads=max(1, args.threads // tp), num_blocks=512)
        cfg = llm.engine.model_config
        elem = 4 if args.dtype == "float32" else 2
        try:
            _decode_steps(llm, prompt_sets[args.batch_sizes[0]], params)     # warm-up
            for b in args.batch_sizes:
                steps = _decode_steps(llm, prompt_sets[b], params)
                full = steps
                run = {"tp": tp, "batch": b, "decode_steps": len(full),
                       "median_decode_step_ms": 1e3 * statistics.median(s["seconds"] for s in full)}
                if tp > 1:
                    calls, nbytes = full[-1]["calls"], full[-1]["bytes"]
                    want_reduces = 2 * cfg.num_layers + 1
                    want_bytes = want_reduces * b * cfg.hidden_size * elem
                    assert calls.get("all_reduce") == want_reduces, calls
                    assert nbytes.get("all_reduce") == want_bytes, nbytes
                    run.update(all_reduces_per_step=calls["all_reduce"],
                               all_reduce_bytes_per_step=nbytes["all_reduce"],
                               all_reduce_bytes_per_token=nbytes["all_reduce"] // b,
                               gather_bytes_per_step=nbytes.get("gather", 0),
                               broadcasts_per_step=calls.get("broadcast", 0),
                               broadcast_bytes_per_step=nbytes.get("broadcast", 0))
                results["runs"].append(run)
                outputs[(tp, b)] = llm.generate([{"prompt_token_ids": p} for p in prompt_sets[b]],
                                                params)
        finally:
            llm.shutdown()
    for b in args.batch_sizes:
        same = ([o.outputs[0].token_ids for o in outputs[(1, b)]]
                == [o.outputs[0].token_ids for o in outputs[(args.tp, b)]])
        results.setdefault("greedy_tokens_equal", {})[b] = same

    print("| tp | batch | median decode step (ms) | all-reduces / step | all-reduce bytes "
          "/ token | gather bytes / step | broadcasts / step |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['tp']} | {r['batch']} | {r['median_decode_step_ms']:.1f} | "
              f"{r.get('all_reduces_per_step', '-')} | "
              f"{r.get('all_reduce_bytes_per_token', '-')} | "
              f"{r.get('gather_bytes_per_step', '-')} | {r.get('broadcasts_per_step', '-')} |")
    print(f"greedy tokens equal (tp 1 vs {args.tp}): {results['greedy_tokens_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
