"""lm-eval-harness against a running Tandem server, beside the offline engine's own score.

Starts ``tandem serve`` (OpenAI HTTP API on), runs lm-eval-harness's
``local-completions`` model on the ``tandem_capitals`` task (benchmarks/lm_eval/: the
data ships with the repository, no download), then scores the same task with the
offline engine (:class:`tandem.engine.llm.LLM`, ``prompt_logprobs``), tokenizing each
context and choice as lm-eval does. The two accuracies (and the per-choice
log-likelihoods) must agree within noise: float32 on both sides makes them equal up
to batch-order rounding.

lm-eval-harness brings many dependencies; install it in a venv of its own::

    python3 -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install "lm-eval[api]" transformers
    .venv/bin/python benchmarks/lm_eval_tandem.py --lm-eval /work/lmeval-venv/bin/lm_eval \\
        --out benchmarks/results/lm_eval_capitals.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval"
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def docs() -> list[dict]:
    with open(TASK_DIR / "capitals.jsonl") as f:
        return [json.loads(line) for line in f]


def context(doc: dict) -> str:
    return f"Question: What is the capital of {doc['country']}?\nAnswer:"


def offline_scores(dtype: str) -> tuple[float, list[list[float]]]:
    """The task scored by the offline engine: per doc, each choice's summed
    log-likelihood after the context, tokenized as lm-eval does."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(dtype=dtype)
    tok = llm.engine.tokenizer
    prompts, spans = [], []
    for doc in docs():
        for choice in doc["choices"]:
            # lm-eval's pair encoding: the whole string at once, the continuation being
            # what follows the context's own tokens.
            ctx = tok.encode(context(doc), add_special_tokens=False)
            # lm-eval joins context and choice with the task's target_delimiter (" ").
            whole = tok.encode(context(doc) + " " + choice, add_special_tokens=False)
            prompts.append(whole)
            spans.append((len(ctx), len(whole) - len(ctx)))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=0))
    lls = [sum(lp.logprob for lp in o.prompt_logprobs[start:start + n])
           for o, (start, n) in zip(outs, spans)]
    per_doc, correct = [], 0
    k = 0
    for doc in docs():
        scores = lls[k:k + len(doc["choices"])]
        k += len(doc["choices"])
        per_doc.append(scores)
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return correct / len(per_doc), per_doc


def run_lm_eval(lm_eval: str, base_url: str, tokenizer_dir: str, out_dir: str) -> dict:
    cmd = [lm_eval, "--model", "local-completions", "--model_args",
           f"model={MODEL},base_url={base_url}/v1/completions,tokenizer={tokenizer_dir},"
           "num_concurrent=2,max_retries=1,tokenized_requests=True",
           "--tasks", "tandem_capitals", "--include_path", str(TASK_DIR),
           "--output_path", out_dir, "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=TASK_DIR, env=env)
    seconds = time.monotonic() - t0
    [path] = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)["results"]["tandem_capitals"]
    samples = glob.glob(os.path.join(out_dir, "**", "samples_tandem_capitals_*.jsonl"),
                        recursive=True)
    per_doc = {}
    with open(samples[0]) as f:
        for line in f:
            s = json.loads(line)
            per_doc[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]
    return {"acc": results["acc,none"], "acc_stderr": results.get("acc_stderr,none"),
            "seconds": seconds, "per_doc": [per_doc[i] for i in sorted(per_doc)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args()

    from tandem.engine.model.model_files import resolve_model
    from tandem.engine.text.tokenizer import Tokenizer

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.router.cli", "serve", "--mode",
                             args.mode, "--dtype", args.dtype, "--port", "0", "--http-port",
                             str(port)], start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url + "/health", proc)
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = os.path.join(tmp, "tokenizer")
            Tokenizer(resolve_model(None)).hf_tokenizer.save_pretrained(tok_dir)
            served = run_lm_eval(args.lm_eval, base_url, tok_dir, os.path.join(tmp, "out"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    acc, offline = offline_scores(args.dtype)
    diffs = [abs(a - b) for da, db in zip(served["per_doc"], offline) for a, b in zip(da, db)]
    worst = sorted(((abs(a - b), i, j, a, b) for i, (da, db) in enumerate(zip(served["per_doc"], offline))
                    for j, (a, b) in enumerate(zip(da, db))), reverse=True)[:5]
    result = {"task": "tandem_capitals", "docs": len(offline), "mode": args.mode,
              "dtype": args.dtype, "served_acc": served["acc"],
              "served_acc_stderr": served["acc_stderr"], "offline_acc": acc,
              "max_abs_loglikelihood_diff": max(diffs), "lm_eval_seconds": served["seconds"],
              "largest_differences": [{"doc": i, "choice": j, "served": a, "offline": b}
                                      for _, i, j, a, b in worst]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
