"""The throughput cost of structured outputs: the same prompts decoded as free text,
under a JSON-schema constraint and under ``json_object``, on the offline engine.

Every mode decodes the same batch of chat prompts (greedy). Free text runs with
``ignore_eos`` for exactly ``--max-tokens`` tokens; the JSON schema is a list of
records with ``minItems`` too large to finish within ``--max-tokens``, so its rows
also run exactly ``--max-tokens`` tokens (finish reason ``length``): both modes do
the same number of steps at the same batch size. ``json_object`` ends when the
model closes its object, so its rows end early and its batch shrinks; its per-step
time is taken over the steps where the whole batch still runs.

Reported per mode (``--repeats`` runs, the modes interleaved; other load on the
machine only ever adds time, so the least is the estimate): output tokens/s of the
fastest run (prefill included), the 10th percentile (and median) of the decode step
times at full batch over all runs, and where the grammar's time goes, per decode step: the bitmask
(``StructuredOutputManager.allowed``: the matchers' ``fill_next_token_bitmask`` and
the unpack to a bool mask), applying it to the logits (``constrain_rows``) and
advancing the matchers (``accept``). The bitmask is computed beside the forward
pass (``Sampler.prefetch_masks``); mode ``json_schema_sync`` computes it after the
forward pass instead, on the engine thread, to show what that saves (the
``sampler`` column is the time on the engine thread). Compile times are reported
apart: the backend's first build (xgrammar import and vocabulary read), a compile
of each constraint without the cache, and a cached lookup.

    .venv/bin/python benchmarks/structured_outputs.py --dtype bfloat16 --batch 16 \\
        --max-tokens 64 --out benchmarks/results/structured_outputs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

QUESTIONS = [
    "List some large cities with their population, in JSON.",
    "Give me a few cities you would like to visit, as JSON.",
    "Describe the biggest cities of Europe in JSON.",
    "Which cities are capitals? Answer in JSON.",
]
RECORD = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    "capital": {"type": "boolean"}}, "required": ["city", "population", "capital"]}
# At least 64 records (> 600 tokens): never complete within --max-tokens.
SCHEMA = {"type": "object", "properties": {"cities": {
    "type": "array", "items": RECORD, "minItems": 64, "maxItems": 100}}, "required": ["cities"]}


class _Timer:
    """Wall time spent inside one callable (wrapped in place)."""

    def __init__(self, owner, name: str):
        self.seconds, self.calls = 0.0, 0
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(owner, name, timed)


def run_once(engine, prompts, params, timers, prefetch: bool = True) -> dict:
    """Decode ``prompts`` to the end, one engine step at a time; ``prefetch``: the
    grammar masks are computed beside the forward pass (the engine's way)."""
    for t in timers.values():
        t.seconds, t.calls = 0.0, 0
    sampler = engine.runner.sampler
    sampler.__dict__.pop("prefetch_masks", None)
    if not prefetch:
        sampler.prefetch_masks = lambda requests: None
    reqs = [r for p in prompts for r in engine.add_request(p, params)]
    steps = []                                      # (live requests before, seconds)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        live = sum(not r.is_finished for r in reqs)
        s0 = time.perf_counter()
        engine.step()
        steps.append((live, time.perf_counter() - s0))
    wall = time.perf_counter() - t0
    tokens = sum(r.num_output_tokens for r in reqs)
    full = [s for live, s in steps[1:] if live == len(prompts)]   # step 0 prefills
    decode_steps = max(1, len(steps) - 1)
    return dict(output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                num_steps=len(steps), full_batch_step_ms=[1e3 * s for s in full],
                **{f"{k}_ms_per_step": 1e3 * t.seconds / decode_steps for k, t in timers.items()},
                finish_reasons=sorted({str(r.status.name) for r in reqs}))


def compile_times(engine, constraints) -> dict:
    som = engine.structured_outputs
    out = {}
    t0 = time.perf_counter()
    backend = som.backend                                   # the first build
    out["backend_build_s"] = time.perf_counter() - t0
    for name, so in constraints.items():
        t0 = time.perf_counter()
        backend.compile(so)                                 # no cache
        out[f"{name}_uncached_ms"] = 1e3 * (time.perf_counter() - t0)
        som.compile(so)
        t0 = time.perf_counter()
        som.compile(so)                                     # a cache hit
        out[f"{name}_cached_us"] = 1e6 * (time.perf_counter() - t0)
    return out


def cpu_flags() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Flags:")), "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="free,json_schema,json_schema_sync,json_object")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tandem.engine.llm import LLM
    from tandem.engine.sampling import sampler
    from tandem.engine.sampling.sampling_params import SamplingParams, StructuredOutputsParams

    llm = LLM(dtype=args.dtype, num_blocks=1024, max_num_seqs=max(64, args.batch))
    engine = llm.engine
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
          + ("" if i < len(QUESTIONS) else f" (request {i})")}]) for i in range(args.batch)]
    constraints = {"json_schema": StructuredOutputsParams(json=SCHEMA),
                   "json_object": StructuredOutputsParams(json_object=True)}
    compiles = compile_times(engine, constraints)
    params = {"free": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)}
    for name, so in constraints.items():
        params[name] = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                      structured_outputs=so)
    # The same schema with its masks computed after the forward pass, on the engine
    # thread (no prefetch): what the overlap saves.
    params["json_schema_sync"] = params["json_schema"]
    som = engine.structured_outputs
    timers = {"sampler": _Timer(type(engine.runner.sampler), "__call__"),
              "bitmask": _Timer(som, "allowed"), "accept": _Timer(som, "accept"),
              "apply": _Timer(sampler, "constrain_rows")}
    modes = args.modes.split(",")
    for m in modes:                                      # warm-up
        run_once(engine, prompts[:2], params[m], timers, m != "json_schema_sync")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            runs[m].append(run_once(engine, prompts, params[m], timers, m != "json_schema_sync"))
    rows = []
    for m in modes:
        best = max(runs[m], key=lambda r: r["tokens_per_s"])
        steps = sorted(s for r in runs[m] for s in r["full_batch_step_ms"])
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in best.items()
               if k != "full_batch_step_ms"}
        # Per-step components: the least over the runs (contention only adds).
        for k in [k for k in best if k.endswith("_ms_per_step")]:
            row[k] = round(min(r[k] for r in runs[m]), 3)
        rows.append(dict(mode=m, **row, full_batch_steps=len(steps),
                         step_ms=round(steps[len(steps) // 10], 2) if steps else None,
                         step_ms_median=round(statistics.median(steps), 2) if steps else None))
    free = rows[0]
    print(f"batch {args.batch}, {args.max_tokens} tokens, {args.dtype}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("mode             out tok/s  (vs free)  step ms p10  (vs free)  median  sampler  bitmask  "
          "apply  accept (ms/step)  tokens  finish")
    for r in rows:
        rel = r["tokens_per_s"] / free["tokens_per_s"]
        step_rel = (r["step_ms"] / free["step_ms"]) if r["step_ms"] and free["step_ms"] else float("nan")
        print(f"{r['mode']:16s} {r['tokens_per_s']:9.1f}  x{rel:.3f}   {r['step_ms'] or 0:11.2f}  "
              f"x{step_rel:.3f}   {r['step_ms_median'] or 0:6.1f}  {r['sampler_ms_per_step']:6.2f}  "
              f"{r['bitmask_ms_per_step']:6.2f}  {r['apply_ms_per_step']:5.2f}  "
              f"{r['accept_ms_per_step']:6.2f}            {r['output_tokens']:5d}  "
              f"{r['finish_reasons']}")
    print("compile:", json.dumps({k: round(v, 3) for k, v in compiles.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), results=rows, compile=compiles, runs=runs,
                           cpu_flags=cpu_flags(), platform=platform.platform(),
                           torch=torch.__version__, threads=torch.get_num_threads()),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
