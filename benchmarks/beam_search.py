"""Beam search KV memory: beams sharing blocks (reference counts, copy-on-write) vs
each beam holding its own copy.

For each beam width W, on the same prompt and the same number of new tokens:

* **shared**: ``LLM.beam_search`` (``ignore_eos``, so every beam runs the full
  length): the beams fork their parents' blocks each step; the prompt's blocks
  and the beams' common prefix are held once.
* **unshared**: the footprint of W beams that share nothing, measured by running
  W independent requests of the same length (prompt + new tokens) side by side,
  each with its own blocks - what beam search costs when each beam is its own
  request.

Both runs have prefix caching off, so the only sharing is the fork's. Peak = the
most blocks held by requests after any engine step (``num_blocks -
num_free_blocks``); bytes = blocks x the bytes of one block over all layers (K
and V). Also reported: the wall time of the shared run.

Usage::

    .venv/bin/python benchmarks/beam_search.py --widths 4 16 --prompt-tokens 512 \\
        --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time

from tandem.engine.llm import LLM
from tandem.engine.runtime.beam_search import BeamSearchParams
from tandem.engine.runtime.model_runner import KVCache
from tandem.engine.runtime.kv_scales import kv_cache_torch_dtype
from tandem.engine.sampling.sampling_params import SamplingParams

TEXT = ("The history of the city begins with a small settlement on the river, where "
        "traders met to exchange grain, salt and cloth. Over the centuries it grew into ")


class PeakBlocks:
    """Step callback: the most blocks held at once, and the invariants every step."""

    def __init__(self):
        self.peak = 0

    def __call__(self, engine) -> None:
        kv = engine.kv_cache_manager
        self.peak = max(self.peak, kv.num_blocks - kv.num_free_blocks)
        engine.check_invariants()


def run(llm: LLM, prompt: list[int], width: int, max_tokens: int) -> dict:
    kv = llm.engine.kv_cache_manager
    free0 = kv.num_free_blocks
    shared = PeakBlocks()
    t0 = time.perf_counter()
    llm.beam_search([{"prompt_token_ids": prompt}],
                    BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True),
                    step_callback=shared)
    seconds = time.perf_counter() - t0
    assert kv.num_free_blocks == free0, "beam search leaked blocks"
    unshared = PeakBlocks()
    llm.generate([{"prompt_token_ids": prompt}] * width,
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                 step_callback=unshared)
    assert kv.num_free_blocks == free0
    return {"width": width, "shared_peak_blocks": shared.peak,
            "unshared_peak_blocks": unshared.peak, "shared_seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
              enable_prefix_caching=False, max_num_seqs=max(args.widths))
    ids = llm.tokenizer.encode(TEXT * (args.prompt_tokens // 20 + 1))[:args.prompt_tokens]
    cfg = llm.engine.config
    bytes_per_block = KVCache.bytes_per_block(
        llm.engine.model_config, args.block_size,
        kv_cache_torch_dtype(cfg.cache.kv_cache_dtype, cfg.torch_dtype))
    rows = [run(llm, ids, w, args.max_tokens) for w in args.widths]
    print(f"prompt {len(ids)} tokens, {args.max_tokens} new tokens per beam, block size "
          f"{args.block_size}, {args.dtype} KV ({bytes_per_block} bytes per block)")
    print("| beam width | peak blocks shared | peak blocks unshared | shared / unshared "
          "| peak MiB shared | peak MiB unshared | shared run (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s, u = r["shared_peak_blocks"], r["unshared_peak_blocks"]
        r["bytes_per_block"] = bytes_per_block
        print(f"| {r['width']} | {s} | {u} | {s / u:.2f} | {s * bytes_per_block / 2**20:.1f} "
              f"| {u * bytes_per_block / 2**20:.1f} | {r['shared_seconds']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
