"""llama.cpp as a peer: single-stream prefill and decode speed on a GGUF file.

Runs llama.cpp through its Python binding ``llama-cpp-python`` (an optional peer,
not a Tandem dependency), on the prompts offline_throughput.py uses
(bench_prompts.make_workload: the same count, lengths, ids and seed give the same
prompts), one prompt at a time, greedy (argmax of the logits), EOS ignored:

- prefill: the prompt's tokens evaluated at once (``Llama.eval``, batches of
  ``--n-batch``); prefill tok/s = prompt tokens / prefill seconds;
- decode: ``--output-len`` tokens, the first from the prefill's logits, then one
  ``eval`` of one token per further token; decode tok/s = (output_len - 1) / decode
  seconds.

``--cache-type`` sets llama.cpp's KV cache type for K and V (``f16``, its default;
``q8_0``: 8-bit blocks of 32 with an fp16 scale, 34 bytes per 32 values; ``q4_0``:
4-bit blocks of 32 with an fp16 scale, 18 bytes per 32 values); a quantized V cache
needs flash attention, which is then turned on (and also for ``f16`` when
``--flash-attn`` is given). ``kv_bytes_per_token`` is computed from the GGUF's shape
(layers x KV heads x head dim, K and V) and the type's bytes per value.

Both are summed over the prompts. One untimed warm-up prompt first (page-in of the
mapped file, thread start-up). Prints one JSON object; ``--out`` also writes it with
every prompt's generated token ids.

llama.cpp's CPU threads are OpenMP threads, which by default spin while they wait:
on a machine where other processes share the cores, ``--threads 2`` then runs
several times slower than ``--threads 1``. ``OMP_WAIT_POLICY=PASSIVE`` makes them
sleep instead; the result records the policy in effect.

Install (its own venv; pip's configured index has only the source distribution,
which builds llama.cpp with CMake, about 10 minutes or more on 2 cores)::

    python3 -m venv .peers/lcpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" .peers/lcpp-venv/bin/python -m pip install llama-cpp-python

On a CPU that reports AMX but whose kernel does not grant the tiles to the process,
the native build dies with a general protection fault in ``libggml-cpu`` at the
first ``eval``; build without AMX instead::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      .peers/lcpp-venv/bin/python -m pip install llama-cpp-python

Run::

    .peers/lcpp-venv/bin/python benchmarks/llama_cpp_peer.py MODEL.gguf \\
        --num-prompts 8 --output-len 128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_workload  # noqa: E402


CACHE_TYPES = {"f16": ("GGML_TYPE_F16", 2.0), "q8_0": ("GGML_TYPE_Q8_0", 34 / 32),
               "q4_0": ("GGML_TYPE_Q4_0", 18 / 32)}
"""``--cache-type`` -> (the ggml type's name in ``llama_cpp``, bytes per value)."""


def greedy_run(llm, prompt: list[int], output_len: int) -> tuple[list[int], float, float]:
    """``(generated ids, prefill seconds, decode seconds)`` of one prompt, from an
    empty context. ``output_len`` >= 1.

    The next token is the argmax of the last evaluated position's float32 logits
    (``llama_get_logits_ith(ctx, -1)``, ``[n_vocab]``: with ``logits_all=False``
    ``Llama.eval`` does not copy them into ``Llama.scores``)."""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(n_vocab,))
        return int(np.argmax(logits))

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    out = [argmax_last()]
    t1 = time.perf_counter()
    for _ in range(output_len - 1):
        llm.eval([out[-1]])
        out.append(argmax_last())
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="path of the .gguf file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (decode and batch)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--cache-type", default="f16", choices=sorted(CACHE_TYPES),
                    help="llama.cpp KV cache type for K and V")
    ap.add_argument("--flash-attn", action="store_true",
                    help="flash attention with an f16 cache too (always on when quantized)")
    ap.add_argument("--out", default=None, help="also write the result, with outputs, here")
    args = ap.parse_args()
    if args.output_len < 1:
        ap.error("--output-len must be at least 1")
    if args.max_prompt + args.output_len > args.n_ctx:
        ap.error(f"--max-prompt + --output-len ({args.max_prompt + args.output_len}) "
                 f"exceeds --n-ctx {args.n_ctx}")

    import llama_cpp

    ggml_type, bytes_per_value = CACHE_TYPES[args.cache_type]
    flash_attn = args.flash_attn or args.cache_type != "f16"
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=args.n_ctx, n_batch=args.n_batch,
                          logits_all=False, verbose=False, flash_attn=flash_attn,
                          type_k=getattr(llama_cpp, ggml_type),
                          type_v=getattr(llama_cpp, ggml_type))
    meta = llm.metadata
    arch = meta.get("general.architecture", "llama")
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    prompts = make_workload(args.num_prompts, args.min_prompt, args.max_prompt, llm.n_vocab(),
                            args.seed)
    greedy_run(llm, prompts[0][:32], 4)   # warm-up
    outputs, prefill_s, decode_s = [], 0.0, 0.0
    for p in prompts:
        ids, tp, td = greedy_run(llm, p, args.output_len)
        outputs.append(ids)
        prefill_s += tp
        decode_s += td
    prompt_tokens = sum(map(len, prompts))
    decode_tokens = len(prompts) * (args.output_len - 1)
    result = {
        "system": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "model": str(Path(args.model).resolve()),
        "file_type": llm.metadata.get("general.file_type"),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "n_ctx": args.n_ctx, "n_batch": args.n_batch,
        "cache_type": args.cache_type, "flash_attn": flash_attn,
        "kv_bytes_per_token": round(2 * layers * kv_heads * head_dim * bytes_per_value, 1),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "num_prompts": len(prompts), "prompt_tokens": prompt_tokens,
        "output_len": args.output_len, "seed": args.seed,
        "prefill_seconds": round(prefill_s, 4),
        "prefill_tok_s": round(prompt_tokens / prefill_s, 2),
        "decode_seconds": round(decode_s, 4),
        "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_tokens else None,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "outputs": outputs}, indent=2))


if __name__ == "__main__":
    main()
