"""Held-out perplexity of the dense model, RTN int4 and AWQ int4 (Lin et al. 2023).

All three are served by Tandem's offline ``LLM`` in float32 and scored through
``prompt_logprobs`` (the log-probability of every held-out token given the tokens
before it; perplexity ``exp(-mean)``). RTN and AWQ use the same quantizer
(asymmetric round-to-nearest per group), the same checkpoint layout and the same
loader: RTN is :func:`~tandem.quantize.awq.awq_quantize` with only
``alpha = 0`` (``grid=1``) and no clipping search, so the rows differ only in the
AWQ searches.

    .venv/bin/python benchmarks/awq_perplexity.py \\
        --calibration tests/data/awq_calibration.txt --heldout tests/data/awq_heldout.txt

The default model's linears have input widths 576 and 1536, so the group size is
64 (128 does not divide 576).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time


def perplexity(llm, text: str) -> tuple[float, int]:
    """``(perplexity, scored tokens)`` of ``text`` under ``llm`` (one prompt; every
    token after the first is scored)."""
    from tandem.engine.sampling.sampling_params import SamplingParams

    ids = llm.tokenizer.encode(text)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1,
                                             prompt_logprobs=0))[0]
    lps = [p.logprob for p in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps)), len(lps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="dense source (default: the default model)")
    p.add_argument("--calibration", required=True, help="calibration text file")
    p.add_argument("--heldout", required=True, help="held-out text file (not the calibration)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length")
    p.add_argument("--grid", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    p.add_argument("--out-dir", default=None, help="keep the checkpoints here (default: temp)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)

    import torch

    from tandem.engine.llm import LLM
    from tandem.quantize.awq import awq_quantize

    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.calibration) as f:
        calibration = f.read()
    with open(args.heldout) as f:
        heldout = f.read()
    if calibration.strip() == heldout.strip():
        p.error("--heldout must differ from --calibration")
    root = args.out_dir or tempfile.mkdtemp(prefix="awq-ppl-")
    common = dict(group_size=args.group_size, num_calibration_tokens=args.calibration_tokens,
                  calibration_seq_len=args.seq_len)
    variants = [("dense", None, None),
                ("RTN", os.path.join(root, "rtn"), dict(grid=1, clip=False)),
                ("AWQ scales only", os.path.join(root, "awq-noclip"),
                 dict(grid=args.grid, clip=False)),
                ("AWQ", os.path.join(root, "awq"), dict(grid=args.grid, clip=True))]
    rows = []
    for name, path, kw in variants:
        seconds = None
        if path is None:
            llm = LLM(args.model, dtype="float32", num_blocks=256)
        else:
            t = time.perf_counter()
            stats = awq_quantize(args.model, path, calibration, **common, **kw)
            seconds = time.perf_counter() - t
            llm = LLM(path, dtype="float32", quantization="awq", num_blocks=256)
        ppl, n = perplexity(llm, heldout)
        rows.append({"variant": name, "perplexity": ppl, "tokens": n,
                     "quantize_seconds": seconds,
                     "calibration_tokens": None if path is None else stats["calibration_tokens"]})
        print(f"{name:16s} ppl {ppl:8.3f}  ({n} held-out tokens"
              + ("" if seconds is None else f", quantized in {seconds:.0f} s on "
                 f"{stats['calibration_tokens']} calibration tokens") + ")", flush=True)
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"group_size": args.group_size, "grid": args.grid, "rows": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
