"""llama.cpp as a peer for perplexity: the same token segments perplexity.py
scores, evaluated by llama.cpp on a GGUF file.

Runs in the venv of llama-cpp-python (see llama_cpp_peer.py). The segments come
from ``perplexity.py --segments-out FILE`` (token ids of the held-out text, so both
engines score exactly the same tokens; llama.cpp's own tokenizer is not used).
Each segment is evaluated from an empty context with every position's logits kept
(``logits_all``); position ``p >= 1`` contributes ``log softmax(logits[p - 1])[t_p]``
in float64, and ``ppl = exp(-mean)``, as perplexity.py computes it.

    .peers/lcpp-venv/bin/python benchmarks/llama_cpp_perplexity.py MODEL.gguf SEGMENTS.json

Prints one JSON object, on one line.
"""

from __future__ import annotations

import argparse
import json
import math
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("segments", help="JSON: {\"segments\": [[token ids], ...]}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp
    import numpy as np

    with open(args.segments) as f:
        segments = json.load(f)["segments"]
    n_ctx = max(map(len, segments))
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=n_ctx, n_batch=n_ctx,
                          logits_all=True, verbose=False)
    t0 = time.perf_counter()
    nll, n = 0.0, 0
    for seg in segments:
        llm.reset()
        llm.eval(seg)
        logits = np.asarray(llm.scores[:len(seg)], dtype=np.float64)      # [T, V]
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(sum(logp[p - 1, seg[p]] for p in range(1, len(seg))))
        n += len(seg) - 1
    print(json.dumps({"system": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
                      "model": args.model, "file_type": llm.metadata.get("general.file_type"),
                      "ppl": math.exp(nll / n), "nll": nll / n, "scored_tokens": n,
                      "seconds": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
    main()
