"""The CPU backend's decode path from the fused QKV (``decode_from_qkv``) against the
general path, per layer: the offline engine's decode step, both in one process.

Two engines share the model's weights (``weights_from``); on the first, the
backend's ``decode_from_qkv`` is switched off, so its decode steps take the general
path (the Q/K/V split, then :func:`ops.rotary_embedding`,
:func:`ops.reshape_and_cache` and :func:`ops.paged_decode_attention`, each
checking and converting its tensors in every layer); the second runs as by default
(the same three kernels from one call per layer, with the step's slots, tables and
lengths prepared once per step). For each batch size in ``--num-seqs`` both engines
get the same random ``--prompt-len``-token prompts (greedy, EOS ignored), prefill
them, and then decode in turn, ``--block`` steps at a time for ``--blocks`` blocks
each, so that the host's drifting speed falls on both; the median step of each is
reported, with the greedy outputs checked equal.

    .venv/bin/python benchmarks/decode_from_qkv.py --out benchmarks/results/decode_from_qkv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from decode_race import (print_race, race, race_arguments,  # noqa: E402
                         race_engine_kwargs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = race_arguments(p, [1, 16, 64])
    threads, kw = race_engine_kwargs(args)

    from tandem.engine.llm import LLM

    fast = LLM(None, **kw)
    general = LLM(None, weights_from=fast, **kw)
    if general.engine.backend.name != "cpu":
        print(f"the engine's backend is {general.engine.backend.name!r}, not the CPU one")
        return 1
    general.engine.backend.decode_from_qkv = lambda *a, **k: None
    engines = {"general": general.engine, "decode_from_qkv": fast.engine}
    rows = race(engines, args)

    print(f"{args.dtype}, {threads} threads\n")
    print_race(rows, {"general": "general path", "decode_from_qkv": "decode_from_qkv"})
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": sys.argv, "dtype": args.dtype, "threads": threads,
            "cpu_flags": isa_flags(), "prompt_len": args.prompt_len, "block": args.block,
            "blocks": args.blocks, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["outputs_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
