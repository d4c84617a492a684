"""KV blocks a long prompt holds on a model whose every layer has a sliding window.

A tiny random Mistral (transformers ``from_config``: hidden 64, 2 layers, 4 query /
2 KV heads of 16) is written twice, once with ``--window`` on every layer and once
with ``sliding_window: null`` (full attention, otherwise the same weights). Each
serves one ``--prompt-len``-token prompt for ``--max-tokens`` greedy tokens through
``LLM`` on CPU (float32, block size 16, chunked prefill of ``--chunk`` tokens); the
step callback records the blocks the request holds after every step. Reports, per
model: blocks held at the last step, the peak during prefill and decode, the
pool's peak use, the engine's ``max_model_len`` for a pool of ``--small-pool``
blocks, and whether the windowed run's greedy ids equal transformers'.

    python benchmarks/sliding_window_kv.py --out benchmarks/results/sliding_window_kv.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.sampling.sampling_params import SamplingParams  # noqa: E402
from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint  # noqa: E402


def measure(path: str, prompt: list[int], args) -> dict:
    llm = LLM(path, dtype="float32", block_size=args.block_size, num_blocks=args.num_blocks,
              max_num_batched_tokens=args.chunk, max_model_len=4096)
    kv = llm.engine.kv_cache_manager
    held: list[int] = []
    used: list[int] = []

    def watch(engine) -> None:
        for req in engine.scheduler.running:
            held.append(kv.num_held_blocks(req.request_id))
        used.append(kv.block_pool.num_used_blocks)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, step_callback=watch)[0].outputs[0].token_ids
    seconds = time.perf_counter() - t0
    num_prefill_steps = -(-len(prompt) // args.chunk)
    small = LLM(path, dtype="float32", block_size=args.block_size,
                num_blocks=args.small_pool, max_num_batched_tokens=args.chunk,
                weights_from=llm)
    return {"token_ids": out, "blocks_held_last_step": held[-1],
            "peak_blocks_prefill": max(held[:num_prefill_steps]),
            "peak_blocks_decode": max(held[num_prefill_steps:]),
            "peak_pool_blocks_used": max(used), "seconds": round(seconds, 2),
            "sliding_window": kv.sliding_window,
            "max_model_len_small_pool": small.engine.max_model_len}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--small-pool", type=int, default=64)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    prompt = [random.Random(0).randrange(3, VOCAB) for _ in range(args.prompt_len)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("windowed", args.window), ("full_attention", None)):
            path = pathlib.Path(tmp) / name
            hf = save_tiny_checkpoint(path, "MistralConfig", sliding_window=window,
                                      max_position_embeddings=4096)
            results[name] = measure(str(path), prompt, args)
            if name == "windowed":
                results[name]["equals_transformers"] = (
                    results[name]["token_ids"] == hf_greedy(hf, prompt, args.max_tokens))
    for r in results.values():
        r.pop("token_ids")
    report = {"config": vars(args) | {"out": str(args.out)}, "results": results}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
