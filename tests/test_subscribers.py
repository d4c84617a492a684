"""Several routers polling one worker: per-subscriber outboxes of an engine loop.

The bookkeeping on a fake clock first (no model), then an :class:`EngineLoop` on the
real model (float32): two routers see only their own requests' deltas and the
same stats; a router that stops polling has its requests aborted after the
timeout, and the engine's blocks return to idle.
"""

from __future__ import annotations

import time

import pytest

from tandem.engine.runtime.outputs import RequestDelta, StepOutput, WorkerStats
from tandem.engine.runtime.subscribers import Subscribers
from tandem.engine.sampling.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(*request_ids: str, finished: tuple[str, ...] = (), tokens: int = 1) -> StepOutput:
    deltas = tuple(RequestDelta(rid, (7,), finish_reason="length" if rid in finished else None)
                   for rid in request_ids)
    return StepOutput(deltas, WorkerStats("decode-0", "decode", num_step_tokens=tokens))


def test_each_subscriber_gets_every_step_with_only_its_deltas():
    subs = Subscribers(5.0, Clock())
    subs.assign(["a1", "a2"], "router-a")
    subs.assign(["b1"], "router-b")
    subs.publish(_step("a1", "b1", "x"))
    subs.publish(_step("a2", finished=("a2",), tokens=2))
    a, b, default = (subs.poll(n, 0) for n in ("router-a", "router-b", ""))
    assert [[d.request_id for d in s.deltas] for s in a] == [["a1"], ["a2"]]
    assert [[d.request_id for d in s.deltas] for s in b] == [["b1"], []]
    assert [[d.request_id for d in s.deltas] for s in default] == [["x"], []]   # unassigned
    assert [s.stats for s in a] == [s.stats for s in b] == [s.stats for s in default]
    assert subs.owner("a2") == ""          # finished: forgotten
    assert subs.poll("router-a", 0) == []


def test_a_new_subscriber_starts_with_the_latest_stats():
    subs = Subscribers(5.0, Clock())
    subs.publish(_step(tokens=3))
    (first,) = subs.poll("router-c", 0)
    assert first.deltas == () and first.stats.num_step_tokens == 3


def test_a_silent_subscriber_is_dropped_with_its_requests():
    clock = Clock()
    subs = Subscribers(5.0, clock)
    subs.assign(["a1", "a1#1"], "router-a")
    subs.assign(["b1"], "router-b")
    subs.assign(["d1"], "")
    clock.now += 4
    subs.poll("router-b", 0)
    assert subs.drop_silent() == {}
    clock.now += 2                                   # a: 6 s silent, b: 2 s
    assert subs.drop_silent() == {"router-a": ["a1", "a1#1"]}
    assert subs.names == ["", "router-b"]
    clock.now += 10
    # The default subscriber keeps its requests however long it is silent ...
    assert subs.drop_silent() == {"router-b": ["b1"]}
    assert subs.names == [""] and subs.owner("d1") == ""
    # ... and its outbox goes only once it owns none.
    subs.prune(lambda rid: False)
    assert subs.drop_silent() == {"": []} and subs.names == []
    assert subs.poll("", 0) == [] and subs.names == [""]


def test_a_subscriber_waiting_in_poll_is_not_silent():
    import threading

    clock = Clock()
    subs = Subscribers(5.0, clock)
    subs.assign(["a1"], "router-a")
    started = threading.Event()

    def long_poll():
        started.set()
        subs.poll("router-a", 0.5)

    t = threading.Thread(target=long_poll)
    t.start()
    started.wait()
    time.sleep(0.1)
    clock.now += 60
    assert "router-a" not in subs.drop_silent()
    t.join()
    assert subs.drop_silent() == {}              # the poll just ended: not silent yet


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="subscriber_timeout_s"):
        Subscribers(0)


# -- an engine loop on the real model -----------------------------------------------------

# Long enough to fill blocks: their KV cache events must reach both routers.
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
               "goldsmith in Mainz combined a screw press with movable metal type, and")

@pytest.fixture(scope="module")
def base(f32_weights):
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)


def _loop(base, timeout_s: float):
    from tandem.engine.llm import LLMEngine
    from tandem.engine.runtime.engine_loop import EngineLoop

    engine = LLMEngine(base.config, weights_from=base.engine, enable_kv_events=True)
    return EngineLoop(engine, "decode-0", "decode", idle_wait_s=0.05,
                      subscriber_timeout_s=timeout_s).start()


def _add(loop, requests: list[tuple[str, str, list[int], SamplingParams]]):
    """Add ``(request id, router id, prompt, params)``s in one loop command."""
    def add():
        out = []
        for rid, router, prompt, params in requests:
            out += loop.engine.add_request(prompt, params, rid)
            loop.assign(rid, router)
        return out
    return loop.call(add).result(30)


def _block_counts(loop) -> dict:
    from tandem.engine.runtime.worker_common import block_counts

    return loop.call(block_counts, loop.engine).result(30)


@pytest.mark.slow
def test_two_routers_each_see_their_own_deltas_and_all_stats(base):
    loop = _loop(base, timeout_s=30.0)
    tok = base.tokenizer
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        reqs = _add(loop, [("a1", "router-a", tok.encode(LONG_PROMPT), p),
                           ("a2", "router-a", tok.encode("Name three rivers."),
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)),
                           ("b1", "router-b", tok.encode("Why is the sky blue?"), p)])
        got = {"router-a": [], "router-b": []}
        deadline = time.monotonic() + 120
        while not all(r.is_finished for r in reqs):
            assert time.monotonic() < deadline
            for name in got:
                got[name] += loop.poll(0.05, name)
        time.sleep(0.2)                                # the last steps' outputs
        for name in got:
            got[name] += loop.poll(0.05, name)
        # A delta names the request and the sample apart (a2's second sample: index 1).
        ids = {name: {(d.request_id, d.sample_index) for s in steps for d in s.deltas}
               for name, steps in got.items()}
        assert ids == {"router-a": {("a1", 0), ("a2", 0), ("a2", 1)}, "router-b": {("b1", 0)}}
        a, b = got["router-a"], got["router-b"]
        assert len(a) == len(b) > 1
        assert [s.stats for s in a] == [s.stats for s in b]
        assert [s.kv_events for s in a] == [s.kv_events for s in b]
        assert any(s.kv_events for s in a)
        tokens = {}
        for s in a + b:
            for d in s.deltas:
                tokens.setdefault((d.request_id, d.sample_index), []).extend(d.new_token_ids)
        assert {key: len(t) for key, t in tokens.items()} == {
            ("a1", 0): 8, ("a2", 0): 6, ("a2", 1): 6, ("b1", 0): 8}
        counts = _block_counts(loop)
        assert counts["num_free_blocks"] == counts["num_blocks"]
    finally:
        loop.shutdown()


@pytest.mark.slow
def test_a_router_that_stops_polling_has_its_requests_aborted(base):
    loop = _loop(base, timeout_s=1.0)
    tok = base.tokenizer
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        doomed = _add(loop, [("a1", "router-a", tok.encode("Write a long story."), long),
                             ("a2", "router-a", tok.encode("Count to a thousand."), long)])
        (kept,) = _add(loop, [("b1", "router-b", tok.encode("Hi."), short)])
        steps = []
        deadline = time.monotonic() + 60
        while not (all(r.is_finished for r in doomed) and kept.is_finished):
            assert time.monotonic() < deadline
            steps += loop.poll(0.1, "router-b")         # only router-b keeps polling
        assert all(r.status.finish_reason == "abort" for r in doomed)
        assert all(r.num_output_tokens < 400 for r in doomed)
        assert kept.status.finish_reason == "length" and kept.num_output_tokens == 4
        assert {d.request_id for s in steps for d in s.deltas} == {"b1"}
        assert "router-a" not in loop.subscribers.names
        counts = _block_counts(loop)
        assert counts["num_free_blocks"] == counts["num_blocks"]
        assert counts["num_running"] == counts["num_waiting"] == counts["num_reserved"] == 0
        assert loop.engine.runner.sampler.num_seeded_requests == 0
        # Router-a comes back: a new subscriber, with none of the aborted requests' deltas.
        time.sleep(0.2)
        assert all(not s.deltas for s in loop.poll(0.2, "router-a"))
    finally:
        loop.shutdown()


def test_build_runs_the_engine_on_the_loop_thread_below_the_others(base):
    """EngineLoop.build: the engine is built on the loop's own thread, where its steps
    run (torch's OpenMP runtime keeps a thread team per thread that starts parallel
    work, and slows every region down once there are more such threads than cores;
    see EngineLoop.build), and that thread runs ``nice`` lower than the caller's."""
    import os
    import threading

    from tandem.engine.llm import LLMEngine
    from tandem.engine.runtime.engine_loop import EngineLoop

    built_on = {}

    def make():
        built_on["tid"] = threading.get_native_id()
        return LLMEngine(base.config, weights_from=base.engine)

    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loop = EngineLoop.build(make, "decode-0", "decode", nice=3, idle_wait_s=0.05)
    try:
        tid = loop.call(threading.get_native_id).result(30)
        assert built_on["tid"] == tid != threading.get_native_id()
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, caller_nice + 3)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice
        reqs = loop.call(loop.engine.add_request, [1, 2, 3],
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)).result(30)
        deadline = time.monotonic() + 60
        while not reqs[0].is_finished and time.monotonic() < deadline:
            loop.poll(1.0)
        assert len(reqs[0].output_token_ids) == 4
    finally:
        loop.shutdown()

    def broken():
        raise ValueError("model: no such file")

    with pytest.raises(ValueError, match="no such file"):     # raised in the caller
        EngineLoop.build(broken, "decode-1", "decode")
