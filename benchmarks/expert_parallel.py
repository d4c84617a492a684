"""Expert parallelism on one machine: a mixture-of-experts model on 1 rank vs sharded
over ``--tp`` ranks, each expert split over them (tensor-parallel experts, the
default) or whole experts spread over them (``enable_expert_parallel``) with each of
the two ways they meet the tokens (``moe_dispatch``), and what the ranks send each
other.

The model is ``moe.py``'s random-weight Mixtral (transformers writes it: hidden 512,
4 layers, 8 experts of width 1024, top-2, 8 query / 2 KV heads, vocab 8192). Offline
(``LLM``), greedy, EOS ignored; for each batch size ``B``, ``B`` prompts of 16-24
random tokens run for ``--output-len`` tokens, and a *decode step* is an engine step
in which every sequence decoded one token (``tensor_parallel.py``'s measure). Then
a prefill step: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens, one token
each, best of 3.

Rank 0's collectives per decode step are checked against the cost of each form
(``T`` tokens of the step, ``H`` hidden, ``k`` experts per token, ``P`` ranks, ``L``
MoE layers; bytes as rank 0 sends them):

- tensor-parallel experts and ``all_reduce``: ``2 L + 1`` all-reduces of ``T x H``
  (attention, the experts' partial sums, the embedding);
- ``all_to_all``: ``L + 1`` all-reduces of ``T x H``; per MoE layer two all-to-alls,
  the dispatch sending exactly ``k * ceil(T / P)`` rows of ``H`` (rank 0's tokens'
  pairs, its own experts' included) and the combine the rows of the pairs rank 0's
  experts received (data-dependent: counted), and one all-gather of ``ceil(T / P)``
  rows.

Usage::

    .venv/bin/python benchmarks/expert_parallel.py --batch-sizes 1 16 64 \
        --out benchmarks/results/expert_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from moe import make_checkpoint  # noqa: E402
from tensor_parallel import _decode_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    ckpt = Path(tempfile.mkdtemp(prefix="tandem-ep-"))
    make_checkpoint(ckpt, argparse.Namespace(vocab=8192, hidden=512, intermediate=1024,
                                             layers=4, experts=8, top_k=2))
    rng = random.Random(0)
    prompt_sets = {b: [[rng.randrange(3, 8192) for _ in range(rng.randint(16, 24))]
                       for _ in range(b)] for b in args.batch_sizes}
    long_prompts = [[rng.randrange(3, 8192) for _ in range(args.prefill_len)]
                    for _ in range(args.prefill_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    elem = 4 if args.dtype == "float32" else 2
    results = {"dtype": args.dtype, "threads": args.threads, "output_len": args.output_len,
               "machine": platform.processor() or platform.machine(), "isa": isa_flags(),
               "runs": []}
    outputs = {}
    for tp, ep, dispatch in ((1, False, "all_reduce"), (args.tp, False, "all_reduce"),
                             (args.tp, True, "all_reduce"), (args.tp, True, "all_to_all")):
        llm = LLM(str(ckpt), dtype=args.dtype, tensor_parallel_size=tp,
                  enable_expert_parallel=ep, moe_dispatch=dispatch,
                  num_threads=max(1, args.threads // tp), num_blocks=1024,
                  enable_prefix_caching=False)
        cfg = llm.engine.model_config
        h, k, layers = cfg.hidden_size, cfg.moe.num_experts_per_tok, cfg.num_layers
        name = ("1 rank" if tp == 1 else f"{tp} ranks, expert parallel, {dispatch}" if ep
                else f"{tp} ranks, tensor-parallel experts")
        try:
            _decode_steps(llm, prompt_sets[args.batch_sizes[0]], params)     # warm-up
            for b in args.batch_sizes:
                steps = _decode_steps(llm, prompt_sets[b], params)
                run = {"system": name, "tp": tp, "expert_parallel": ep, "moe_dispatch": dispatch,
                       "batch": b,
                       "median_decode_step_ms":
                           1e3 * statistics.median(s["seconds"] for s in steps)}
                if tp > 1:
                    calls, nbytes = steps[-1]["calls"], steps[-1]["bytes"]
                    share = math.ceil(b / tp)
                    if dispatch == "all_reduce":
                        assert calls.get("all_reduce") == 2 * layers + 1, calls
                        assert nbytes.get("all_reduce") == (2 * layers + 1) * b * h * elem
                        assert not calls.get("all_to_all")
                    else:
                        assert calls.get("all_reduce") == layers + 1, calls
                        assert nbytes.get("all_reduce") == (layers + 1) * b * h * elem
                        assert calls.get("all_to_all") == 2 * layers, calls
                        assert calls.get("all_gather", 0) >= layers
                        dispatch_bytes = layers * k * share * h * elem
                        combine = nbytes["all_to_all"] - dispatch_bytes
                        assert 0 <= combine <= layers * k * b * h * elem
                        run.update(dispatch_bytes_per_step=dispatch_bytes,
                                   combine_bytes_per_step=combine)
                    run.update(calls_per_step=calls, bytes_per_step=nbytes,
                               moe_bytes_per_token=(
                                   layers * b * h * elem if dispatch == "all_reduce"
                                   else nbytes["all_to_all"] + layers * share * h * elem) / b)
                results["runs"].append(run)
                outputs[(name, b)] = [o.outputs[0].token_ids for o in llm.generate(
                    [{"prompt_token_ids": p} for p in prompt_sets[b]], params)]
            batch = [{"prompt_token_ids": p} for p in long_prompts]
            llm.generate(batch, one)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(batch, one)
                best = min(best, time.perf_counter() - t0)
            results["runs"].append({"system": name, "tp": tp, "expert_parallel": ep,
                                    "moe_dispatch": dispatch,
                                    "prefill_tokens": len(long_prompts) * args.prefill_len,
                                    "prefill_ms": 1e3 * best})
        finally:
            llm.shutdown()
    names = sorted({n for n, _ in outputs})
    results["greedy_tokens_equal_one_rank"] = {
        n: all(outputs[(n, b)] == outputs[("1 rank", b)] for b in args.batch_sizes)
        for n in names if n != "1 rank"}

    print("| system | batch | median decode step (ms) | MoE bytes / token (rank 0 sends) |")
    print("|---|---|---|---|")
    for r in results["runs"]:
        if "batch" in r:
            per_token = r.get("moe_bytes_per_token")
            print(f"| {r['system']} | {r['batch']} | {r['median_decode_step_ms']:.2f} | "
                  f"{'-' if per_token is None else f'{per_token:.0f}'} |")
    for r in results["runs"]:
        if "prefill_ms" in r:
            print(f"prefill {r['prefill_tokens']} tokens, {r['system']}: {r['prefill_ms']:.1f} ms")
    print(f"greedy tokens equal one rank's: {results['greedy_tokens_equal_one_rank']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
