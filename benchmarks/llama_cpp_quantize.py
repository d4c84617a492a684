"""llama.cpp's quantizer as a peer: a GGUF file rewritten by ``llama_model_quantize``.

Runs in the venv of llama-cpp-python (see llama_cpp_peer.py for installing it), so
that Tandem's own requantization (``tandem quantize --method q4_k_m``, ...) can be
compared with llama.cpp's on the same source file: perplexity.py scores both files
through Tandem's engine (``--gguf-file NAME=PATH``), so any difference comes from
the quantizers alone.

    .peers/lcpp-venv/bin/python benchmarks/llama_cpp_quantize.py SRC.gguf DST.gguf Q4_K_M

The source may itself be quantized (the default model is Q4_1): requantizing is
allowed (``allow_requantize``), as ``llama-quantize --allow-requantize`` does.
Prints one JSON object (type, seconds, bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

# llama.cpp's file types (llama.h ``llama_ftype``) this script writes.
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q4_K_S": 14, "Q4_K_M": 15,
          "Q6_K": 18}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("ftype", choices=sorted(FTYPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[args.ftype]
    params.allow_requantize = True
    params.nthread = args.threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    print(json.dumps({"ftype": args.ftype, "seconds": time.perf_counter() - t0,
                      "llama_cpp_python": getattr(llama_cpp, "__version__", None),
                      "bytes": os.path.getsize(args.dst)}))


if __name__ == "__main__":
    main()
