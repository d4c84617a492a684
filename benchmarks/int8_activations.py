"""Decode speed with int8 activation blocks against float activations, on one engine.

One ``LLM(..., activation_quantization="int8")`` per model; its quantized layers are
switched between int8 and float activations (``Linear.int8_activations``) between
rounds, so both modes run the same weights, caches and process, interleaved
(``--rounds`` rounds, the order alternating), which cancels the drift of a shared
machine. Each round generates ``--output-len`` greedy tokens for each of
``--prompts`` prompts one at a time; decode speed = (output tokens - 1) / (time -
time to the first token). Each round also times one pass of one activation row
through every switched layer in turn, their weights read from memory as a decode
step reads them (``projections_ms``). Reports the median over rounds per mode and
the median of the per-round ratios.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/int8_activations.py \\
        --model default --model Q4_K_M=PATH --model GPTQ=DIR --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_workload  # noqa: E402


def decode_tok_s(llm, prompts, output_len: int) -> float:
    from tandem.engine.sampling.sampling_params import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    decode_s = 0.0
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], first)
        t1 = time.perf_counter()
        llm.generate([p], full)
        t2 = time.perf_counter()
        decode_s += max(1e-9, (t2 - t1) - (t1 - t0))
    return len(prompts) * (output_len - 1) / decode_s


def projections_ms(layers) -> float:
    """Milliseconds for one activation row through every layer in turn (as one decode
    step runs them, each layer's weights read once), best of 3."""
    xs = [torch.randn(1, m.in_features) for m in layers]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            for m, x in zip(layers, xs):
                m(x)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    help="'default' (the default GGUF), or NAME=PATH of a GGUF file (served "
                         "with quantization gguf) or a GPTQ / AWQ directory; repeatable")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from tandem.engine.llm import LLM
    from tandem.engine.model.linear import Linear
    from tandem.engine.sampling.sampling_params import SamplingParams

    models = args.model or ["default"]
    results = {}
    for spec in models:
        name, _, path = spec.partition("=")
        path = path or None
        kwargs = {"dtype": args.dtype, "activation_quantization": "int8"}
        if path is None or path.endswith(".gguf"):
            kwargs["quantization"] = "gguf"
        llm = LLM(model=path, **kwargs)
        layers = [m for m in llm.engine.model.modules()
                  if isinstance(m, Linear) and m.int8_activations]
        prompts = make_workload(args.prompts, args.min_prompt, args.max_prompt,
                                llm.engine.model_config.vocab_size, args.seed)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up
        runs = {"float": [], "int8": []}
        proj = {"float": [], "int8": []}
        for r in range(args.rounds):
            order = ("float", "int8") if r % 2 == 0 else ("int8", "float")
            for mode in order:
                for m in layers:
                    m.int8_activations = mode == "int8"
                runs[mode].append(decode_tok_s(llm, prompts, args.output_len))
                proj[mode].append(projections_ms(layers))
        ratios = [b / a for a, b in zip(runs["float"], runs["int8"])]
        results[name] = {
            "model": path or "default", "int8_layers": len(layers), "decode_tok_s": runs,
            "median_float_tok_s": statistics.median(runs["float"]),
            "median_int8_tok_s": statistics.median(runs["int8"]),
            "median_ratio": statistics.median(ratios),
            "projections_ms": proj,
            "median_projections_ms": {k: statistics.median(v) for k, v in proj.items()},
            "weight_bytes_switched": sum(p.numel() * p.element_size() for m in layers
                                         for p in m.parameters()),
        }
        r = results[name]
        print(f"{name}: {len(layers)} int8 layers, decode float {r['median_float_tok_s']:.1f} "
              f"/ int8 {r['median_int8_tok_s']:.1f} tok/s (median of {args.rounds}), "
              f"int8 / float {r['median_ratio']:.2f}x; one row through the "
              f"{len(layers)} layers: float {r['median_projections_ms']['float']:.1f} / "
              f"int8 {r['median_projections_ms']['int8']:.1f} ms "
              f"({r['weight_bytes_switched'] / 2**20:.1f} MiB of weights)", flush=True)
        del llm
    if args.out:
        doc = {"command": " ".join(["python", "benchmarks/int8_activations.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
               "config": vars(args), "machine": platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "results": results}
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
