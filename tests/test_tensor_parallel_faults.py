"""A tensor-parallel engine whose rank 1 dies: rank 0 sees it within moments (not
after the group's collective timeout) as a ``RankDiedError`` naming the rank and
its exit status, from a step in flight (the shared-memory all-reduce's wait) or
from the next step of an idle engine (a Gloo collective to the dead rank); the
engine loop hands it to ``on_rank_lost``. The default model in float32, 2 ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.parallel.communicator import RankDiedError
from tandem.engine.sampling.sampling_params import SamplingParams

DETECT_S = 5.0      # well below the group's collective timeout (600 s)


def _engine():
    from tandem.engine.runtime.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", tensor_parallel_size=2, num_threads=1,
                                  cache=CacheConfig(num_blocks=64)))


def _add(engine, n: int, max_tokens: int) -> None:
    for i in range(n):
        engine.add_request(engine.tokenizer.encode(f"Count to ten, number {i}:"),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True), f"r{i}")


def _running_loop(engine, num_requests: int):
    """An engine loop whose ``on_rank_lost`` records what it is given, running
    ``num_requests`` long requests that have decoded a few tokens each.

    Returns:
        ``(loop, lost, called)``: the loop, the list of errors given to
        ``on_rank_lost``, and the event it sets.
    """
    from tandem.engine.runtime.engine_loop import EngineLoop

    lost: list[RankDiedError] = []
    called = threading.Event()

    def on_rank_lost(exc):
        lost.append(exc)
        called.set()

    loop = EngineLoop(engine, "tp-0", "colocated", on_rank_lost=on_rank_lost).start()
    try:
        loop.call(_add, engine, num_requests, 400).result(30)
        deadline = time.monotonic() + 60
        while not any(r.num_output_tokens >= 4 for r in engine.scheduler.running):
            assert time.monotonic() < deadline, "no step ran"
            time.sleep(0.01)
    except BaseException:
        loop.shutdown()
        engine.shutdown()
        raise
    return loop, lost, called


def test_a_rank_killed_mid_run_reaches_on_rank_lost():
    engine = _engine()
    loop, lost, called = _running_loop(engine, 4)
    try:
        t_kill = time.monotonic()
        os.kill(engine.parallel.worker_pids[0], signal.SIGKILL)
        assert called.wait(DETECT_S), "rank 0 did not see rank 1 die"
        print(f"\nrank 1 killed mid-run: seen after {time.monotonic() - t_kill:.2f} s")
        assert [(e.rank, e.exit_code) for e in lost] == [(1, -signal.SIGKILL)]
        assert str(lost[0]) == "tensor-parallel rank 1 exited with code -9"
        # The callback returned: the requests end with ``error`` as after any failure.
        with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
            loop.poll(0.1)
    finally:
        loop.shutdown()
        engine.shutdown()
    assert engine.parallel.worker_exit_codes == [-signal.SIGKILL]


def test_a_rank_killed_while_idle_fails_the_next_step():
    import torch

    engine = _engine()
    try:
        _add(engine, 2, 8)
        engine.step()
        os.kill(engine.parallel.worker_pids[0], signal.SIGKILL)
        time.sleep(0.2)
        t0 = time.monotonic()
        # Gloo's own error (the peer's connection closed) is converted.
        with pytest.raises(RankDiedError, match="rank 1 exited with code -9") as info:
            engine.parallel.comm.gather(torch.zeros(4))
        assert info.value.__cause__ is not None
        assert time.monotonic() - t0 < DETECT_S
        with pytest.raises(RankDiedError, match="rank 1 exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < DETECT_S
        # The group is out of step for good: every later step refuses.
        with pytest.raises(RuntimeError, match="out of step"):
            engine.step()
    finally:
        engine.shutdown()
    assert engine.parallel.worker_exit_codes == [-signal.SIGKILL]


def test_a_rank_that_stops_answering_is_killed_and_reaches_on_rank_lost():
    """SIGSTOP rank 1 mid-run: its process lives, so no exit is seen, but its heartbeat
    stands still; after the hang timeout rank 0 kills it and the step raises
    ``RankHungError`` (a ``RankDiedError``), long before the collective timeout."""
    from tandem.engine.parallel.communicator import RankHungError
    from tandem.engine.parallel.group import HEARTBEAT_S

    engine = _engine()
    engine.parallel.watch.hang_timeout_s = 1.5
    loop, lost, called = _running_loop(engine, 2)
    try:
        t_stop = time.monotonic()
        os.kill(engine.parallel.worker_pids[0], signal.SIGSTOP)
        assert called.wait(1.5 + DETECT_S), "rank 0 did not see rank 1 hang"
        seen = time.monotonic() - t_stop
        print(f"\nrank 1 stopped mid-run: seen after {seen:.2f} s (hang timeout 1.5 s)")
        # The heartbeat last moved up to two beats (0.5 s) before the stop.
        assert seen >= 1.5 - 2 * HEARTBEAT_S
        assert isinstance(lost[0], RankHungError) and lost[0].rank == 1
        assert str(lost[0]).startswith("tensor-parallel rank 1 stopped answering (no heartbeat")
    finally:
        loop.shutdown()
        engine.shutdown()
    assert engine.parallel.worker_exit_codes == [-signal.SIGKILL]      # not left stopped
