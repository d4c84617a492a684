"""Speculative decoding on vs off: output tokens/s and mean acceptance length.

Workloads (greedy, up to ``--max-tokens`` tokens, the model's own EOS ends a sample):

* ``copy``: copy-heavy requests - edit or summarise a given passage (the answer
  repeats long spans of its prompt, where n-gram lookup shines);
* ``open``: open generation (stories, explanations), where the answer has little
  to copy.

Each workload runs at batch 1 (its prompts one after the other) and batch 16 (16
prompts at once), with speculation off, ``ngram`` (prompt lookup, ``k`` tokens) and
``draft_model`` (self-drafting with the target model itself: every draft is
accepted, so it shows the most a draft model could give, minus what drafting
costs). All in this process, on the offline engine, one warm-up run per system.

    python benchmarks/spec_decode.py --dtype float32 --out benchmarks/results/spec_decode_float32.json

Prints tokens/s, the speedup over no speculation, and the mean acceptance length
(tokens emitted per verification step, bonus included: ``1 + accepted / drafts``).
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


PASSAGES = [
    "The lighthouse stood at the end of a long stone pier. Every night the keeper climbed "
    "the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. "
    "Ships far out at sea saw the beam sweep across the water every ten seconds, and knew "
    "that the rocks of the headland were near.",
    "Bread is made from flour, water, salt and yeast. The yeast feeds on the sugars in the "
    "flour and releases carbon dioxide, which is trapped by the gluten and makes the dough "
    "rise. Baking sets the structure, browns the crust and drives off most of the water.",
    "The city council met on Tuesday to discuss the new bicycle lanes. Supporters said the "
    "lanes would make the streets safer and cut traffic, while shop owners worried about "
    "losing parking spaces in front of their stores. A final vote is planned for next month.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the "
    "snow is pressed into ice, which slowly flows downhill under its own weight, carving "
    "valleys, moving boulders and leaving long ridges of rock and gravel where it melts.",
]
COPY_TASKS = [
    "Correct any spelling mistakes in the following text and return the whole text:\n\n{p}",
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Rewrite the following text, keeping every sentence, but put it in the past tense:\n\n{p}",
    "Summarise the following text, quoting its key sentences:\n\n{p}",
]
OPEN_TASKS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Describe a walk through a forest in autumn.",
    "Give advice to someone starting to learn the piano.",
]


def workload(name: str, tokenizer, n: int) -> list[list[int]]:
    if name == "copy":
        texts = [COPY_TASKS[i % 4].format(p=PASSAGES[(i // 4) % 4]) for i in range(n)]
    else:
        texts = [OPEN_TASKS[i % 4] + ("" if i < 4 else f" (version {i // 4})") for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def run(llm, prompts, params, batch: int) -> tuple[float, list[list[int]]]:
    """Wall seconds and outputs for ``prompts`` in batches of ``batch``."""
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], params)]
    return time.perf_counter() - t0, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--batch-1-prompts", type=int, default=4)
    ap.add_argument("--systems", default="off,ngram,draft_model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    base = LLM(dtype=args.dtype, num_blocks=2048)
    configs = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens},
               "draft_model": {"method": "draft_model",
                               "num_speculative_tokens": args.num_speculative_tokens}}
    systems = args.systems.split(",")
    results = []
    for wl in ("copy", "open"):
        for batch, n in ((1, args.batch_1_prompts), (16, 16)):
            prompts = workload(wl, base.tokenizer, n)
            ref = None
            for name in systems:
                llm = base if configs[name] is None else LLM(
                    dtype=args.dtype, num_blocks=2048, speculative_config=configs[name],
                    weights_from=base)
                run(llm, prompts[:batch], params, batch)                 # warm-up
                st = llm.engine.scheduler.spec_stats
                before = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
                wall, outs = run(llm, prompts, params, batch)
                drafts = st.num_drafts - before[0]
                drafted, accepted = st.num_draft_tokens - before[1], st.num_accepted_tokens - before[2]
                tokens = sum(len(o) for o in outs)
                ref = outs if ref is None else ref
                row = dict(workload=wl, batch=batch, system=name, prompts=n, output_tokens=tokens,
                           wall_s=round(wall, 3), tokens_per_s=round(tokens / wall, 2),
                           mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None,
                           draft_acceptance_rate=round(accepted / drafted, 3) if drafted else None,
                           same_tokens_as_off=outs == ref)
                results.append(row)
                off = next(r for r in results if r["workload"] == wl and r["batch"] == batch)
                print(f"{wl:5s} batch {batch:2d} {name:12s} {row['tokens_per_s']:7.1f} tok/s "
                      f"x{row['tokens_per_s'] / off['tokens_per_s']:.2f}  acceptance length "
                      f"{row['mean_acceptance_length']}  rate {row['draft_acceptance_rate']}  "
                      f"same tokens {row['same_tokens_as_off']}", flush=True)
                if llm is not base:
                    del llm
    if args.out:
        meta = dict(command=" ".join(["python", *sys.argv]), dtype=args.dtype,
                    max_tokens=args.max_tokens, num_speculative_tokens=args.num_speculative_tokens,
                    cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                    cores=os.cpu_count())
        Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
