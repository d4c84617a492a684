"""The engine's step timeline (``TANDEM_STEP_TRACE``): one line per executed step with
its tokens and requests, on a tiny random checkpoint; and its summary
(benchmarks/step_timeline.py, openai_bench.py's ``--step-trace``) on known steps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.models.conftest import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


st = _bench("step_timeline")


def test_engine_writes_one_line_per_executed_step(tmp_path, monkeypatch):
    import os

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    save_tiny_checkpoint(tmp_path / "tiny", "LlamaConfig")
    prefix = tmp_path / "steps"
    monkeypatch.setenv("TANDEM_STEP_TRACE", str(prefix))
    # An 8-token budget: the 10-token prompt is prefilled in two chunks.
    llm = LLM(str(tmp_path / "tiny"), dtype="float32", num_blocks=32,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(3, 13)), list(range(20, 26))]
    for p in prompts:
        eng.add_request(p, params)
    ran = 0
    while eng.has_unfinished_requests():
        eng.step()
        ran += eng.last_step_ran
    path = Path(f"{prefix}.{os.getpid()}")
    assert eng.step_trace.path == str(path)
    steps = st.read_trace(path)
    assert len(steps) == ran
    # Every prompt token once, then 3 decode tokens per request (the 4th token of
    # each comes from its prefill).
    assert sum(s[2] for s in steps) == 16 + 2 * 3
    assert all(s[0] <= s[1] for s in steps)
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))
    # The first step has only prompt tokens (the budget's 8); the last, decodes only.
    assert steps[0][2:] == (8, 1) and steps[-1][2] == steps[-1][3]
    eng.shutdown()
    assert eng.step_trace is None
    monkeypatch.delenv("TANDEM_STEP_TRACE")
    assert LLM(str(tmp_path / "tiny"), dtype="float32", num_blocks=32).engine.step_trace is None


STEPS = [(10.0, 10.5, 2048, 8),    # a prompt step
         (10.5, 10.6, 64, 64),     # decodes
         (10.7, 10.8, 64, 64),     # 0.1 s idle before it
         (10.8, 11.0, 1064, 40),   # prompt chunks beside decodes
         (12.0, 12.1, 4, 4)]       # after the window below


def test_summary_of_known_steps():
    s = st.summarize(STEPS, 10.0, 11.0)
    assert s["steps"] == 4 and s["tokens"] == 2048 + 64 + 64 + 1064
    assert s["window_s"] == pytest.approx(1.0)
    assert s["busy_s"] == pytest.approx(0.9) and s["busy_fraction"] == pytest.approx(0.9)
    assert s["decode"] == {"steps": 2, "seconds": pytest.approx(0.2), "median_ms": pytest.approx(100.0),
                           "p90_ms": pytest.approx(100.0)}
    assert s["prompt"]["steps"] == 2 and s["prompt"]["tokens"] == 3112
    assert s["prompt"]["seconds"] == pytest.approx(0.7)
    assert s["prompt"]["ms_per_1k_tokens"] == pytest.approx(224.9, abs=0.05)
    assert s["idle"] == {"seconds": pytest.approx(0.1), "largest_s": pytest.approx(0.1)}
    whole = st.summarize(STEPS)
    assert whole["steps"] == 5 and whole["window_s"] == pytest.approx(2.1)
    assert st.summarize(STEPS, 20.0, 30.0) == {"steps": 0}


def test_run_window_ends_at_the_last_step_before_the_client(tmp_path):
    assert st.run_window(STEPS, 11.5, 0.8) == pytest.approx((10.2, 11.0))
    with pytest.raises(ValueError, match="no step"):
        st.run_window(STEPS, 10.4, 1.0)
    # openai_bench's per-worker summaries over the client's run, a torn last line skipped.
    ob = _bench("openai_bench")
    prefix = tmp_path / "steps-x"
    Path(f"{prefix}.11").write_text("".join(f"{a} {b} {n} {r}\n" for a, b, n, r in STEPS) + "12.2 12")
    Path(f"{prefix}.12").write_text("13.0 13.5 8 1\n")
    got = ob.step_timelines(prefix, 11.5, 1.0)
    assert got["steps-x.11"]["busy_fraction"] == pytest.approx(0.9)
    assert "error" in got["steps-x.12"]
