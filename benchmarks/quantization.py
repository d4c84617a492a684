"""Weight and KV memory, capacity and throughput per quantization format, in one run.

Each format is an ``LLM`` configuration on the same model (the default
SmolLM2-135M-Instruct GGUF unless ``--model``):

- ``f32`` / ``bf16``: the file's blocks dequantized to dense float32 / bfloat16 at load;
- ``gguf-f32`` / ``gguf-bf16``: ``quantization="gguf"``, the blocks kept packed and
  read by the quantized kernels, activations in float32 / bfloat16;
- ``gguf-q8_0``, ``gguf-q6_k``, ``gguf-q4_k_m``: the same on a Q8_0, Q6_K or Q4_K_M
  file of the model (``--q8-model``, ``--q6k-model``, ``--q4km-model``, e.g. made with
  ``tandem quantize --method q8_0`` / ``q6_k`` / ``q4_k_m``);
- ``awq``, ``gptq``: an AWQ / GPTQ int4 checkpoint of the model (``--awq-model``,
  ``--gptq-model``, from ``tandem quantize``), kept packed on the CPU;
- ``*-int8act``: the same with ``activation_quantization="int8"`` (decode-sized
  products multiply int8 activation blocks, llama.cpp's CPU numerics);
- extra formats are entries of :data:`FORMATS` (name -> model, LLM kwargs).

For each: the bytes of the weights held in memory (every distinct tensor a module
holds: parameters, buffers and the packed copies linear methods keep), the KV bytes
per token, the engine's KV blocks and the largest number of concurrent sequences
of ``--seq-len`` tokens when weights + KV share a ``--memory-budget-mib`` budget
(an int4 cache's open-block K store, one block of exact K per sequence, counted),
single-stream prefill and decode speed (``--single-prompts`` prompts one at a time,
greedy: prefill = time to the first token, decode = the other ``--output-len - 1``) and
offline throughput (``--num-prompts`` prompts at once, greedy, EOS ignored). ``--peers llama.cpp`` adds llama.cpp on the same GGUF
files, through benchmarks/llama_cpp_peer.py in the venv of ``--llama-cpp-python``.

    python benchmarks/quantization.py --out benchmarks/results/quantization.json
    python benchmarks/quantization.py --formats f32,gguf-f32 --num-prompts 8
    python benchmarks/quantization.py --kernels     # the linear kernels alone, per batch size

``--kernels`` times one projection of the model's shapes per type and activation
rows M (gate-up, ``[3072, 576]``; down_proj ``[576, 1536]`` for the K-quants): the GGUF
in-register kernel (float32, bfloat16 and int8 activations), dequantize + GEMM, and
the dense float32 / bfloat16 paths the unquantized method runs, to place ``kernels.cpu.gguf_linear.MAX_FUSED_ROWS``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_workload  # noqa: E402
from bench_peers import LLAMA_CPP_PYTHON  # noqa: E402

# name -> (model path or a flag naming it (None: the default model), LLM kwargs)
FORMATS: dict[str, tuple[str | None, dict]] = {
    "f32": (None, {"dtype": "float32"}),
    "bf16": (None, {"dtype": "bfloat16"}),
    "gguf-f32": (None, {"dtype": "float32", "quantization": "gguf"}),
    "gguf-bf16": (None, {"dtype": "bfloat16", "quantization": "gguf"}),
    "gguf-q8_0": ("--q8-model", {"dtype": "float32", "quantization": "gguf"}),
    "gguf-q6_k": ("--q6k-model", {"dtype": "float32", "quantization": "gguf"}),
    "gguf-q4_k_m": ("--q4km-model", {"dtype": "float32", "quantization": "gguf"}),
    "gguf-f32-fp8kv": (None, {"dtype": "float32", "quantization": "gguf",
                              "kv_cache_dtype": "fp8_e4m3"}),
    "bf16-fp8kv": (None, {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}),
    "gguf-f32-int4kv": (None, {"dtype": "float32", "quantization": "gguf",
                               "kv_cache_dtype": "int4"}),
    "bf16-int4kv": (None, {"dtype": "bfloat16", "kv_cache_dtype": "int4"}),
    "awq": ("--awq-model", {"dtype": "float32", "quantization": "awq"}),
    "gptq": ("--gptq-model", {"dtype": "float32"}),
    # int8 activation blocks in decode-sized products (activation_quantization=int8).
    "gguf-f32-int8act": (None, {"dtype": "float32", "quantization": "gguf",
                                "activation_quantization": "int8"}),
    "gguf-q6_k-int8act": ("--q6k-model", {"dtype": "float32", "quantization": "gguf",
                                          "activation_quantization": "int8"}),
    "gguf-q4_k_m-int8act": ("--q4km-model", {"dtype": "float32", "quantization": "gguf",
                                              "activation_quantization": "int8"}),
    "gptq-int8act": ("--gptq-model", {"dtype": "float32", "activation_quantization": "int8"}),
}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors ``model``'s modules hold as weights: parameters,
    buffers, and the packed copies kept as plain attributes by linear methods."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        tensors += [getattr(module, a, None) for a in ("packed_weight", "invariant_weight",
                                                       "dense_weight")]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            try:
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
            except RuntimeError:        # opaque (oneDNN) tensors: count by size
                key = id(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def run_format(name: str, model: str | None, kwargs: dict, prompts, args) -> dict:
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    probe = LLM(model=model, num_blocks=8, **kwargs)
    engine = probe.engine
    w_bytes = weight_bytes(engine.model)
    kv = engine.kv_cache.tensor                    # [L, 2, NB, BS, Hkv, D]
    bytes_per_block = kv.numel() * kv.element_size() // kv.shape[2]
    kv_bytes_per_token = bytes_per_block / engine.config.cache.block_size
    budget = args.memory_budget_mib << 20
    kv_budget = max(0, budget - w_bytes)
    blocks_per_seq = -(-args.seq_len // engine.config.cache.block_size)
    # An int4 cache also keeps one open block's exact K per running sequence (the
    # open-block K store), out of the same budget.
    store_entry = 0
    if engine.kv_cache.open_keys is not None:
        from tandem.engine.runtime.model_runner import KVCache

        store_entry = KVCache.open_entry_bytes(engine.model_config,
                                               engine.config.cache.block_size,
                                               engine.config.torch_dtype)
    num_blocks = kv_budget // bytes_per_block
    max_seqs = kv_budget // (blocks_per_seq * bytes_per_block + store_entry)
    del probe, engine

    llm = LLM(model=model, max_num_seqs=args.max_num_seqs,
              kv_cache_memory_bytes=max(kv_budget, 64 << 20), **kwargs)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0][:32], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    # Single stream, one prompt at a time (as llama_cpp_peer.py measures llama.cpp):
    # prefill = the time to the first token, decode = the rest.
    prefill_s = decode_s = 0.0
    single = prompts[:args.single_prompts]
    for p in single:
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t1 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                         ignore_eos=True, ))
        t2 = time.perf_counter()
        prefill_s += t1 - t0
        decode_s += max(1e-9, (t2 - t1) - (t1 - t0))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "model": model or "default", "llm_kwargs": kwargs,
        "weight_bytes": w_bytes, "kv_bytes_per_token": kv_bytes_per_token,
        "kv_blocks_in_budget": int(num_blocks),
        "max_concurrent_seqs": int(max_seqs),
        "open_store_bytes_per_seq": store_entry,
        "prefill_tok_s": sum(map(len, single)) / prefill_s,
        "decode_tok_s": len(single) * (args.output_len - 1) / decode_s,
        "offline_output_tok_s": n / dt, "offline_seconds": dt,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def time_kernels(rows=(1, 2, 4, 8, 16, 24, 32, 64, 128), iters=30) -> dict:
    """Microseconds per product of each linear path, per activation rows ``M``: the
    32-weight types on gate-up's shape ``[3072, 576]``, the K-quants (and Q4_1 for
    comparison) on down_proj's ``[576, 1536]``, the layer they are used for in a
    Q4_K_M file of this model (576-wide rows are not whole super-blocks)."""
    import numpy as np
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize

    from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k
    from tandem.kernels.cpu.gguf_linear import gguf_dequantize, gguf_linear
    from tandem.kernels.cpu.linear import invariant_linear, pack_invariant_weight

    def best_us(fn) -> float:
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 4] * 1e6       # lower quartile: less noise

    cases = [(QT.Q4_1, 3072, 576), (QT.Q5_0, 3072, 576), (QT.Q8_0, 3072, 576),
             (QT.Q4_1, 576, 1536), (QT.Q4_K, 576, 1536), (QT.Q6_K, 576, 1536)]
    kquant = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}
    out = {}
    for qtype, n, k in cases:
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        qw = torch.from_numpy(kquant[qtype](w) if qtype in kquant else quantize(w, qtype))
        dense = torch.from_numpy(np.asarray(dequantize(qw.numpy(), qtype)).reshape(n, k).copy())
        bf16_panels = pack_invariant_weight(dense.bfloat16())
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            out[f"{qtype.name} [{n}, {k}] M={m}"] = r = {
                "gguf_fused_f32_us": best_us(lambda: gguf_linear(x, qw, int(qtype), k,
                                                                  fused_only=True)),
                "gguf_dequant_gemm_f32_us": best_us(
                    lambda: F.linear(x, gguf_dequantize(qw, int(qtype), k))),
                "gguf_fused_bf16_us": best_us(lambda: gguf_linear(xb, qw, int(qtype), k,
                                                                   fused_only=True)),
                "gguf_fused_int8_us": best_us(lambda: gguf_linear(x, qw, int(qtype), k,
                                                                   fused_only=True,
                                                                   activations="int8")),
                "dense_f32_us": best_us(lambda: F.linear(x, dense)),
                "dense_bf16_invariant_us": best_us(lambda: invariant_linear(xb, bf16_panels, n)),
            }
            print(f"{qtype.name} [{n}, {k}] M={m:4d} " + "  ".join(
                f"{key[:-3]} {v:8.0f}us" for key, v in r.items()), flush=True)
    return out


def run_llama_cpp(path: str, prompts, args, cache_type: str = "f16") -> dict:
    cmd = [args.llama_cpp_python, str(Path(__file__).with_name("llama_cpp_peer.py")),
           path, "--num-prompts", str(args.single_prompts), "--output-len",
           str(args.output_len), "--min-prompt", str(args.min_prompt), "--max-prompt",
           str(args.max_prompt), "--seed", str(args.seed), "--threads",
           str(torch.get_num_threads()), "--cache-type", cache_type]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--q8-model", default=None, help="a Q8_0 GGUF of the same model")
    ap.add_argument("--q6k-model", default=None, help="a Q6_K GGUF of the same model")
    ap.add_argument("--q4km-model", default=None, help="a Q4_K_M GGUF of the same model")
    ap.add_argument("--awq-model", default=None, help="an AWQ checkpoint of the same model")
    ap.add_argument("--gptq-model", default=None, help="a GPTQ checkpoint of the same model")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=4,
                    help="prompts run one at a time for the prefill / decode columns")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024,
                    help="tokens per sequence for the capacity column")
    ap.add_argument("--memory-budget-mib", type=int, default=512,
                    help="weights + KV budget for the capacity column (MiB)")
    ap.add_argument("--peers", default="", help="llama.cpp (needs --llama-cpp-python)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON,
                    help="python of the llama-cpp-python venv (make peers-llama-cpp)")
    ap.add_argument("--llama-cpp-kv", default="f16",
                    help="llama.cpp KV cache types to run the Q4_1 file with (f16,q8_0,q4_0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", action="store_true", help="time the linear kernels only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kernels:
        result = {"threads": torch.get_num_threads(), "kernels": time_kernels()}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return

    names = [x for x in args.formats.split(",") if x]
    unknown = set(names) - set(FORMATS)
    if unknown:
        ap.error(f"--formats: unknown {sorted(unknown)}, expected some of {', '.join(FORMATS)}")
    prompts = make_workload(args.num_prompts, args.min_prompt, args.max_prompt, 49152, args.seed)
    result = {"config": vars(args), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "formats": {}}
    first_outputs = None
    for name in names:
        model, kwargs = FORMATS[name]
        if model is not None and model.startswith("--"):
            model = getattr(args, model[2:].replace("-", "_"))
            if model is None:
                print(f"{name}: skipped (no {FORMATS[name][0]})")
                continue
        r = run_format(name, model, kwargs, prompts, args)
        outputs = r.pop("outputs")
        if first_outputs is None:
            first_outputs, first = outputs, name
        else:
            r[f"outputs_equal_to_{first}"] = sum(a == b for a, b in zip(first_outputs, outputs))
        result["formats"][name] = r
        print(f"{name:10s} weights {r['weight_bytes'] / 2**20:7.1f} MiB  KV {r['kv_bytes_per_token']:6.0f} "
              f"B/token  seqs@{args.memory_budget_mib}MiB {r['max_concurrent_seqs']:4d}  "
              f"prefill {r['prefill_tok_s']:6.1f} decode {r['decode_tok_s']:6.1f} tok/s  "
              f"offline {r['offline_output_tok_s']:6.1f} tok/s",
              flush=True)
    if "llama.cpp" in args.peers.split(","):
        files = {"gguf-q4_1": None, "gguf-q8_0": args.q8_model, "gguf-q6_k": args.q6k_model,
                 "gguf-q4_k_m": args.q4km_model}
        for name, path in files.items():
            if path is None and name == "gguf-q4_1":
                from tandem.engine.model.model_files import resolve_model
                path = resolve_model(None).path
            if path is None:
                continue
            kv_types = args.llama_cpp_kv.split(",") if name == "gguf-q4_1" else ["f16"]
            for kv in kv_types:
                r = run_llama_cpp(path, prompts, args, kv)
                key = f"llama.cpp-{name[5:]}" + ("" if kv == "f16" else f"-{kv}kv")
                result["formats"][key] = r
                print(f"{key:22s} KV {r['kv_bytes_per_token']:6.0f} B/token  prefill "
                      f"{r['prefill_tok_s']:6.1f} decode {r['decode_tok_s']:6.1f} tok/s",
                      flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
