"""The alternated decode-step race of two offline engines in one process, shared by
``huge_page_weights.py`` and ``decode_from_qkv.py``: their options, their engines'
settings, and the race itself (the engines decode the same prompts in turn, so the
host's drifting speed falls on both)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_overhead import random_prompts  # noqa: E402


def race_arguments(p: argparse.ArgumentParser, num_seqs: list[int]) -> argparse.Namespace:
    """The options of an alternated decode-step race (``--dtype``, ``--num-seqs``,
    ``--prompt-len``, ``--block``, ``--blocks``, ``--out``), parsed."""
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, nargs="+", default=num_seqs)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--out", default=None)
    return p.parse_args()


def race_engine_kwargs(args: argparse.Namespace) -> tuple[int, dict]:
    """``(threads, LLM keyword arguments)`` of a race's engines: every core this
    process may use, prefix caching off, room for the largest batch."""
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads, dict(dtype=args.dtype, num_threads=threads, enable_prefix_caching=False,
                         max_num_seqs=max(args.num_seqs, default=1))


def alternated_decode_steps(engines: dict, num_seqs: int, prompt_len: int, block: int,
                            blocks: int) -> dict:
    """Two offline engines (``{name: LLMEngine}``) given the same ``num_seqs`` random
    ``prompt_len``-token prompts (greedy, EOS ignored), prefilled, then decoding in
    turn, ``block`` steps at a time for ``blocks`` blocks each (the host's drifting
    speed falls on both), then run to the end.

    Returns:
        ``{"num_seqs", "outputs_equal", "<name> step ms": median step, ...}``.
    """
    from tandem.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=block * blocks + 8, ignore_eos=True)
    prompts = random_prompts(num_seqs, prompt_len, num_seqs)
    reqs = {name: [r for pr in prompts for r in eng.add_request(pr, params)]
            for name, eng in engines.items()}
    for name, eng in engines.items():
        while not all(r.output_token_ids for r in reqs[name]):
            eng.step()
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(2 * blocks):
        name = list(engines)[i % 2]
        for _ in range(block):
            t0 = time.perf_counter()
            engines[name].step()
            steps[name].append(time.perf_counter() - t0)
    for eng in engines.values():
        while eng.has_unfinished_requests():
            eng.step()
    a, b = ([r.output_token_ids for r in rs] for rs in reqs.values())
    return {"num_seqs": num_seqs, "outputs_equal": a == b,
            **{f"{k} step ms": statistics.median(v) * 1e3 for k, v in steps.items()}}


def race(engines: dict, args: argparse.Namespace) -> list[dict]:
    """:func:`alternated_decode_steps` for every batch size of ``args.num_seqs``."""
    return [alternated_decode_steps(engines, n, args.prompt_len, args.block, args.blocks)
            for n in args.num_seqs]


def print_race(rows: list[dict], labels: dict[str, str]) -> None:
    """A race's rows as a table: per batch size, each engine's median step (``labels``:
    ``{engine name: column title}``, in column order) and whether the outputs were
    equal."""
    print("| sequences | " + " | ".join(f"{t}: step ms" for t in labels.values())
          + " | outputs equal |")
    print("|---|" + "---|" * len(labels) + "---|")
    for r in rows:
        print(f"| {r['num_seqs']} | " + " | ".join(f"{r[n + ' step ms']:.1f}" for n in labels)
              + f" | {r['outputs_equal']} |")
