"""The ``tandem`` command line.

    tandem generate "prompt" ...          offline: run the engine in this process
    tandem generate --chat "question" ... the same through the model's chat template
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args):
    from tandem.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def _cmd_generate(args) -> int:
    from tandem.engine.llm_engine import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
              num_blocks=args.num_blocks, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
              enable_prefix_caching=not args.no_prefix_caching,
              enable_chunked_prefill=not args.no_chunked_prefill, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend)
    params = _sampling_params(args)
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(list(args.prompts), params)
    dt = time.perf_counter() - t0
    n_out = 0
    for prompt, out in zip(args.prompts, outs):
        c = out.outputs[0]
        n_out += len(c.token_ids)
        print(f"\n>>> {prompt}\n{c.text.strip()}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    print(f"\n{len(outs)} prompts, {n_out} output tokens in {dt:.2f} s "
          f"({n_out / dt:.1f} tok/s, batched)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (engine in this process)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=_cmd_generate)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
