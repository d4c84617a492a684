"""Summarise an engine's step timeline (``TANDEM_STEP_TRACE``, see
``engine/runtime/step_trace.py``): how busy the engine was over a window, its
decode-only and prompt-carrying steps, and the idle gaps between steps.

    TANDEM_STEP_TRACE=/tmp/steps .venv/bin/python -m tandem.router.cli serve ...
    .venv/bin/python benchmarks/step_timeline.py /tmp/steps.<pid> --last 20

``openai_bench.py --step-trace`` does this for every Tandem server it starts, over
the window of the client's measured run (its ``duration``, ending at the last step
the engine ran before the client exited), and keeps the result in its JSON.

Fields: ``busy_fraction`` is the summed step time over the window's length (1.0:
the engine never waited for work, so a faster serving path around it could not
have served more); ``decode`` the steps whose tokens equal their requests (one
token each), ``prompt`` the steps that carried prompt tokens (chunked prefill,
with or without decodes beside them), each with its count, summed seconds and
median / p90 milliseconds; ``prompt.ms_per_1k_tokens`` is the prompt steps'
seconds per thousand scheduled tokens; ``idle`` the gaps between consecutive steps
inside the window (sum and largest, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

Step = tuple[float, float, int, int]
"""``(start, end, num_tokens, num_requests)``, wall-clock seconds."""


def read_trace(path: str | Path) -> list[Step]:
    """The steps of one trace file, in file order (a partial last line is skipped)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            steps.append((float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
    return steps


def run_window(steps: list[Step], client_end: float, duration: float) -> tuple[float, float]:
    """The window of a client's measured run of ``duration`` seconds that ended by
    ``client_end`` (wall clock): it ends at the last step that ended by then.

    Raises:
        ValueError: no step ended by ``client_end``.
    """
    ends = [s[1] for s in steps if s[1] <= client_end]
    if not ends:
        raise ValueError("no step ended before the client did")
    end = max(ends)
    return end - duration, end


def _times(steps: list[Step]) -> dict:
    ms = sorted((e - s) * 1e3 for s, e, _, _ in steps)
    if not ms:
        return {"steps": 0, "seconds": 0.0}
    return {"steps": len(ms), "seconds": round(sum(ms) / 1e3, 3),
            "median_ms": round(statistics.median(ms), 2),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2)}


def summarize(steps: list[Step], start: float | None = None, end: float | None = None) -> dict:
    """The summary (module docstring) of the steps that started in ``[start, end]``
    (None: from the first / to the last step). A step running past ``end`` counts
    whole; the window's length is ``end - start``."""
    chosen = [s for s in steps if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
    if not chosen:
        return {"steps": 0}
    lo = chosen[0][0] if start is None else start
    hi = max(s[1] for s in chosen) if end is None else end
    busy = sum(e - s for s, e, _, _ in chosen)
    gaps = [b[0] - a[1] for a, b in zip(chosen, chosen[1:]) if b[0] > a[1]]
    decode = [s for s in chosen if s[2] == s[3]]
    prompt = [s for s in chosen if s[2] != s[3]]
    prompt_tokens = sum(s[2] for s in prompt)
    out = {"window_s": round(hi - lo, 3), "steps": len(chosen), "busy_s": round(busy, 3),
           "busy_fraction": round(busy / (hi - lo), 3) if hi > lo else None,
           "tokens": sum(s[2] for s in chosen),
           "decode": _times(decode), "prompt": _times(prompt),
           "idle": {"seconds": round(sum(gaps), 3), "largest_s": round(max(gaps, default=0.0), 3)}}
    if prompt_tokens:
        out["prompt"]["tokens"] = prompt_tokens
        out["prompt"]["ms_per_1k_tokens"] = round(out["prompt"]["seconds"] * 1e6 / prompt_tokens, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace file, PREFIX.<pid>")
    p.add_argument("--last", type=float, default=None,
                   help="only the last SECONDS before the last step's end")
    args = p.parse_args(argv)
    steps = read_trace(args.trace)
    start = end = None
    if args.last is not None and steps:
        end = max(s[1] for s in steps)
        start = end - args.last
    print(json.dumps(summarize(steps, start, end), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
