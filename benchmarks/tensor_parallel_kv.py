"""KV transfer between tensor-parallel workers of different sizes: what a sharded
prefill or decode side costs a request before its first decode step.

Engines without Ray, in this process (rank 1 of a 2-rank engine is its subprocess),
default model, float32, joined by real Gloo pairs as ``tandem serve`` joins them
(one pair per prefill rank / decode rank whose KV heads overlap,
``kvtransfer/sharded.py``). For each direction (prefill ranks -> decode ranks:
1->1, 2->1, 1->2, 2->2) and prompt length, a request is reserved on the decode
engine (its ticket posted on the channel), prefilled on the prefill engine, which
sends each layer's heads from inside its forward pass, and stepped on the decode
engine until its KV landed on every rank and it decoded its second token. Every
direction and round has prompts of its own (no prefix-cache hits).
Reported, median over ``--rounds`` random prompts: ``prefill_ms`` (the prefill
engine's steps, transfer sends included), ``handoff_ms`` (from the end of the
prefill to the decode engine's second token: the rest of the transfer, the first
token's handoff and one decode step), the bytes sent and the greedy ids' agreement
with one unsharded engine.

    .venv/bin/python benchmarks/tensor_parallel_kv.py --prompt-lens 128 512 --rounds 5 \\
        --out benchmarks/results/tensor_parallel_kv_float32.json

Both engines step in this one thread, one after the other, on the machine's
cores (a 2-rank engine's ranks share them): a measure of the work and the wire,
not of two machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import isa_flags  # noqa: E402


def _wire(prefill, prefill_id: str, decode, decode_id: str) -> None:
    rdv = decode.kv_connector.open_channel(prefill_id, "127.0.0.1",
                                           peer_layout=prefill.kv_connector.layout())
    prefill.kv_connector.connect(decode_id, rdv, decode.kv_connector.layout())


def _one(prefill, decode, prefill_id, decode_id, rid, prompt, params):
    """One request across the pair: ``(prefill_ms, handoff_ms, bytes, token ids)``."""
    from tandem.engine.kv.kv_connector import KVTransferParams

    ticket = prefill.kv_connector.ticket_future(decode_id, rid, 0)
    req = decode.add_request(prompt, params, rid,
                             kv_transfer_params=KVTransferParams(prefill_id))[0]
    while not ticket.done():
        decode.step()
    sent = prefill.kv_connector.kv_transfer_bytes
    t0 = time.perf_counter()
    done = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), rid + "-p",
                               kv_transfer_params=KVTransferParams(decode_id,
                                                                   ticket.result(10)))[0]
    while not done.is_finished:
        prefill.step()
    t1 = time.perf_counter()
    while req.num_output_tokens < 2:
        decode.step()
        if not decode.last_step_ran:
            time.sleep(0.0005)
    t2 = time.perf_counter()
    while not req.is_finished:
        decode.step()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), prefill.kv_connector.kv_transfer_bytes - sent, \
        list(req.output_token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from tandem.engine.llm import LLM, LLMEngine
    from tandem.engine.sampling.sampling_params import SamplingParams

    base = LLM(dtype="float32", num_blocks=512)
    ones = [LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo")
            for _ in range(2)]
    two = LLMEngine(dataclasses.replace(base.config, tensor_parallel_size=2),
                    kv_transport="gloo")
    pairs = {"1->1": (ones[0], ones[1]), "2->1": (two, ones[0]), "1->2": (ones[0], two),
             "2->2": (two, two)}
    for name, (p, d) in pairs.items():
        _wire(p, f"{name}-prefill", d, f"{name}-decode")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    results = {"dtype": "float32", "rounds": args.rounds, "machine": platform.processor(),
               "isa_flags": isa_flags(), "runs": []}
    try:
        for n in args.prompt_lens:
            for name, (p, d) in pairs.items():
                # Prompts of their own: no prefix-cache hit from another direction's round.
                prompts = [[rng.randrange(100, 49000) for _ in range(n)]
                           for _ in range(args.rounds + 1)]
                want = [o.outputs[0].token_ids for o in
                        base.generate([{"prompt_token_ids": q} for q in prompts], params)]
                rows = [_one(p, d, f"{name}-prefill", f"{name}-decode", f"{name}-{n}-{i}", q,
                             params) for i, q in enumerate(prompts)]
                rows = rows[1:]                                   # the first warms up
                results["runs"].append({
                    "direction": name, "prompt_len": n,
                    "prefill_ms": statistics.median(r[0] for r in rows),
                    "handoff_ms": statistics.median(r[1] for r in rows),
                    "bytes": rows[0][2],
                    "greedy_equal": [r[3] for r in rows] == [list(w) for w in want[1:]]})
    finally:
        two.shutdown()
    print("| prompt tokens | prefill ranks -> decode ranks | prefill (ms) | handoff to 2nd "
          "token (ms) | KV bytes | ids = one engine |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['prompt_len']} | {r['direction']} | {r['prefill_ms']:.1f} | "
              f"{r['handoff_ms']:.1f} | {r['bytes']:,} | {r['greedy_equal']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
