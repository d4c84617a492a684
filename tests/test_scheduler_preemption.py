"""Scheduler under KV pressure, on a simulated model: swap / recompute preemption,
the swapped queue, priorities and the no-starvation guarantee.

:class:`FakeRunner` executes a :class:`SchedulerOutput` the way the model
runner does (swap-out, swap-in, copy-on-write, then the forward pass) on a
simulated KV memory in which slot ``p`` of a sequence holds
``tuple(tokens[:p + 1])``, the tokens its KV depends on. Its "forward pass"
checks that every slot the request attends to holds exactly its own prefix,
and its "model" returns a next token that depends only on the tokens so far.
So outputs must not depend on scheduling, and any swap, copy or preemption that
loses or mixes up KV fails the step.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv.kv_cache_manager import KVCacheManager
from tandem.engine.scheduling.request import Request, RequestStatus
from tandem.engine.sampling.sampler import SampleResult
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.scheduler import Scheduler, SchedulerOutput

BS = 4


def next_token(tokens: list[int], sample_index: int) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-6:])) + 7 * sample_index) % 89 + 3


class FakeRunner:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.device = {i: [None] * BS for i in range(kv.num_blocks)}
        self.host = {i: [None] * BS for i in range(kv.num_host_blocks)}

    def execute(self, out: SchedulerOutput) -> dict[str, list[SampleResult]]:
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for s, d in out.block_copies:
            self.device[d] = list(self.device[s])
        for s in out.scheduled:             # write every request's new KV first, as layers do
            toks, table = s.request.all_token_ids, self.kv.get_block_ids(s.request.request_id)
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.device[table[p // BS]][p % BS] = tuple(toks[:p + 1])
        sampled = {}
        for s in out.scheduled:
            r = s.request
            toks, table = r.all_token_ids, self.kv.get_block_ids(r.request_id)
            end = s.num_computed_tokens + s.num_new_tokens
            for p in range(end):
                slot = self.device[table[p // BS]][p % BS]
                assert slot == tuple(toks[:p + 1]), f"{r.request_id}: wrong KV at position {p}"
            if s.samples:
                sampled[r.request_id] = [
                    SampleResult(next_token(toks, q.sample_index), None)
                    for q in [r, *r.pending_forks]]
        return sampled


def make(num_blocks: int, num_host_blocks: int, mode: str, *, budget: int = 64,
         max_num_seqs: int = 64, caching: bool = True, bytes_per_block: int = 100,
         burst_prefill_tokens: int | None = None) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, BS, caching, num_host_blocks)
    # 100 bytes per block over 1 MB/s vs 100 tokens/s: a swap costs less unless most
    # of the request's KV is a shared cached prefix.
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             preemption_mode=mode, recompute_tokens_per_s=100,
                             swap_bytes_per_s=1e6, burst_prefill_tokens=burst_prefill_tokens)
    sch = Scheduler(config, kv, max_model_len=num_blocks * BS, bytes_per_block=bytes_per_block)
    return sch, FakeRunner(kv)


def new_request(rid: str, prompt: list[int], max_tokens: int, priority: int = 0,
                n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n, temperature=0)
    first = Request(rid, list(prompt), params, priority=priority)
    first.pending_forks = [Request(f"{rid}#{i}", list(prompt), params, priority=priority,
                                   arrival_time=first.arrival_time, sample_index=i,
                                   parent_id=rid) for i in range(1, n)]
    return first


def step(sch: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sch.schedule()
    sch.update(out, runner.execute(out))
    sch.check_invariants()
    return out


def run_all(sch: Scheduler, runner: FakeRunner, requests: list[Request], max_steps: int
            ) -> tuple[dict[str, list[int]], int]:
    everyone = []
    for r in requests:
        sch.add_request(r)
        everyone += [r, *r.pending_forks]
    steps = 0
    while sch.has_unfinished():
        step(sch, runner)
        steps += 1
        assert steps <= max_steps, "no progress: the scheduler stalls"
    assert sch.kv.num_free_blocks == sch.kv.num_blocks
    assert sch.kv.num_free_host_blocks == sch.kv.num_host_blocks
    return {r.request_id: r.output_token_ids for r in everyone}, steps


def workload(seed: int, num_requests: int, with_priorities: bool = False):
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        shared = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []   # a common prefix
        prompt = shared + [rng.randrange(10, 90) for _ in range(rng.randint(1, 14))]
        specs.append((f"r{i}", prompt, rng.randint(4, 16),
                      rng.randint(0, 2) if with_priorities else 0, rng.choice([1, 1, 1, 2])))
    return specs


def build(specs) -> list[Request]:
    return [new_request(rid, p, k, prio, n) for rid, p, k, prio, n in specs]


# -- outputs never change ------------------------------------------------------------------

@pytest.mark.parametrize("mode,num_host_blocks", [
    ("swap", 64), ("recompute", 64), ("auto", 64), ("auto", 6), ("swap", 0)])
def test_outputs_identical_to_unconstrained_run(mode, num_host_blocks):
    specs = workload(seed=3, num_requests=14)
    baseline, _ = run_all(*make(256, 0, "recompute"), build(specs), max_steps=10_000)
    sch, runner = make(16, num_host_blocks, mode, budget=8)
    got, steps = run_all(sch, runner, build(specs), max_steps=2_000)
    assert got == baseline
    assert all(len(v) == k for (rid, _, k, _, n) in specs
               for v in [got[rid]] + [got[f"{rid}#{i}"] for i in range(1, n)])
    swaps, recomputes = sch.num_swap_preemptions, sch.num_recompute_preemptions
    assert sch.num_preemptions == swaps + recomputes > 0
    if mode == "recompute" or num_host_blocks == 0:
        assert swaps == 0
    elif mode == "swap":
        assert recomputes == 0 and swaps > 0      # the host pool never fills
    elif num_host_blocks == 64:
        # The cost model recomputes only requests mostly made of shared cached blocks.
        assert swaps > 0
    else:
        assert swaps > 0 and recomputes > 0       # 6 host blocks: falls back to recompute


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 24),
       num_host_blocks=st.integers(0, 24), budget=st.integers(4, 32),
       mode=st.sampled_from(["swap", "recompute", "auto"]), caching=st.booleans())
def test_random_workloads_keep_outputs_and_kv(seed, num_blocks, num_host_blocks, budget,
                                              mode, caching):
    specs = workload(seed, num_requests=8, with_priorities=True)
    baseline, _ = run_all(*make(256, 0, "recompute"), build(specs), max_steps=10_000)
    sch, runner = make(num_blocks, num_host_blocks, mode, budget=budget, caching=caching,
                       max_num_seqs=5)
    got, _ = run_all(sch, runner, build(specs), max_steps=3_000)
    assert got == baseline
    for kind, n in (("swap", sch.num_swap_preemptions),
                    ("recompute", sch.num_recompute_preemptions)):
        event(f"{kind} preemptions: {min(n, 3)}{'+' if n >= 3 else ''}")


@pytest.mark.parametrize("burst_prefill_tokens", [1, 6, 16])
def test_outputs_identical_with_bursts_split(burst_prefill_tokens):
    """Splitting bursts of prompts over steps changes when requests run, never what
    they produce, under KV pressure too."""
    specs = workload(seed=5, num_requests=14)
    baseline, _ = run_all(*make(256, 0, "recompute"), build(specs), max_steps=10_000)
    sch, runner = make(20, 8, "auto", budget=24, burst_prefill_tokens=burst_prefill_tokens)
    got, _ = run_all(sch, runner, build(specs), max_steps=3_000)
    assert got == baseline


def test_a_burst_is_split_by_the_decoding_sequences():
    """burst_prefill_tokens = 8: a step admits another new prompt only while its
    prompt tokens stay within 8 x (decoding sequences + 1); the first prompt of a
    step always goes in, whole if the budget allows; a burst the budget cannot take
    in two steps is left to the budget."""
    sch, runner = make(64, 0, "recompute", budget=64, burst_prefill_tokens=8)
    sch.add_request(new_request("d", list(range(10, 22)), 20))  # 12 tokens: alone, whole
    out = step(sch, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 12)]
    for i in range(4):                                            # a burst of 4 x 8 tokens
        sch.add_request(new_request(f"p{i}", list(range(30 + 10 * i, 38 + 10 * i)), 5))
    # 1 decoding: room for 16 prompt tokens, so 2 prompts.
    out = step(sch, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("d", 1), ("p0", 8), ("p1", 8)]
    # 3 decoding: room for 32, the other 2 together.
    out = step(sch, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("d", 1), ("p0", 1), ("p1", 1), ("p2", 8), ("p3", 8)]
    # Without the rule the budget alone decides: the whole burst in one step.
    sch, runner = make(64, 0, "recompute", budget=64)
    sch.add_request(new_request("d", list(range(10, 22)), 20))
    step(sch, runner)
    for i in range(4):
        sch.add_request(new_request(f"p{i}", list(range(30 + 10 * i, 38 + 10 * i)), 5))
    assert len(step(sch, runner).scheduled) == 5
    # A burst larger than two steps' budgets is spread over steps by the budget
    # already: the rule leaves it alone (17 x 8 tokens waiting, a 64-token budget).
    sch, runner = make(64, 0, "recompute", budget=64, burst_prefill_tokens=8)
    sch.add_request(new_request("d", list(range(10, 22)), 20))
    step(sch, runner)
    for i in range(17):
        sch.add_request(new_request(f"p{i}", list(range(30 + 5 * i, 38 + 5 * i)), 5))
    out = step(sch, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("d", 1), *((f"p{i}", 8) for i in range(7)), ("p7", 7)]


def test_burst_prefill_tokens_must_be_positive():
    with pytest.raises(ValueError, match="burst_prefill_tokens"):
        SchedulerConfig(burst_prefill_tokens=0)


# -- exact queue behaviour ------------------------------------------------------------------

def test_victim_is_the_least_important_latest_arrival_and_its_queue_depends_on_the_mode():
    def setup(mode):
        sch, runner = make(8, 8, mode)
        reqs = [new_request(rid, list(range(10 * i, 10 * i + 8)), 8, priority=prio)
                for i, (rid, prio) in enumerate((("a", 0), ("b", 1), ("c", 0), ("d", 0)), 1)]
        for r in reqs:
            sch.add_request(r)
        step(sch, runner)       # 8-token prompts: 2 full blocks each, all 8 blocks in use
        assert [r.request_id for r in sch.running] == ["a", "c", "d", "b"]
        # Admitted in (priority, arrival) order: a, c, d, then b.
        assert [sch.kv.get_block_ids(r.request_id) for r in reqs] == [[0, 1], [6, 7], [2, 3],
                                                                      [4, 5]]
        return sch, runner, reqs

    # Every request now writes token 8, into a third block. For a, the last in
    # order (b, priority 1) goes; its 2 blocks serve a and c; for d nothing is
    # left to preempt but d itself (the latest arrival of priority 0).
    sch, runner, (a, b, c, d) = setup("swap")
    out = step(sch, runner)
    assert out.preempted == [b, d]
    assert [s.request for s in out.scheduled] == [a, c]
    assert sch.swapped == [d, b] and b.status is d.status is RequestStatus.SWAPPED
    assert out.blocks_to_swap_out == [(6, 0), (7, 1), (4, 2), (5, 3)]
    # b's blocks were released tail first: a gets 7, c gets 6.
    assert [sch.kv.get_block_ids(r.request_id) for r in (a, c)] == [[0, 1, 7], [2, 3, 6]]
    assert [sch.kv.get_host_block_ids(r.request_id) for r in (b, d)] == [[0, 1], [2, 3]]
    assert (sch.num_swap_preemptions, sch.num_recompute_preemptions) == (2, 0)
    assert b.num_computed_tokens == 8 and b.num_preemptions == 1

    sch, runner, (a, b, c, d) = setup("recompute")
    out = step(sch, runner)
    assert out.preempted == [b, d] and out.blocks_to_swap_out == []
    assert sch.waiting == [d, b] and sch.swapped == []
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
               for r in (b, d))
    assert (sch.num_swap_preemptions, sch.num_recompute_preemptions) == (0, 2)


def test_swapped_request_resumes_before_later_arrivals():
    sch, runner = make(5, 8, "swap")
    # 8 prompt tokens + 5 outputs: KV of 12 tokens, 3 blocks at the end.
    a = new_request("a", list(range(10, 18)), 5)
    b = new_request("b", list(range(20, 28)), 5)
    sch.add_request(a)
    sch.add_request(b)
    step(sch, runner)                          # 2 blocks each, 1 free
    out = step(sch, runner)                    # both need a third: a takes it, b swaps itself out
    assert out.preempted == [b] and sch.swapped == [b] and sch.kv.num_free_blocks == 2
    late = new_request("late", list(range(30, 33)), 2)    # 1 block: would fit now
    sch.add_request(late)
    started = []
    for _ in range(50):
        if not sch.has_unfinished():
            break
        out = step(sch, runner)
        started += [s.request for s in out.scheduled if s.request in (b, late)
                    and s.request not in started]
        if late.status is RequestStatus.WAITING:
            assert not out.blocks_to_swap_in    # b is still out: late may not overtake it
    assert started == [b, late]
    assert b.num_preemptions == 1 and len(b.output_token_ids) == 5
    assert not sch.has_unfinished()


def test_high_priority_arrival_preempts_a_low_priority_running_request():
    sch, runner = make(6, 8, "swap")
    low1 = new_request("low1", list(range(10, 21)), 4, priority=5)   # 11 tokens: 3 blocks
    low2 = new_request("low2", list(range(20, 31)), 4, priority=5)
    sch.add_request(low1)
    sch.add_request(low2)
    step(sch, runner)
    assert sch.kv.num_free_blocks == 0
    urgent = new_request("urgent", list(range(40, 45)), 3, priority=0)   # 2 blocks
    sch.add_request(urgent)
    out = step(sch, runner)
    # The least important latest running request makes room; urgent starts at once.
    assert out.preempted == [low2] and low2.status is RequestStatus.SWAPPED
    assert [s.request.request_id for s in out.scheduled] == ["low1", "urgent"]
    assert sch.running[0] is urgent
    while sch.has_unfinished():
        step(sch, runner)
    assert [len(r.output_token_ids) for r in (low1, low2, urgent)] == [4, 4, 3]


def test_equal_priority_arrival_waits_instead_of_preempting():
    sch, runner = make(6, 8, "swap")
    sch.add_request(new_request("a", list(range(10, 21)), 4))
    sch.add_request(new_request("b", list(range(20, 31)), 4))
    step(sch, runner)
    late = new_request("late", list(range(40, 45)), 3)
    sch.add_request(late)
    out = step(sch, runner)
    assert out.preempted == [] and late.status is RequestStatus.WAITING


def test_no_starvation_under_an_endless_stream_of_arrivals():
    """A request preempted again and again still finishes, because the oldest
    unfinished request is never preempted and always scheduled (the guarantee in
    the scheduler's docstring); checked at every step while new requests keep
    arriving."""
    # One arrival per step, more than the pool can serve: the queues only grow.
    sch, runner = make(12, 6, "auto", budget=8, max_num_seqs=8)
    rng = random.Random(7)
    requests: list[Request] = []
    victim = None
    for t in range(400):
        r = new_request(f"s{t}", [rng.randrange(10, 90) for _ in range(rng.randint(3, 10))],
                        rng.randint(3, 20))
        sch.add_request(r)
        requests.append(r)
        out = sch.schedule()
        unfinished = [q for q in requests if not q.is_finished]
        oldest = min(unfinished, key=lambda q: q.sort_key)
        if oldest.status is RequestStatus.RUNNING or out.scheduled:
            assert oldest in [s.request for s in out.scheduled], f"step {t}: oldest not run"
        assert oldest not in out.preempted, f"step {t}: the oldest request was preempted"
        sch.update(out, runner.execute(out))
        sch.check_invariants()
        if victim is None:
            victim = next((q for q in requests if q.num_preemptions >= 3), None)
    assert victim is not None, "the workload never preempted a request three times"
    assert victim.is_finished and len(victim.output_token_ids) == victim.sampling_params.max_tokens
    assert sch.num_swap_preemptions > 0 and sch.num_recompute_preemptions > 0


def test_a_step_of_only_a_swap_out_is_not_empty():
    """Blocks held outside the scheduler (a decode worker's reservation) leave a
    lone running request no room: it swaps itself out, nothing runs, and the swap
    must still be executed."""
    sch, runner = make(4, 4, "swap")
    a = new_request("a", list(range(10, 18)), 4)       # 8 tokens: 2 blocks, full
    sch.add_request(a)
    step(sch, runner)
    assert sch.kv.allocate_slots("reserved", 0, 8)     # the other 2 blocks
    out = sch.schedule()
    assert out.scheduled == [] and out.preempted == [a]
    assert out.blocks_to_swap_out == [(0, 0), (1, 1)] and not out.is_empty
    sch.update(out, runner.execute(out))
    sch.check_invariants()
    sch.kv.free("reserved")
    while sch.has_unfinished():
        step(sch, runner)
    assert len(a.output_token_ids) == 4


def test_abort_of_swapped_and_waiting_requests_frees_everything():
    sch, runner = make(6, 8, "swap")
    a = new_request("a", list(range(10, 21)), 8)
    b = new_request("b", list(range(20, 31)), 8)
    sch.add_request(a)
    sch.add_request(b)
    while not sch.swapped:
        step(sch, runner)
    assert sch.abort_request("b") is b and b.status is RequestStatus.FINISHED_ABORTED
    assert sch.swapped == [] and sch.kv.num_free_host_blocks == 8
    assert sch.abort_request("a") is a
    assert not sch.has_unfinished() and sch.kv.num_free_blocks == 6
    sch.check_invariants()
