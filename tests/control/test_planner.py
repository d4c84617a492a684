"""The planner: leader election and load reports on a real redis-server, the sizing
rules with exact numbers, and the guards (pending, cooldowns, N/(N-1), cold start,
bounds, no flapping).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.control.election import LeaderElection
from tandem.control.load_reports import LoadReader, LoadReporter, RequestSample, WorkerLoad
from tandem.control.planner import (IntervalStats, Planner, PlannerConfig, PoolSize, aggregate,
                                    load_target, percentile, slo_target)


# -- leader election ------------------------------------------------------------------------------

def test_one_leader_and_failover_on_resign(state):
    a = LeaderElection(state, "planner", ttl_s=5, candidate_id="a")
    b = LeaderElection(state, "planner", ttl_s=5, candidate_id="b")
    assert a.poll() and not b.poll()
    assert a.poll() and not b.poll()             # renewals keep it
    assert a.leader() == "a"
    a.resign()
    assert not a.is_leader and b.poll() and b.leader() == "b"
    assert not a.poll()


def test_a_stalled_leader_is_replaced_after_the_ttl_and_cannot_renew(state):
    a = LeaderElection(state, "planner", ttl_s=0.3, candidate_id="a")
    b = LeaderElection(state, "planner", ttl_s=0.3, candidate_id="b")
    assert a.poll() and not b.poll()
    time.sleep(0.45)                              # a stalls past its lease
    assert not a.is_leader                        # it steps down by its own clock
    assert b.poll() and b.leader() == "b"
    assert not a.poll()                           # its renewal must not extend b's lease
    assert state.redis.get(state.key("leader", "planner")) == "b"


def test_election_rejects_bad_arguments(state):
    with pytest.raises(ValueError, match="ttl_s"):
        LeaderElection(state, "planner", ttl_s=0)
    with pytest.raises(ValueError, match="role"):
        LeaderElection(state, "")


# -- load reports ---------------------------------------------------------------------------------

def test_reports_round_trip_through_redis(state):
    reader = LoadReader(state)
    reporter = LoadReporter(state, "router-x")
    reporter.arrival(7)
    reporter.flush({})
    assert reader.read().arrivals == []           # "$": the backlog before the planner started
    sample = RequestSample(isl=12, osl=5, ttft_s=0.25, itl_s=None, prefill="prefill-0",
                           decode="decode-1", ok=True)
    reporter.arrival(12)
    reporter.finished(sample)
    n = reporter.flush({"decode-1": WorkerLoad("decode", 0, 0.5, 2, 1)})
    assert n == 2
    obs = reader.read()
    assert obs.arrivals == [12] and obs.finished == [sample]
    assert obs.first_ms is not None and obs.first_ms <= obs.last_ms
    assert reader.read().finished == []           # each entry is read once
    assert reader.worker_loads(["decode-1", "prefill-0"]) == {
        "decode-1": WorkerLoad("decode", 0, 0.5, 2, 1)}
    reader.forget_workers(["decode-1"])
    assert reader.worker_loads(["decode-1"]) == {}


# -- sizing rules ---------------------------------------------------------------------------------

SLO = PlannerConfig(mode="slo", interval_s=10, ttft_slo_s=1.0, itl_slo_s=0.1,
                    prefill_capacity_tok_s=200, decode_capacity_tok_s=40, min_samples=3,
                    max_prefill=8, max_decode=8)


def test_percentile_interpolates():
    assert percentile([], 0.9) is None
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 0.9) == pytest.approx(10.0)
    assert percentile([0, 10], 0.25) == pytest.approx(2.5)


def test_slo_targets_follow_the_throughput_formulas():
    # 10 requests in 10 s of ISL 500: 500 prompt tokens/s over 200 per worker -> 3.
    stats = IntervalStats(seconds=10, num_arrivals=10, mean_isl=500, mean_osl=100,
                          num_finished=10, ttft_p90_s=0.5, itl_p90_s=0.05)
    assert slo_target("prefill", stats, SLO)[0] == 3
    # 1 request/s of OSL 100 = 100 output tokens/s over 40 per worker -> 3.
    assert slo_target("decode", stats, SLO)[0] == 3
    # Over the SLO, the observed/target ratio lowers the capacity: 2x TTFT -> 100/worker -> 5.
    late = IntervalStats(seconds=10, num_arrivals=10, mean_isl=500, mean_osl=100,
                         num_finished=10, ttft_p90_s=2.0, itl_p90_s=0.4)
    assert slo_target("prefill", late, SLO)[0] == 5
    assert slo_target("decode", late, SLO)[0] == 10      # 100 / (40 * 0.25)
    # Too few samples, or no capacity: no SLO answer (load mode decides).
    few = IntervalStats(seconds=10, num_arrivals=2, mean_isl=500, num_finished=2)
    assert slo_target("prefill", few, SLO) is None
    no_cap = PlannerConfig(mode="slo", prefill_capacity_tok_s=None)
    assert slo_target("prefill", stats, no_cap) is None


def test_load_rules_saturate_and_check_n_over_n_minus_1():
    cfg = PlannerConfig(prefill_queue_high=1000, decode_kv_high=0.7, decode_waiting_high=0.5,
                        headroom=0.7)
    assert load_target("prefill", 1, IntervalStats(10, prefill_queue=1500), cfg)[0] == 2
    assert load_target("decode", 2, IntervalStats(10, decode_kv=0.8), cfg)[0] == 3
    assert load_target("decode", 2, IntervalStats(10, decode_waiting=1.0), cfg)[0] == 3
    # Two decode workers at 30% KV: on one they would be at 60% >= 0.7 x 0.7: keep both.
    assert load_target("decode", 2, IntervalStats(10, decode_kv=0.3), cfg)[0] == 2
    # At 20% they would be at 40% on one: shrink.
    assert load_target("decode", 2, IntervalStats(10, decode_kv=0.2), cfg)[0] == 1
    # One worker never goes lower, however idle.
    assert load_target("prefill", 1, IntervalStats(10), cfg)[0] == 1


def test_aggregate_ignores_cold_workers():
    from tandem.control.load_reports import Observations

    warm_req = RequestSample(100, 10, 0.2, 0.05, "prefill-0", "decode-0", True)
    cold_req = RequestSample(900, 90, 5.0, 0.5, "prefill-1", "decode-0", True)
    obs = Observations(arrivals=[100, 900], finished=[warm_req, cold_req])
    loads = [{"prefill-0": WorkerLoad("prefill", 100), "prefill-1": WorkerLoad("prefill", 5000),
              "decode-0": WorkerLoad("decode", 0, 0.4, 3, 0)},
             {"prefill-0": WorkerLoad("prefill", 300), "decode-0": WorkerLoad("decode", 0, 0.6, 3, 2)}]
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
    stats = aggregate(10.0, obs, loads, roles, warm={"prefill-0", "decode-0"})
    assert stats.num_arrivals == 2 and stats.num_finished == 1
    assert (stats.mean_isl, stats.mean_osl, stats.ttft_p90_s) == (100, 10, 0.2)
    assert stats.prefill_queue == 200 and stats.decode_kv == pytest.approx(0.5)
    assert stats.decode_waiting == 1.0


# -- guards ---------------------------------------------------------------------------------------

class Pools:
    """A PoolController whose pools change only when a test says so (no Ray here:
    the Ray one is exercised in tests/cluster/test_autoscaling.py)."""

    def __init__(self, prefill=1, decode=1, devices=None):
        devices = devices or {}
        self.sizes = {"prefill": PoolSize(prefill, devices_per_worker=devices.get("prefill", 1)),
                      "decode": PoolSize(decode, devices_per_worker=devices.get("decode", 1))}
        self.calls: list[tuple[str, int]] = []

    def pool_sizes(self):
        return dict(self.sizes)

    def worker_ages(self):
        return {}

    async def scale(self, pool, target):
        self.calls.append((pool, target))
        self.sizes[pool] = PoolSize(target, devices_per_worker=self.sizes[pool].devices_per_worker)


def _planner(**kw) -> tuple[Planner, Pools]:
    cfg = PlannerConfig(**{"interval_s": 10, "scale_up_cooldown_s": 30,
                           "scale_down_cooldown_s": 60, "scale_down_intervals": 2,
                           "prefill_queue_high": 1000, "decode_kv_high": 0.7, **kw})
    pools = Pools()
    return Planner(cfg, reader=None, controller=pools), pools


def _targets(planner, stats, sizes, now):
    return {d.pool: d.target for d in planner.decide(stats, sizes, now)}


def test_no_scale_up_while_pending_and_cooldown_after_a_change():
    planner, _ = _planner(max_prefill=4)
    busy = IntervalStats(10, prefill_queue=5000)
    assert _targets(planner, busy, {"prefill": PoolSize(1), "decode": PoolSize(1)}, 0)["prefill"] == 2
    # The new worker is pending: hold, however busy.
    assert _targets(planner, busy, {"prefill": PoolSize(1, pending=1),
                                    "decode": PoolSize(1)}, 40)["prefill"] == 2
    # It is ready, but the last change was 10 s ago (< 30 s cooldown).
    planner, _ = _planner(max_prefill=4)
    _targets(planner, busy, {"prefill": PoolSize(1), "decode": PoolSize(1)}, 0)
    assert _targets(planner, busy, {"prefill": PoolSize(2), "decode": PoolSize(1)}, 10)["prefill"] == 2
    assert _targets(planner, busy, {"prefill": PoolSize(2), "decode": PoolSize(1)}, 31)["prefill"] == 3


def test_cooldown_counts_from_when_the_new_worker_serves():
    """A worker that took 50 s to start must not be retired by the first quiet
    intervals after it joins: the scale-down cooldown starts when it is ready."""
    planner, _ = _planner(scale_down_intervals=1, scale_down_cooldown_s=60)
    busy, idle = IntervalStats(10, prefill_queue=5000), IntervalStats(10)
    _targets(planner, busy, {"prefill": PoolSize(1), "decode": PoolSize(1)}, 0)
    _targets(planner, busy, {"prefill": PoolSize(1, pending=1), "decode": PoolSize(1)}, 50)
    sizes = {"prefill": PoolSize(2), "decode": PoolSize(1)}
    assert _targets(planner, idle, sizes, 100)["prefill"] == 2      # 50 s after it joined
    assert _targets(planner, idle, sizes, 111)["prefill"] == 1


def test_scale_down_waits_for_consecutive_intervals_one_worker_at_a_time():
    planner, _ = _planner()
    idle = IntervalStats(10)
    sizes = {"prefill": PoolSize(3), "decode": PoolSize(1)}
    assert _targets(planner, idle, sizes, 100)["prefill"] == 3        # 1 of 2 intervals
    assert _targets(planner, idle, sizes, 110)["prefill"] == 2        # 2 of 2: one fewer
    sizes = {"prefill": PoolSize(2), "decode": PoolSize(1)}
    assert _targets(planner, idle, sizes, 120)["prefill"] == 2
    assert _targets(planner, idle, sizes, 130)["prefill"] == 2        # cooldown (60 s)
    assert _targets(planner, idle, sizes, 175)["prefill"] == 1
    # A busy interval in between resets the count.
    planner, _ = _planner()
    sizes = {"prefill": PoolSize(2), "decode": PoolSize(1)}
    assert _targets(planner, idle, sizes, 100)["prefill"] == 2
    assert _targets(planner, IntervalStats(10, prefill_queue=600), sizes, 110)["prefill"] == 2
    assert _targets(planner, idle, sizes, 120)["prefill"] == 2


def test_targets_stay_within_bounds():
    planner, _ = _planner(mode="slo", prefill_capacity_tok_s=10, decode_capacity_tok_s=10,
                          min_samples=1, max_prefill=3, min_decode=2, max_decode=5)
    huge = IntervalStats(10, num_arrivals=1000, mean_isl=1000, mean_osl=0.1, num_finished=100)
    t = _targets(planner, huge, {"prefill": PoolSize(1), "decode": PoolSize(2)}, 0)
    assert t == {"prefill": 3, "decode": 2}


def test_slo_scale_down_needs_the_n_over_n_minus_1_check():
    # Demand 150 tok/s, 100 per worker: the formula wants 2 of the 3; with one fewer the
    # two left would run at 75% > headroom 0.7: held at 3 until demand drops.
    planner, _ = _planner(mode="slo", prefill_capacity_tok_s=100, decode_capacity_tok_s=100,
                          min_samples=1, headroom=0.7, scale_down_intervals=1,
                          scale_down_cooldown_s=0)
    stats = IntervalStats(10, num_arrivals=10, mean_isl=150, mean_osl=50, num_finished=10)
    t = _targets(planner, stats, {"prefill": PoolSize(3), "decode": PoolSize(1)}, 100)
    assert t["prefill"] == 3
    stats.mean_isl = 120      # 120 < 0.7 x 200
    t = _targets(planner, stats, {"prefill": PoolSize(3), "decode": PoolSize(1)}, 200)
    assert t["prefill"] == 2


def test_constant_load_does_not_flap():
    planner, pools = _planner(scale_down_intervals=2, scale_up_cooldown_s=0,
                              scale_down_cooldown_s=0, max_decode=6)
    # Decode KV load that scales with 1/N: 1.2 "workers' worth" of KV in total.
    history = []
    for i in range(40):
        n = pools.sizes["decode"].ready
        stats = IntervalStats(10, decode_kv=1.2 / n)
        for d in planner.decide(stats, pools.pool_sizes(), i * 10.0):
            pools.sizes[d.pool] = PoolSize(d.target)
        history.append(pools.sizes["decode"].ready)
    assert history[-30:] == [2] * 30, history


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mode"):
        PlannerConfig(mode="fast")
    with pytest.raises(ValueError, match="min_decode"):
        PlannerConfig(min_decode=3, max_decode=2)
    with pytest.raises(ValueError, match="headroom"):
        PlannerConfig(headroom=1.5)
    with pytest.raises(ValueError, match="prefill_capacity_tok_s"):
        PlannerConfig(prefill_capacity_tok_s=0)


# -- the loop ---------------------------------------------------------------------------------------

def test_planner_steps_read_reports_and_apply_through_the_controller(state):
    """Two planners on one Redis: only the elected one applies; the reports of a
    saturated prefill pool make it add a prefill worker."""
    reporter = LoadReporter(state, "router-t")

    class Ages(Pools):
        def worker_ages(self):
            return {"prefill-0": 100.0, "decode-0": 100.0}

    cfg = PlannerConfig(interval_s=0.2, sample_interval_s=0.05, prefill_queue_high=100,
                        scale_up_cooldown_s=0, warmup_s=1)
    pools_a, pools_b = Ages(), Ages()
    a = Planner(cfg, LoadReader(state), pools_a, LeaderElection(state, "planner", 5, "a"))
    b = Planner(cfg, LoadReader(state), pools_b, LeaderElection(state, "planner", 5, "b"))

    async def run():
        for _ in range(12):
            reporter.flush({"prefill-0": WorkerLoad("prefill", 500),
                            "decode-0": WorkerLoad("decode", 0, 0.1)})
            await a.step()
            await b.step()
            await asyncio.sleep(0.05)
        await a.stop()
        await b.stop()
    asyncio.run(run())
    assert pools_a.calls and pools_a.calls[0] == ("prefill", 2)
    assert pools_b.calls == []
    assert all(pool == "prefill" for pool, _ in pools_a.calls)
    entries = state.redis.xrange(state.key("planner", "decisions"))
    assert entries and '"pool": "prefill"' in entries[0][1]["decisions"]


def test_a_new_leader_under_load_keeps_the_old_leaders_cooldown(state):
    """Fail-over under load: the leader adds a prefill worker and dies (no resign);
    the standby takes the lease after its TTL while the prefill pool is still
    saturated. It restores the cooldowns from the decisions the old leader recorded,
    so it holds instead of adding a third worker at once; later, with the cooldown
    over, it scales on."""
    reporter = LoadReporter(state, "router-t")

    class Shared(Pools):          # both planners see and change the same pools
        def worker_ages(self):
            return {"prefill-0": 100.0, "prefill-1": 100.0, "decode-0": 100.0}

    pools = Shared()
    cfg = PlannerConfig(interval_s=0.2, sample_interval_s=0.05, prefill_queue_high=100,
                        scale_up_cooldown_s=2.0, warmup_s=1, max_prefill=4)
    a = Planner(cfg, LoadReader(state), pools, LeaderElection(state, "planner", 0.4, "a"))
    b = Planner(cfg, LoadReader(state), pools, LeaderElection(state, "planner", 0.4, "b"))
    saturated = {"prefill-0": WorkerLoad("prefill", 500), "prefill-1": WorkerLoad("prefill", 500),
                 "decode-0": WorkerLoad("decode", 0, 0.1)}
    held = []

    async def tick(*planners):
        reporter.flush(saturated)
        for p in planners:
            for d in await p.step():
                if d.pool == "prefill" and p is b:
                    held.append(d)
        await asyncio.sleep(0.05)

    async def run():
        while not pools.calls:                   # a leads and adds a prefill worker
            await tick(a, b)
        t_change = time.monotonic()
        # a dies here: it never steps (nor renews) again. b takes over after the TTL.
        while time.monotonic() - t_change < 1.5:
            await tick(b)
        assert b.election.is_leader and pools.calls == [("prefill", 2)]
        while len(pools.calls) < 2:               # the cooldown ends 2 s after a's change
            await tick(b)
        return t_change
    t_change = asyncio.run(run())
    assert pools.calls == [("prefill", 2), ("prefill", 3)]
    *holds, last = held
    assert holds and all(d.target == d.current == 2 and "held: cooldown" in d.reason
                         for d in holds), holds
    assert (last.current, last.target) == (2, 3)
    assert time.monotonic() - t_change >= cfg.scale_up_cooldown_s - 0.3
    asyncio.run(b.stop())


def test_the_budget_caps_growth_until_the_other_pool_shrinks():
    planner, _ = _planner(max_total_workers=3, max_prefill=3, max_decode=3,
                          scale_down_intervals=1, scale_down_cooldown_s=0, scale_up_cooldown_s=0)
    # Decode saturated, prefill busy enough to keep its two workers: no room.
    stats = IntervalStats(10, prefill_queue=600, decode_waiting=3)
    sizes = {"prefill": PoolSize(2), "decode": PoolSize(1)}
    d = {x.pool: x for x in planner.decide(stats, sizes, 0)}
    assert (d["prefill"].target, d["decode"].target) == (2, 1) and "capped" in d["decode"].reason
    # Prefill idle: it gives a worker back; decode may only grow once it has gone
    # (the draining worker still counts).
    stats = IntervalStats(10, prefill_queue=0, decode_waiting=3)
    d = {x.pool: x.target for x in planner.decide(stats, sizes, 10)}
    assert d == {"prefill": 1, "decode": 1}
    d = {x.pool: x.target for x in planner.decide(
        stats, {"prefill": PoolSize(1, draining=1), "decode": PoolSize(1)}, 20)}
    assert d == {"prefill": 1, "decode": 1}
    d = {x.pool: x.target for x in planner.decide(
        stats, {"prefill": PoolSize(1), "decode": PoolSize(1)}, 30)}
    assert d == {"prefill": 1, "decode": 2}


# -- workers as tensor-parallel groups --------------------------------------------------------------

def _groups(prefill, decode, prefill_devices=1, decode_devices=2, **kw):
    return {"prefill": PoolSize(prefill, devices_per_worker=prefill_devices, **kw),
            "decode": PoolSize(decode, devices_per_worker=decode_devices)}


def test_a_device_budget_counts_each_worker_as_its_group():
    """Decode workers of 2 ranks cost 2 devices each: 8 devices hold 2 prefill + 3
    decode workers, and a fourth decode worker does not fit; the same pools under a
    budget of workers would grow on."""
    kw = dict(max_prefill=4, max_decode=4, scale_up_cooldown_s=0)
    saturated = IntervalStats(10, prefill_queue=600, decode_waiting=3)
    planner, _ = _planner(max_total_devices=8, **kw)
    assert _targets(planner, saturated, _groups(2, 2), 0) == {"prefill": 2, "decode": 3}
    d = {x.pool: x for x in planner.decide(saturated, _groups(2, 3), 10)}
    assert (d["decode"].current, d["decode"].target) == (3, 3)
    assert d["decode"].reason.endswith("capped: 8 devices in all, 2 per decode worker")
    by_workers, _ = _planner(max_total_workers=8, **kw)
    assert _targets(by_workers, saturated, _groups(2, 3), 10)["decode"] == 4


def test_a_group_is_started_whole_or_not_at_all():
    """One device left: a 1-device prefill worker fits, half of a 2-device decode
    worker is never asked for, however saturated decode is."""
    kw = dict(max_total_devices=6, max_prefill=4, max_decode=4, scale_up_cooldown_s=0)
    planner, _ = _planner(**kw)
    busy = IntervalStats(10, prefill_queue=5000, decode_waiting=3)
    # 1 + 2 x 2 = 5 devices used; prefill asks for the larger relative increase (2/1).
    assert _targets(planner, busy, _groups(1, 2), 0) == {"prefill": 2, "decode": 2}
    planner, _ = _planner(**kw)
    decode_only = IntervalStats(10, prefill_queue=600, decode_waiting=3)
    d = {x.pool: x for x in planner.decide(decode_only, _groups(1, 2), 0)}
    assert d["decode"].target == 2 and "capped: 6 devices" in d["decode"].reason
    # Draining workers hold their devices until they are gone: of 5, a draining
    # prefill worker leaves 1 free; once it has gone, 2.
    planner, _ = _planner(**{**kw, "max_total_devices": 5})
    assert _targets(planner, decode_only, _groups(1, 1, draining=1), 0)["decode"] == 1
    assert _targets(planner, decode_only, _groups(1, 1), 0)["decode"] == 2


def test_slo_capacity_is_per_worker_whatever_its_devices():
    """A profile of a 2-rank worker gives the group's tokens/s: the SLO target counts
    workers (groups) from it, and only the device budget multiplies by the ranks."""
    planner, _ = _planner(mode="slo", prefill_capacity_tok_s=200, decode_capacity_tok_s=40,
                          min_samples=1, max_prefill=8, max_decode=8, max_total_devices=6,
                          scale_up_cooldown_s=0)
    # 1 request/s of OSL 100 = 100 output tokens/s over 40 per worker -> 3 workers.
    stats = IntervalStats(10, num_arrivals=10, mean_isl=100, mean_osl=100, num_finished=10,
                          ttft_p90_s=0.5, itl_p90_s=0.05)
    assert slo_target("decode", stats, planner.config)[0] == 3
    d = {x.pool: x for x in planner.decide(stats, _groups(1, 1), 0)}
    # 6 devices - 1 prefill - 2 (the decode worker) leaves room for 1 more 2-device worker.
    assert (d["decode"].wanted, d["decode"].target) == (3, 2)
    assert (d["prefill"].wanted, d["prefill"].target) == (1, 1)


def test_group_sizes_and_device_budgets_are_checked():
    with pytest.raises(ValueError, match="devices_per_worker"):
        PoolSize(1, devices_per_worker=0)
    with pytest.raises(ValueError, match="draining"):
        PoolSize(1, draining=-1)
    assert PoolSize(2, pending=1, draining=1, devices_per_worker=4).devices == 16
    with pytest.raises(ValueError, match="max_total_devices"):
        PlannerConfig(max_total_devices=1)


def test_the_controller_reads_the_group_sizes_from_the_serve_config():
    from tandem.engine.config import EngineConfig
    from tandem.router.autoscaler import devices_per_worker
    from tandem.router.launcher import ServeConfig

    assert devices_per_worker(ServeConfig()) == {"prefill": 1, "decode": 1}
    colocated = ServeConfig(mode="colocated", engine=EngineConfig(tensor_parallel_size=2))
    assert devices_per_worker(colocated)["decode"] == 2


def test_serve_refuses_a_device_budget_below_its_initial_pools():
    from tandem.router import cli

    def config(*flags):
        return cli._serve_config(cli.build_parser().parse_args(
            ["serve", "--autoscale", "--num-prefill", "2", "--num-decode", "2", *flags]))
    assert config("--max-total-devices", "4").autoscale.max_total_devices == 4
    with pytest.raises(ValueError, match=r"--max-total-devices: 3 devices cannot hold the "
                                         r"initial pools \(2 prefill x 1 \+ 2 decode x 1 = 4\)"):
        config("--max-total-devices", "3")
    assert config().autoscale.max_total_devices is None


def test_a_planner_on_redis_caps_a_saturated_group_pool_by_devices(state):
    """The loop on a real redis-server: decode workers of 2 ranks, saturated; the
    budget of 5 devices (1 prefill + 2 x 2 decode) leaves no room for a third, and
    the decision recorded in the cluster state says why."""
    reporter = LoadReporter(state, "router-t")

    class Ages(Pools):
        def worker_ages(self):
            return {"prefill-0": 100.0, "decode-0": 100.0, "decode-1": 100.0}

    cfg = PlannerConfig(interval_s=0.2, sample_interval_s=0.05, decode_waiting_high=0.5,
                        scale_up_cooldown_s=0, warmup_s=1, max_total_devices=5)
    pools = Ages(prefill=1, decode=2, devices={"decode": 2})
    planner = Planner(cfg, LoadReader(state), pools)

    async def run():
        decided = []
        while not decided:
            reporter.flush({"prefill-0": WorkerLoad("prefill", 0),
                            "decode-0": WorkerLoad("decode", 0, 0.9, 4, 3),
                            "decode-1": WorkerLoad("decode", 0, 0.9, 4, 3)})
            decided = await planner.step()
            await asyncio.sleep(0.05)
        return decided
    decisions = {d.pool: d for d in asyncio.run(run())}
    assert pools.calls == []
    assert (decisions["decode"].wanted, decisions["decode"].target) == (3, 2)
    (entry,) = state.redis.xrange(state.key("planner", "decisions"))
    assert "capped: 5 devices in all, 2 per decode worker" in entry[1]["decisions"]
