"""Perplexity of quantized and dense systems on held-out text, through the public
``LLM`` API.

The text is ``quantize/data/heldout.txt`` (English prose written for
this project, none of it in the calibration text). It is tokenized whole, without
special tokens, and cut into segments of ``--segment-len`` tokens, each scored as
its own prompt with ``SamplingParams(prompt_logprobs=0)``: position ``p >= 1`` of a
segment contributes ``log P(token_p | tokens_<p)``, and

    ppl = exp(-mean log-probability over all scored positions)

(the first token of each segment has no context and is not scored).

Systems are entries of :data:`SYSTEMS`: a name -> a function from the run's
:class:`Context` to the ``LLM(...)`` keyword arguments. Quantized checkpoints are
made once with ``tandem quantize``'s code into ``--cache-dir`` (keyed by the
model file, the method and its settings, and the calibration text) and reused.
GGUF blocks served natively (the file's Q4_1, and the file requantized to Q8_0,
Q6_K, Q5_0, Q4_K_M, Q4_K, Q4_0; ``--gguf-file NAME=PATH`` adds any other GGUF file),
AWQ (made once with the shipped calibration text), an FP8 and an int4 KV cache
are entries too. Note on the KV entries: a prefill chunk over a quantized cache
reads its own K/V back from the cache, so prompt log-probabilities see the
quantized KV.

    .venv/bin/python benchmarks/perplexity.py --out benchmarks/results/perplexity_heldout.json

Prints a markdown table; the JSON has every system's numbers and the command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.engine.llm import LLM
from tandem.engine.model.model_files import cache_dir, resolve_model
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.quantize.autogptq import quantize_model
from tandem.quantize.dense import calibration_segments, data_path

_QUANTIZED_FORMAT = "2"     # bump when quantize_model's output changes


@dataclass
class Context:
    """What a system's entry may use to build its ``LLM`` arguments.

    Attributes:
        model: the source model (None: the default GGUF file).
        cache_dir: where quantized checkpoints are kept.
    """

    model: str | None
    cache_dir: str

    def quantized(self, method: str, bits: int = 4, group_size: int = 128,
                  desc_act: bool = False, damp: float = 0.01,
                  uniform_hessian: bool = False) -> str:
        """The checkpoint directory of ``model`` quantized so, made if absent."""
        files = resolve_model(self.model)
        with open(data_path("calibration.txt"), "rb") as f:
            calibration = hashlib.sha256(f.read()).hexdigest()[:16]
        st = os.stat(files.path)
        settings = [os.path.realpath(files.path), str(st.st_size), str(st.st_mtime_ns), method,
                    str(bits), str(group_size), str(desc_act), str(damp),
                    str(uniform_hessian), calibration, _QUANTIZED_FORMAT]
        key = hashlib.sha256("|".join(settings).encode()).hexdigest()[:12]
        path = os.path.join(self.cache_dir, f"{files.name}-{method}-int{bits}-g{group_size}"
                            + ("-act" if desc_act else "") + ("-uniform" if uniform_hessian else "")
                            + f"-{key}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            t0 = time.perf_counter()
            print(f"quantizing {files.name} ({method}, int{bits}, g{group_size}"
                  f"{', act-order' if desc_act else ''}{', uniform Hessian' if uniform_hessian else ''}"
                  f") into {path} ...", file=sys.stderr, flush=True)
            quantize_model(self.model, path, method, bits=bits, group_size=group_size,
                           desc_act=desc_act, damp=damp, uniform_hessian=uniform_hessian,
                           progress=sys.stderr.isatty())
            print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return path

    def requantized_gguf(self, qtype: str) -> str:
        """The default GGUF file rewritten in block type ``qtype`` (made if absent)."""
        from tandem.quantize.gguf_writer import REQUANTIZE_VERSION, requantize_gguf

        files = resolve_model(self.model)
        st = os.stat(files.path)
        key = hashlib.sha256("|".join([os.path.realpath(files.path), str(st.st_size),
                                       str(st.st_mtime_ns), qtype,
                                       str(REQUANTIZE_VERSION)]).encode()).hexdigest()[:12]
        path = os.path.join(self.cache_dir, f"{files.name}-{qtype}-{key}.gguf")
        if not os.path.isfile(path):
            os.makedirs(self.cache_dir, exist_ok=True)
            requantize_gguf(files.path, path, qtype)
        return path

    def awq(self, group_size: int = 64, num_calibration_tokens: int = 512) -> str:
        """The AWQ checkpoint of ``model`` (int4, the shipped calibration text), made
        if absent."""
        from tandem.quantize.awq import awq_quantize

        files = resolve_model(self.model)
        with open(data_path("calibration.txt"), encoding="utf-8") as f:
            text = f.read()
        st = os.stat(files.path)
        key = hashlib.sha256("|".join([os.path.realpath(files.path), str(st.st_size),
                                       str(st.st_mtime_ns), str(group_size),
                                       str(num_calibration_tokens), text]).encode()
                             ).hexdigest()[:12]
        path = os.path.join(self.cache_dir, f"{files.name}-awq-int4-g{group_size}-{key}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            awq_quantize(self.model, path, text, group_size=group_size,
                         num_calibration_tokens=num_calibration_tokens)
        return path


# name -> (description of the weights, LLM kwargs from the context).
SYSTEMS: dict[str, tuple[str, Callable[[Context], dict]]] = {
    "dense-f32": ("GGUF Q4_1 dequantized at load, float32",
                  lambda ctx: {"model": ctx.model, "dtype": "float32"}),
    "dense-bf16": ("GGUF Q4_1 dequantized at load, bfloat16",
                   lambda ctx: {"model": ctx.model, "dtype": "bfloat16"}),
    "rtn-int4-g128": ("round-to-nearest int4, group 128 (GPTQ layout), float32",
                      lambda ctx: {"model": ctx.quantized("rtn"), "dtype": "float32"}),
    "gptq-int4-g128": ("GPTQ int4, group 128, float32",
                       lambda ctx: {"model": ctx.quantized("gptq"), "dtype": "float32"}),
    "gptq-int4-g128-act": ("GPTQ int4, group 128, act-order, float32",
                           lambda ctx: {"model": ctx.quantized("gptq", desc_act=True),
                                        "dtype": "float32"}),
    "gptq-int4-g128-uniform": ("GPTQ int4, group 128, the paper's uniform Hessian, float32",
                               lambda ctx: {"model": ctx.quantized("gptq", uniform_hessian=True),
                                            "dtype": "float32"}),
    "gptq-int4-g128-bf16": ("GPTQ int4, group 128, served in bfloat16",
                            lambda ctx: {"model": ctx.quantized("gptq"), "dtype": "bfloat16"}),
    "rtn-int4-g64": ("round-to-nearest int4, group 64 (GPTQ layout), float32",
                     lambda ctx: {"model": ctx.quantized("rtn", group_size=64),
                                  "dtype": "float32"}),
    "gptq-int4-g64": ("GPTQ int4, group 64, float32",
                      lambda ctx: {"model": ctx.quantized("gptq", group_size=64),
                                   "dtype": "float32"}),
    "awq-int4-g64": ("AWQ int4, group 64 (512 calibration tokens), float32",
                     lambda ctx: {"model": ctx.awq(64), "dtype": "float32"}),
    "gguf-q4_1": ("the file's Q4_1 blocks kept packed (quantization=gguf), float32",
                  lambda ctx: {"model": ctx.model, "dtype": "float32", "quantization": "gguf"}),
    **{f"gguf-{qtype.lower()}": (f"the file requantized to {what}, blocks kept packed, float32",
                                 lambda ctx, qtype=qtype: {"model": ctx.requantized_gguf(qtype),
                                                           "dtype": "float32",
                                                           "quantization": "gguf"})
       for qtype, what in [("Q8_0", "Q8_0"), ("Q6_K", "Q6_K (576-wide rows: Q8_0)"),
                           ("Q5_0", "Q5_0"),
                           ("Q4_K_M", "llama.cpp's Q4_K_M mix (576-wide rows: Q5_0 / Q8_0)"),
                           ("Q4_K", "Q4_K (576-wide rows: Q5_0)"), ("Q4_0", "Q4_0")]},
    # Int8 activation blocks are used by decode-sized products; batch_invariant runs
    # every product, prompt tokens too, through that kernel, so that prompt
    # log-probabilities see them (the -bi entry is the same path with float
    # activations).
    "gguf-q4_1-bi": ("Q4_1 blocks kept packed, float activations, every product through "
                     "the decode kernel (batch_invariant), float32",
                     lambda ctx: {"model": ctx.model, "dtype": "float32", "quantization": "gguf",
                                  "batch_invariant": True}),
    "gguf-q4_1-int8act": ("Q4_1 blocks kept packed, int8 activation blocks in every product "
                          "(activation_quantization=int8, batch_invariant), float32",
                          lambda ctx: {"model": ctx.model, "dtype": "float32",
                                       "quantization": "gguf", "batch_invariant": True,
                                       "activation_quantization": "int8"}),
    "gguf-q4_k_m-int8act": ("the file requantized to llama.cpp's Q4_K_M mix, int8 activation "
                            "blocks in every product (batch_invariant), float32",
                            lambda ctx: {"model": ctx.requantized_gguf("Q4_K_M"),
                                         "dtype": "float32", "quantization": "gguf",
                                         "batch_invariant": True,
                                         "activation_quantization": "int8"}),
    "gptq-int4-g128-act-int8act": ("GPTQ int4, group 128, act-order, int8 activation blocks "
                                   "in every product (batch_invariant), float32",
                                   lambda ctx: {"model": ctx.quantized("gptq", desc_act=True),
                                                "dtype": "float32", "batch_invariant": True,
                                                "activation_quantization": "int8"}),
    "dense-f32-fp8kv": ("dense float32 weights, fp8 e4m3 KV cache",
                        lambda ctx: {"model": ctx.model, "dtype": "float32",
                                     "kv_cache_dtype": "fp8_e4m3"}),
    "gguf-q4_1-fp8kv": ("Q4_1 blocks kept packed and an fp8 e4m3 KV cache, float32",
                        lambda ctx: {"model": ctx.model, "dtype": "float32",
                                     "quantization": "gguf", "kv_cache_dtype": "fp8_e4m3"}),
    "dense-f32-int4kv": ("dense float32 weights, int4 KV cache",
                         lambda ctx: {"model": ctx.model, "dtype": "float32",
                                      "kv_cache_dtype": "int4"}),
    "dense-f32-int4kv-torch": ("dense float32 weights, int4 KV cache, torch attention backend",
                               lambda ctx: {"model": ctx.model, "dtype": "float32",
                                            "kv_cache_dtype": "int4",
                                            "attention_backend": "torch"}),
    "gguf-q4_1-int4kv": ("Q4_1 blocks kept packed and an int4 KV cache, float32",
                         lambda ctx: {"model": ctx.model, "dtype": "float32",
                                      "quantization": "gguf", "kv_cache_dtype": "int4"}),
    "dense-bf16-int4kv": ("dense bfloat16 weights, int4 KV cache",
                          lambda ctx: {"model": ctx.model, "dtype": "bfloat16",
                                       "kv_cache_dtype": "int4"}),
}
DEFAULT_SYSTEMS = list(SYSTEMS)


def perplexity(llm: LLM, segments: list[list[int]]) -> tuple[float, float, int]:
    """``(ppl, mean negative log-likelihood in nats, scored tokens)`` of ``segments``."""
    outs = llm.generate(segments, SamplingParams(max_tokens=1, temperature=0.0,
                                                 prompt_logprobs=0))
    logprobs = [lp.logprob for out in outs for lp in out.prompt_logprobs if lp is not None]
    nll = -sum(logprobs) / len(logprobs)
    return math.exp(nll), nll, len(logprobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS))
    p.add_argument("--model", default=None, help="source model (default: the default GGUF)")
    p.add_argument("--segment-len", type=int, default=512)
    p.add_argument("--cache-dir", default=os.path.join(cache_dir() or "/tmp/tandem", "quantized"),
                   help="quantized checkpoints (made once, reused)")
    p.add_argument("--gguf-file", action="append", default=[], metavar="NAME=PATH",
                   help="also score this GGUF file, its blocks kept packed, float32, as "
                        "system NAME (e.g. llama.cpp's own requantization of the model, "
                        "benchmarks/llama_cpp_quantize.py)")
    p.add_argument("--segments-out", default=None,
                   help="also write the scored token segments here (JSON), for "
                        "benchmarks/llama_cpp_perplexity.py")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    for spec in args.gguf_file:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.isfile(path):
            p.error(f"--gguf-file: expected NAME=PATH of an existing file, got {spec!r}")
        SYSTEMS[name] = (f"{os.path.basename(path)}, blocks kept packed, float32",
                         lambda ctx, path=path: {"model": path, "dtype": "float32",
                                                 "quantization": "gguf"})
        args.systems.append(name)

    ctx = Context(args.model, args.cache_dir)
    text_path = data_path("heldout.txt")
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    results = {}
    segments = None
    for name in args.systems:
        description, build = SYSTEMS[name]
        kwargs = build(ctx)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        if segments is None:
            segments = [s.tolist() for s in calibration_segments(llm.tokenizer, text,
                                                                 args.segment_len)]
            if args.segments_out:
                with open(args.segments_out, "w") as f:
                    json.dump({"text": "quantize/data/heldout.txt",
                               "segment_len": args.segment_len, "segments": segments}, f)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ppl, nll, n = perplexity(llm, segments)
        results[name] = {"description": description, "llm_kwargs": kwargs,
                         "quantization": type(llm.engine.model.model.layers[0].mlp.down_proj
                                              .quant_method).__name__,
                         "ppl": ppl, "nll": nll, "scored_tokens": n,
                         "load_s": round(load_s, 2), "eval_s": round(time.perf_counter() - t0, 2)}
        print(f"{name}: ppl {ppl:.4f} ({n} tokens)", file=sys.stderr, flush=True)
        del llm

    base = results.get("dense-f32", {}).get("ppl")
    lines = ["| system | weights | perplexity | vs dense-f32 |", "|---|---|---|---|"]
    for name, r in results.items():
        rel = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else "-"
        lines.append(f"| {name} | {r['description']} | {r['ppl']:.3f} | {rel} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        doc = {"command": " ".join(["python", "benchmarks/perplexity.py", *(argv or sys.argv[1:])]),
               "text": "quantize/data/heldout.txt", "segment_len": args.segment_len,
               "segments": len(segments or []), "machine": platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "systems": results, "table": table}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
