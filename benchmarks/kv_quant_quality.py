"""Quantized KV cache quality: ``kv_cache_dtype fp8_e4m3`` or ``int4`` against ``auto``
on the same weights.

Offline engines (``LLM``), default model, one run per model dtype (``--dtypes``):

* perplexity of :data:`HELD_OUT` (~1,000 tokens of text written for this benchmark,
  not the calibration prompt) from ``prompt_logprobs``, with quantized and with auto KV;
  the prompt runs in chunks of ``--chunk`` tokens (chunked prefill), so later
  chunks read earlier chunks' K/V back from the cache;
* prompt logprobs: mean and max ``|logprob_kv - logprob_auto|`` over those tokens;
* greedy agreement: :data:`PROMPTS`, ``--max-tokens`` tokens each (EOS ignored): tokens
  equal before the first divergence, and positions equal overall;
* KV blocks in the same ``kv_cache_memory_bytes`` (64 MiB).

Usage::

    python benchmarks/kv_quant_quality.py --kv-cache-dtype int4 --out /tmp/kv_int4.json

Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams

HELD_OUT = """\
The lighthouse keeper's log for the winter of the storm survives in a single water-stained
notebook. Its first pages are routine: the oil delivered on the third of November, a cracked
pane replaced in the lantern room, the supply boat two days late because of fog. By December
the entries grow longer. The keeper, a former ship's carpenter named Elias Brand, begins to
describe the sea in detail, as if he expected someone to read his words and needed them to
understand what he had seen.

On the night of the nineteenth, he writes, the wind turned to the north-east and did not turn
back for eleven days. Waves broke over the lower gallery, sixty feet above the rocks, and salt
crusted the glass so thickly that he climbed out twice an hour to scrape it clear with a
wooden paddle. The lamp, he notes with some pride, never went dark. He kept it burning with
the last of the reserve oil, then with seal fat traded from the village the previous summer,
and finally with the paraffin he had been saving for his own stove.

Modern readers often ask why a man would go to such lengths for a light that, in weather like
that, no captain could safely have followed. The answer lies partly in the rules of the
service, which punished any keeper whose lamp failed, and partly in something harder to name.
Brand's notebook suggests he believed that the light mattered even when it could not be seen,
that its steadiness was a kind of promise. "A ship that cannot find us tonight," he wrote on
Christmas Eve, "will look for us tomorrow, and we shall be here."

Historians of the coast have pieced together what happened to the vessels caught at sea that
week. A coal barge from the southern ports ran aground on the sandbar at the river mouth; its
crew of six walked ashore at low tide, frightened but unharmed. A fishing fleet of nine boats
sheltered in the lee of the northern cape and lost only its nets. One ship, a timber carrier
called the Margaret Ellen, was never found. Her owners later claimed she had been sighted off
the lighthouse on the twenty-second, but no entry in Brand's notebook mentions her, and he
recorded every light he saw, even those he judged to be stars.

The economics of the lighthouse service in those years help explain the tension in the log.
Each station received a fixed budget for oil, wicks, glass and food, calculated from the
previous decade's average consumption. A hard winter consumed that budget by midwinter, and
keepers were expected to make up the difference from their own wages, then petition for
repayment in the spring. Brand's petition, which survives in the regional archive, asks for
four pounds and seven shillings. It was approved in part: the board paid for the oil but not
for the paraffin, on the grounds that paraffin was not an approved fuel.

Engineers who study old lighthouses today are less interested in the keepers than in the
towers themselves. The tower Brand tended was built of granite blocks cut to interlock like
the pieces of a puzzle, each course dovetailed into the one below, so that the whole structure
behaved as a single stone. Measurements taken with modern instruments show that it sways by
less than a centimetre in a gale. The design was expensive and slow to build, but of the
fourteen towers constructed that way along the coast, thirteen still stand.

Brand left the service three years after the storm and opened a small workshop in the village,
where he repaired boats and, according to a neighbour's memoir, built a clock whose pendulum
was a miniature lighthouse lamp. He never married. When he died, the notebook was found in a
drawer of his workbench, wrapped in oilcloth, together with a list of the ships he had seen
from the lantern room over eleven years: four hundred and twelve of them, each with a date, a
heading, and a note on the weather.

What the notebook offers, in the end, is not a story of heroism but a record of attention.
For eleven days a man watched the sea, wrote down what he saw, and kept a flame alight. The
entries do not claim that this was brave or important. They only insist, page after page,
that the light was lit at dusk and trimmed at midnight and put out at dawn, and that the sea,
whatever it did, was observed.
"""

PROMPTS = [
    "The three most important inventions of the nineteenth century were",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "Write a short poem about a city at night.",
    "Q: How many legs does a spider have?\nA:",
    "In economics, inflation is defined as",
    "Translate to French: The weather is beautiful today.",
]


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def _agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return first, sum(x == y for x, y in zip(a, b))


def run(dtype: str, max_tokens: int, chunk: int, backend: str, kv_cache_dtype: str) -> dict:
    mem = 64 << 20
    kw = dict(dtype=dtype, kv_cache_memory_bytes=mem, max_num_batched_tokens=chunk,
              attention_backend=backend)
    auto = LLM(**kw)
    t0 = time.perf_counter()
    quant = LLM(kv_cache_dtype=kv_cache_dtype, weights_from=auto, **kw)
    calib_s = time.perf_counter() - t0
    ids = auto.tokenizer.encode(HELD_OUT)
    lp_auto, lp_kv = _prompt_logprobs(auto, ids), _prompt_logprobs(quant, ids)
    diffs = [abs(a - b) for a, b in zip(lp_auto, lp_kv)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs_auto = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, params)]
    outs_kv = [o.outputs[0].token_ids for o in quant.generate(PROMPTS, params)]
    agree = [_agreement(a, b) for a, b in zip(outs_auto, outs_kv)]
    total = len(PROMPTS) * max_tokens
    return {
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "backend": backend,
        "held_out_tokens": len(ids),
        "ppl_auto": math.exp(-sum(lp_auto) / len(lp_auto)),
        "ppl_kv": math.exp(-sum(lp_kv) / len(lp_kv)),
        "logprob_mean_abs_diff": sum(diffs) / len(diffs), "logprob_max_abs_diff": max(diffs),
        "greedy_before_first_divergence": sum(f for f, _ in agree) / total,
        "greedy_positions_equal": sum(e for _, e in agree) / total,
        "first_divergence": [f for f, _ in agree],
        "blocks_auto": auto.engine.kv_cache.num_blocks,
        "blocks_kv": quant.engine.kv_cache.num_blocks,
        "engine_start_with_calibration_s": calib_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "int4"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(d, args.max_tokens, args.chunk, args.backend, args.kv_cache_dtype)
            for d in args.dtypes.split(",")]
    kv = args.kv_cache_dtype
    print(f"| model dtype | held-out tokens | ppl auto | ppl {kv} | mean/max abs dlogprob "
          f"| greedy before 1st divergence | positions equal | blocks auto -> {kv} (64 MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['held_out_tokens']} | {r['ppl_auto']:.3f} | {r['ppl_kv']:.3f} "
              f"| {r['logprob_mean_abs_diff']:.4f} / {r['logprob_max_abs_diff']:.3f} "
              f"| {100 * r['greedy_before_first_divergence']:.1f}% "
              f"| {100 * r['greedy_positions_equal']:.1f}% "
              f"| {r['blocks_auto']} -> {r['blocks_kv']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
