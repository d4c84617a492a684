"""Tensor-parallel workers behind ``tandem serve``: one colocated worker of 2 ranks
(rank 0 in the Ray actor's process, rank 1 its subprocess), float32, embedded
redis-server, supervision on.

The served greedy tokens equal one unsharded engine's; a rank that dies (kill -9
rank 1's process, or rank 0's: the actor) takes the whole worker down, its
requests wait for the supervisor's new group and resume there with the tokens
they would have had, and no rank process is left behind. Recovery times are
printed (``-s``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import grpc
import pytest

from tests.serving.conftest import serve_config, serving
from tests.serving.test_fault_tolerance import Stream, _assert_idle, _back_to_size, _handle, _wait

N = 32
PROMPTS = ["Write a short story about a dragon.", "Explain how a bicycle works.",
           "List five facts about the Moon.", "Why is the sky blue?"]
WORKER = "colocated-0"
RANK_MODULE = "tandem.engine.parallel.worker"


def _request(ids: list[int]):
    from tandem.v1 import tandem_pb2 as pb

    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stream=True,
                              sampling=pb.SamplingParams(max_tokens=N, temperature=0.0,
                                                         ignore_eos=True))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


_REFERENCES: dict[tuple, list[list[int]]] = {}
"""The reference tokens of each prompt set already computed in this process: every
module that imports the ``reference`` fixture (test_tensor_parallel_disagg_served.py
too) gets its own instance of it, and the offline engine's run is the same for all."""


@pytest.fixture(scope="module")
def reference(prompt_ids, f32_weights) -> list[list[int]]:
    """Each prompt's greedy tokens from one unsharded engine (offline, this process;
    run once per process for these prompts, see :data:`_REFERENCES`)."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    key = tuple(map(tuple, prompt_ids))
    if key not in _REFERENCES:
        llm = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
        _REFERENCES[key] = [list(o.outputs[0].token_ids) for o in outs]
    return [list(tokens) for tokens in _REFERENCES[key]]


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = serve_config("colocated", num_blocks=256)
    yield from serving(dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, tensor_parallel_size=2)))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):     # gone before or while being read
        return False


def _rank_processes(parent_pid: int) -> list[int]:
    """Live rank processes (``python -m tandem.engine.parallel.worker``) whose parent is
    ``parent_pid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if RANK_MODULE.encode() in cmd and ppid == parent_pid and _alive(int(name)):
            found.append(int(name))
    return found


def _check_group(worker) -> None:
    """The worker is a group of 2: its actor and one live rank process, its child."""
    assert worker.info["tensor_parallel_size"] == 2
    assert len(worker.info["rank_pids"]) == 1
    assert _rank_processes(worker.info["pid"]) == worker.info["rank_pids"]


def _streams(cluster, prompt_ids) -> list[Stream]:
    """8 streams: every prompt twice (the second hits the prefix cache)."""
    return [Stream(cluster.server.address, "", N, request=_request(ids))
            for ids in prompt_ids + prompt_ids]


def _join_unchanged(streams: list[Stream], reference: list[list[int]]) -> None:
    for s in streams:
        s.join(300)
    for i, s in enumerate(streams):
        assert s.code == grpc.StatusCode.OK, (i, s.code, getattr(s, "details", ""))
        assert s.tokens == reference[i % len(reference)], i


def test_served_greedy_tokens_equal_one_rank(cluster, prompt_ids, reference):
    _check_group(_handle(cluster, WORKER))
    streams = _streams(cluster, prompt_ids)
    _join_unchanged(streams, reference)
    _assert_idle(cluster)


def _kill_under_load(cluster, prompt_ids, reference, victim_pid: int, what: str) -> None:
    """kill -9 ``victim_pid`` (a process of the worker's group) while 8 streams are in
    flight; every stream must end with the unsharded tokens, the old group's
    processes must all end, and a new group must serve."""
    old = _handle(cluster, WORKER)
    old_pids = [old.info["pid"], *old.info["rank_pids"]]
    streams = _streams(cluster, prompt_ids)
    _wait(lambda: all(len(s.tokens) >= 4 for s in streams), 180, "every stream to start")
    t_kill = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    _wait(lambda: not any(_alive(p) for p in old_pids), 30, "the old group's processes to end")
    ended = time.monotonic() - t_kill
    _join_unchanged(streams, reference)
    stall = max(s.max_gap_after(t_kill) for s in streams)
    recovery = _back_to_size(cluster, WORKER, old.generation)
    print(f"\n{what} killed: the group's processes ended {ended:.1f} s after, a new group "
          f"in service after {recovery:.1f} s, longest client-visible stall {stall:.1f} s")
    new = _handle(cluster, WORKER)
    _check_group(new)
    assert not set(old_pids) & {new.info["pid"], *new.info["rank_pids"]}
    assert cluster.server.server.supervisor.recoveries[-1].worker_id == WORKER
    _assert_idle(cluster)
    # The new group serves what the old one did.
    _join_unchanged(_streams(cluster, prompt_ids)[:4], reference)


def test_kill_rank_1_takes_the_worker_down_and_requests_resume(cluster, prompt_ids, reference):
    _kill_under_load(cluster, prompt_ids, reference,
                     _handle(cluster, WORKER).info["rank_pids"][0], "rank 1")


def test_kill_rank_0_the_actor_ends_its_rank_processes(cluster, prompt_ids, reference):
    _kill_under_load(cluster, prompt_ids, reference, _handle(cluster, WORKER).info["pid"],
                     "rank 0 (the actor)")


def test_a_rank_dying_while_idle_is_replaced(cluster, prompt_ids, reference):
    """No request runs, so no collective fails: the idle engine loop looks at its
    ranks and ends the worker all the same; a new group serves."""
    old = _handle(cluster, WORKER)
    t_kill = time.monotonic()
    os.kill(old.info["rank_pids"][0], signal.SIGKILL)
    _wait(lambda: not _alive(old.info["pid"]), 10, "the idle worker to end")
    ended = time.monotonic() - t_kill
    recovery = _back_to_size(cluster, WORKER, old.generation)
    print(f"\nrank 1 of an idle worker killed: the worker ended {ended:.1f} s after, a new "
          f"group in service after {recovery:.1f} s")
    _check_group(_handle(cluster, WORKER))
    _join_unchanged(_streams(cluster, prompt_ids)[:4], reference)


@pytest.mark.parametrize("flags, message", [
    (["--mode", "colocated", "--prefill-tensor-parallel-size", "2"],
     "--prefill-tensor-parallel-size: colocated mode has no prefill workers"),
    (["--mode", "colocated", "--tensor-parallel-size", "0"],
     "--tensor-parallel-size: must be at least 1, got 0"),
    (["--decode-tensor-parallel-size", "0"], "--decode-tensor-parallel-size: must be at least 1"),
])
def test_cli_refuses_bad_tensor_parallel_sizes(flags, message, capsys):
    """Refused before Ray or any worker starts: exit status 2, one line naming the flag."""
    from tandem.router.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message), err


@pytest.mark.parametrize("flags, sizes", [
    ([], (1, 1)),
    (["--tensor-parallel-size", "2"], (2, 2)),
    (["--prefill-tensor-parallel-size", "2"], (2, 1)),
    (["--decode-tensor-parallel-size", "2"], (1, 2)),
    (["--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"], (2, 1)),
])
def test_each_pool_gets_its_own_tensor_parallel_size(flags, sizes):
    """``(prefill, decode)`` ranks per worker in disaggregated mode."""
    from tandem.router.cli import _serve_config, build_parser

    config = _serve_config(build_parser().parse_args(["serve", *flags]))
    assert ((config.prefill_engine or config.engine).tensor_parallel_size,
            config.engine.tensor_parallel_size) == sizes


def test_a_worker_s_threads_are_shared_by_its_ranks():
    from tandem.router.launcher import _rank_threads

    assert [_rank_threads(t, n) for t, n in [(4, 1), (4, 2), (2, 2), (1, 2), (6, 4), (None, 2),
                                            (None, 1)]] == [4, 2, 1, 1, 1, None, None]


def test_serve_config_takes_quantized_kv_caches_between_sharded_workers():
    """fp8 and int4 caches travel between sharded disaggregated workers
    (tests/test_tensor_parallel_disagg.py), so neither pool refuses them."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.router.launcher import ServeConfig

    for dtype in ("fp8_e4m3", "int4"):
        cache = CacheConfig(kv_cache_dtype=dtype)
        config = ServeConfig(engine=EngineConfig(tensor_parallel_size=2, cache=cache),
                             prefill_engine=EngineConfig(tensor_parallel_size=2, cache=cache))
        assert (config.engine.cache.kv_cache_dtype,
                config.prefill_engine.cache.kv_cache_dtype) == (dtype, dtype)
