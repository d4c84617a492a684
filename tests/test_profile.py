"""``tandem profile`` (:mod:`tandem.router.capacity_profile`): one worker's prefill and
decode capacity within TTFT / ITL targets, measured on the real model, and the
``tandem serve`` flags it prints."""

from __future__ import annotations

import json

import pytest

from tandem.router.capacity_profile import CapacityProfile, ProfilePoint, p90, profile_capacity
from tandem.engine.runtime.llm_engine import LLMEngine


def test_p90_is_nearest_rank():
    assert p90([]) == 0.0
    assert p90([3.0]) == 3.0
    assert p90(list(range(1, 11))) == 9
    assert p90(list(range(1, 21))) == 18


def test_capacity_is_the_best_point_within_the_slo():
    prof = CapacityProfile(16, 4, 1.0, 0.1, prefill=[
        ProfilePoint(1, 0.2, 100.0, True), ProfilePoint(2, 0.5, 180.0, True),
        ProfilePoint(4, 1.5, 250.0, False)], decode=[ProfilePoint(1, 0.3, 20.0, False)])
    assert prof.prefill_capacity_tok_s == 180.0 and prof.decode_capacity_tok_s is None
    assert prof.serve_flags() == ["--planner-mode", "slo", "--ttft-slo", "1", "--itl-slo",
                                  "0.1", "--prefill-capacity", "180.0"]


def test_a_sharded_workers_profile_is_its_groups_and_names_the_size():
    """A profile of a 2-rank worker holds the whole group's tokens/s: its flags carry
    the size, so that serve runs workers of the size the capacity was measured for."""
    from tandem.router.cli import build_parser

    prof = CapacityProfile(16, 4, 1.0, 0.1, decode=[ProfilePoint(1, 0.05, 30.0, True)],
                           tensor_parallel_size=2)
    assert prof.serve_flags() == ["--planner-mode", "slo", "--ttft-slo", "1", "--itl-slo",
                                  "0.1", "--tensor-parallel-size", "2", "--decode-capacity",
                                  "30.0"]
    assert prof.to_dict()["tensor_parallel_size"] == 2
    args = build_parser().parse_args(["serve", "--autoscale", *prof.serve_flags()])
    assert args.tensor_parallel_size == 2 and args.decode_capacity == 30.0


@pytest.fixture(scope="module")
def engine(f32_weights):
    return LLMEngine(f32_weights.config, weights_from=f32_weights.engine)


def test_a_loose_slo_sweeps_to_the_limit_and_a_tight_one_stops_at_once(engine):
    loose = profile_capacity(engine, isl=16, osl=4, ttft_slo_s=60.0, itl_slo_s=60.0,
                             max_concurrency=4)
    assert [p.concurrency for p in loose.prefill] == [1, 2, 4]
    assert [p.concurrency for p in loose.decode] == [1, 2, 4]
    assert all(p.meets_slo and p.p90_s > 0 and p.tok_s > 0 for p in loose.prefill + loose.decode)
    assert loose.prefill_capacity_tok_s == max(p.tok_s for p in loose.prefill)
    assert loose.decode_capacity_tok_s == max(p.tok_s for p in loose.decode)
    assert loose.tensor_parallel_size == engine.config.tensor_parallel_size == 1
    tight = profile_capacity(engine, isl=16, osl=4, ttft_slo_s=1e-6, itl_slo_s=1e-6,
                             max_concurrency=4)
    assert [p.concurrency for p in tight.prefill + tight.decode] == [1, 1]
    assert tight.prefill_capacity_tok_s is None and tight.decode_capacity_tok_s is None
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="isl"):
        profile_capacity(engine, isl=0, osl=4, ttft_slo_s=1.0, itl_slo_s=1.0)


def test_cli_writes_the_profile_and_flags_serve_accepts(tmp_path, capsys):
    from tandem.router.cli import build_parser, main

    out = tmp_path / "profile.json"
    assert main(["profile", "--dtype", "float32", "--num-blocks", "32", "--isl", "16",
                 "--osl", "4", "--ttft-slo", "60", "--itl-slo", "60", "--max-concurrency", "2",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [p["concurrency"] for p in doc["prefill"]] == [1, 2]
    assert doc["prefill_capacity_tok_s"] == max(p["tok_s"] for p in doc["prefill"])
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("serve with: tandem serve"))
    flags = line.split("tandem serve ", 1)[1].split()
    assert flags == ["--autoscale", *doc["serve_flags"]]
    args = build_parser().parse_args(["serve", *flags])
    assert args.planner_mode == "slo" and args.prefill_capacity == pytest.approx(
        doc["prefill_capacity_tok_s"], abs=0.05)


def test_a_two_rank_engine_is_profiled_as_one_worker():
    """``tandem profile --tensor-parallel-size 2`` drives the whole group (rank 0's
    engine, rank 1 following), so its capacities are one 2-device worker's."""
    from tandem.engine.llm import LLM

    llm = LLM(dtype="float32", tensor_parallel_size=2, num_blocks=32)
    try:
        prof = profile_capacity(llm.engine, isl=16, osl=4, ttft_slo_s=60.0, itl_slo_s=60.0,
                                max_concurrency=2)
        assert prof.tensor_parallel_size == 2
        assert [p.concurrency for p in prof.decode] == [1, 2]
        assert prof.serve_flags()[6:8] == ["--tensor-parallel-size", "2"]
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.shutdown()
