"""The loaded weights in transparent huge pages or in 4 KiB pages: the offline
engine's decode step, both in one process.

Two engines of the same model are built in one process, the first with
``TANDEM_HUGE_PAGES=0`` (its weights stay in 4 KiB pages), the second as by
default (the memory its load added collapsed into 2 MiB pages,
:mod:`tandem.engine.runtime.huge_pages`); both KV caches are in huge pages
either way. For each batch size in ``--num-seqs``, both engines get the same random
``--prompt-len``-token prompts (greedy, EOS ignored), prefill them, and then decode
in turn, ``--block`` steps at a time for ``--blocks`` blocks each, so that the
host's drifting speed falls on both; the median step of each is reported, with the
greedy outputs checked equal (the pages hold the same bytes).

    .venv/bin/python benchmarks/huge_page_weights.py --out benchmarks/results/huge_page_weights.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402
from decode_race import (print_race, race, race_arguments,  # noqa: E402
                         race_engine_kwargs)


def anon_huge_mib() -> float:
    """This process's anonymous memory in huge pages (smaps_rollup), MiB."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages")) / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = race_arguments(p, [1, 64])
    threads, kw = race_engine_kwargs(args)

    from tandem.engine.llm import LLM

    huge0 = anon_huge_mib()
    os.environ["TANDEM_HUGE_PAGES"] = "0"
    small = LLM(None, **kw).engine
    huge1 = anon_huge_mib()
    del os.environ["TANDEM_HUGE_PAGES"]
    huge = LLM(None, **kw).engine
    huge2 = anon_huge_mib()
    engines = {"4 KiB pages": small, "huge pages": huge}
    rows = race(engines, args)

    print(f"{args.dtype}, {threads} threads; anonymous huge pages: {huge0:.0f} MiB at start, "
          f"{huge1:.0f} after the first engine, {huge2:.0f} after the second\n")
    print_race(rows, {"4 KiB pages": "4 KiB pages", "huge pages": "huge pages"})
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": sys.argv, "dtype": args.dtype, "threads": threads,
            "cpu_flags": isa_flags(), "anon_huge_pages_mib": [huge0, huge1, huge2],
            "prompt_len": args.prompt_len, "block": args.block, "blocks": args.blocks,
            "rows": rows}, indent=1) + "\n")
    return 0 if all(r["outputs_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
