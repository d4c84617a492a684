"""The planner: how many prefill and how many decode workers the cluster should run.

One planner is active per cluster (elected through the cluster state,
:class:`~tandem.control.election.LeaderElection`); it samples what the routers
report (:mod:`tandem.control.load_reports`) once a second and, every
``interval_s``, computes a target size for each pool and hands it to a
:class:`PoolController` (on Ray: :class:`tandem.router.autoscaler.RayPoolController`).

Two ways to size a pool (``mode``):

``slo`` (after NVIDIA Dynamo's SLA planner): from the interval's request rate
and mean input / output lengths (ISL / OSL) and each worker's capacity at the
SLO, measured beforehand (``prefill_capacity_tok_s``: prompt tokens per second
one prefill worker serves within the TTFT SLO; ``decode_capacity_tok_s``: output
tokens per second one decode worker serves within the ITL SLO)::

    prefill = ceil(arrivals/s * ISL / (prefill_capacity * min(1, ttft_slo / ttft_p90)))
    decode  = ceil(arrivals/s * OSL / (decode_capacity  * min(1, itl_slo  / itl_p90)))

The correction factor (Dynamo's) lowers a worker's assumed capacity when the
observed latency is over its SLO (queueing, longer contexts than profiled); it
never raises it. With fewer than ``min_samples`` finished requests in the
interval (or no capacity given) the pool is sized in load mode.

``load`` (saturation rules in the manner of the llm-d workload variant
autoscaler): a pool is *saturated* when its mean load per worker is over a
threshold -- queued prefill tokens for prefill workers, KV cache usage or
waiting requests for decode workers -- and then grows by one; it shrinks by
one when the same load spread over one worker fewer stays under ``headroom``
times the threshold (the N/(N-1) check).

Guards against flapping and against acting on bad data, in both modes:

* a pool does not grow while it has pending workers (asked for, not yet
  serving: the Ray autoscaler may still be adding their node);
* after a change is complete (nothing pending or draining any more), a pool
  waits ``scale_up_cooldown_s`` / ``scale_down_cooldown_s`` before the next one;
* a pool shrinks only after ``scale_down_intervals`` consecutive intervals
  asked for it, by one worker at a time, and never below what the N/(N-1)
  check allows;
* samples of workers younger than ``warmup_s`` (cold start: first compilations,
  empty caches) and of requests they served are ignored;
* targets stay within ``[min, max]`` of each pool.

**A worker is its group.** A worker of tensor-parallel size N (its engine sharded
over N ranks: N GPUs, or N core sets on the CPU) is one worker everywhere here:
the capacities are per worker (``tandem profile`` measures the whole group), the
sizing rules and the bounds count workers, and the loads are per worker (rank 0's
KV cache manager governs every rank's cache). Only the device budget,
``max_total_devices``, counts what a worker holds: each worker of a pool costs the
pool's :attr:`PoolSize.devices_per_worker`, which the controller reads from the
workers' engine configuration (the ``tandem serve`` flags), so the number is
stated once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Protocol, Sequence

from tandem.control.load_reports import LoadReader, Observations, WorkerLoad

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
PLANNER_MODES = ("slo", "load")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's policy.

    Attributes:
        mode: ``slo`` or ``load`` (see the module docstring).
        interval_s: seconds between decisions (the adjustment interval).
        sample_interval_s: seconds between samples of the worker loads.
        ttft_slo_s, itl_slo_s: the latency targets, in seconds (TTFT p90, ITL p90).
        prefill_capacity_tok_s: prompt tokens/s one prefill worker serves within
            the TTFT SLO (``slo`` mode; None: load mode for the prefill pool).
        decode_capacity_tok_s: output tokens/s one decode worker serves within the
            ITL SLO (``slo`` mode; None: load mode for the decode pool).
        min_samples: finished requests an interval needs for ``slo`` mode.
        min_prefill, max_prefill, min_decode, max_decode: pool bounds (workers).
        prefill_queue_high: load mode: mean queued prefill tokens per prefill worker
            above which the pool is saturated (tokens).
        decode_kv_high: load mode: mean KV cache usage (0..1) per decode worker
            above which the pool is saturated.
        decode_waiting_high: load mode: mean waiting requests per decode worker
            above which the pool is saturated.
        headroom: the N/(N-1) check: a pool shrinks only if its load over one worker
            fewer stays under ``headroom`` x the saturation threshold (``load``), or
            its demand under ``headroom`` x the capacity of one worker fewer (``slo``).
        scale_up_cooldown_s, scale_down_cooldown_s: seconds after a change of a pool
            before it may grow / shrink again.
        scale_down_intervals: consecutive intervals that must ask for fewer workers.
        warmup_s: seconds after a worker joins during which its samples are ignored.
        leader_ttl_s: the planner's leader lease, in seconds.
        max_total_workers: the budget of both pools together, in workers (nodes or
            pods: one worker each); None = no cap beyond the pools' own maxima. It
            caps growth only: a pool grows into the room the other pool leaves when
            its own rules shrink it.
        max_total_devices: the budget of both pools together, in devices (GPUs, or
            CPU core sets): a worker counts its pool's ``devices_per_worker`` (its
            tensor-parallel size, :class:`PoolSize`); None = no such cap. Like
            ``max_total_workers`` it caps growth only, draining workers counting
            until they are gone.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    mode: str = "load"
    interval_s: float = 30.0
    sample_interval_s: float = 1.0
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.1
    prefill_capacity_tok_s: float | None = None
    decode_capacity_tok_s: float | None = None
    min_samples: int = 5
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    prefill_queue_high: float = 2048.0
    decode_kv_high: float = 0.7
    decode_waiting_high: float = 0.5
    headroom: float = 0.7
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 90.0
    scale_down_intervals: int = 2
    warmup_s: float = 10.0
    leader_ttl_s: float = 10.0
    max_total_workers: int | None = None
    max_total_devices: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"mode: expected one of {', '.join(PLANNER_MODES)}, got {self.mode!r}")
        for name in ("interval_s", "sample_interval_s", "ttft_slo_s", "itl_slo_s",
                     "prefill_queue_high", "decode_kv_high", "decode_waiting_high",
                     "leader_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("prefill_capacity_tok_s", "decode_capacity_tok_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: must be positive, got {v}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "warmup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom: must be in (0, 1], got {self.headroom}")
        if self.scale_down_intervals < 1 or self.min_samples < 1:
            raise ValueError("scale_down_intervals, min_samples: must be >= 1")
        for pool in POOLS:
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 1 <= lo <= hi:
                raise ValueError(f"min_{pool}, max_{pool}: need 1 <= min <= max, got {lo}, {hi}")
        if self.sample_interval_s > self.interval_s:
            raise ValueError("sample_interval_s: must not exceed interval_s")
        # A worker holds at least one device, so neither budget may be below the
        # smallest pools (the CLI checks the devices against the group sizes too).
        for name in ("max_total_workers", "max_total_devices"):
            v = getattr(self, name)
            if v is not None and v < self.min_prefill + self.min_decode:
                raise ValueError(f"{name}: {v} is below min_prefill + min_decode")

    def bounds(self, pool: str) -> tuple[int, int]:
        """``(min, max)`` workers of ``pool``."""
        return getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")


@dataclass(frozen=True)
class PoolSize:
    """A pool as the controller sees it.

    Attributes:
        ready: workers serving (not draining).
        pending: workers asked for and not yet serving.
        draining: workers being taken out (no new requests; finishing or migrating theirs).
        devices_per_worker: devices (GPUs, or CPU core sets) each worker of the pool
            holds: its tensor-parallel size (ranks per worker). The counts above are
            workers (groups), whatever this is.

    Raises:
        ValueError: a negative count, or ``devices_per_worker`` < 1.
    """

    ready: int
    pending: int = 0
    draining: int = 0
    devices_per_worker: int = 1

    def __post_init__(self) -> None:
        for name in ("ready", "pending", "draining"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.devices_per_worker < 1:
            raise ValueError(f"devices_per_worker: must be >= 1, got {self.devices_per_worker}")

    @property
    def devices(self) -> int:
        """Devices the pool holds or has asked for: ready, pending and draining
        workers, each ``devices_per_worker``."""
        return (self.ready + self.pending + self.draining) * self.devices_per_worker


class PoolController(Protocol):
    """Where a plan is applied (Ray actors, a Kubernetes scale subresource, ...)."""

    def pool_sizes(self) -> dict[str, PoolSize]:
        """``{"prefill": PoolSize, "decode": PoolSize}`` now, each with the devices
        one of its workers holds."""

    def worker_ages(self) -> dict[str, float]:
        """Seconds since each serving worker (by id) joined its pool."""

    async def scale(self, pool: str, target: int) -> None:
        """Start bringing ``pool`` to ``target`` workers (adding or draining); returns
        without waiting for new workers to serve or drained ones to go."""


@dataclass
class IntervalStats:
    """One interval's aggregate, the input of a decision.

    Attributes:
        seconds: the interval's length (seconds).
        num_arrivals: requests that arrived; mean_isl / mean_osl: mean input /
            output length of the requests that finished (tokens; 0 when none).
        num_finished: requests that finished (warm workers only).
        ttft_p90_s, itl_p90_s: latency percentiles of those (None: no sample).
        prefill_queue: mean queued prefill tokens per warm prefill worker.
        decode_kv: mean KV cache usage per warm decode worker (0..1).
        decode_waiting: mean waiting requests per warm decode worker.
    """

    seconds: float
    num_arrivals: int = 0
    mean_isl: float = 0.0
    mean_osl: float = 0.0
    num_finished: int = 0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    prefill_queue: float = 0.0
    decode_kv: float = 0.0
    decode_waiting: float = 0.0


@dataclass(frozen=True)
class PoolDecision:
    """What the planner decided for one pool, and why (logged, and kept in the state).

    Attributes:
        pool: ``prefill`` or ``decode``; current: its ready workers; wanted: what
            the sizing rule asked for; target: what is applied after the guards.
        rule: ``slo`` or ``load``; reason: a short explanation for operators.
    """

    pool: str
    current: int
    wanted: int
    target: int
    rule: str
    reason: str


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def aggregate(seconds: float, obs: Observations, load_samples: Sequence[dict[str, WorkerLoad]],
              roles: dict[str, str], warm: set[str]) -> IntervalStats:
    """Reduce an interval's observations to :class:`IntervalStats`.

    Args:
        seconds: the interval's length.
        obs: the stream entries read over the interval.
        load_samples: the worker loads sampled over the interval (one dict per sample).
        roles: worker id -> role, of the workers serving now.
        warm: ids of the workers past their warm-up; requests served by another
            worker and loads of other workers are left out (cold-start samples).
    """
    done = [s for s in obs.finished if s.decode in warm and (not s.prefill or s.prefill in warm)]
    stats = IntervalStats(seconds=seconds, num_arrivals=len(obs.arrivals), num_finished=len(done))
    if done:
        stats.mean_isl = sum(s.isl for s in done) / len(done)
        stats.mean_osl = sum(s.osl for s in done) / len(done)
        stats.ttft_p90_s = percentile([s.ttft_s for s in done if s.ttft_s is not None], 0.9)
        stats.itl_p90_s = percentile([s.itl_s for s in done if s.itl_s is not None], 0.9)
    elif obs.arrivals:
        stats.mean_isl = sum(obs.arrivals) / len(obs.arrivals)

    def mean(role_ok, attr: str) -> float:
        xs = [getattr(load, attr) for sample in load_samples for wid, load in sample.items()
              if wid in warm and role_ok(roles.get(wid))]
        return sum(xs) / len(xs) if xs else 0.0
    stats.prefill_queue = mean(lambda r: r == "prefill", "queued_prefill_tokens")
    stats.decode_kv = mean(lambda r: r in ("decode", "colocated"), "kv_cache_usage")
    stats.decode_waiting = mean(lambda r: r in ("decode", "colocated"), "num_waiting")
    return stats


def slo_target(pool: str, stats: IntervalStats, cfg: PlannerConfig) -> tuple[int, str] | None:
    """The SLO-mode worker count of ``pool`` and its reason; None when the interval
    cannot be used (too few samples, or no capacity for this pool)."""
    capacity = cfg.prefill_capacity_tok_s if pool == "prefill" else cfg.decode_capacity_tok_s
    if capacity is None or stats.num_finished < cfg.min_samples:
        return None
    rate = stats.num_arrivals / stats.seconds
    if pool == "prefill":
        demand, observed, slo = rate * stats.mean_isl, stats.ttft_p90_s, cfg.ttft_slo_s
    else:
        demand, observed, slo = rate * stats.mean_osl, stats.itl_p90_s, cfg.itl_slo_s
    correction = 1.0 if not observed else min(1.0, slo / observed)
    per_worker = capacity * correction
    wanted = max(1, math.ceil(demand / per_worker - 1e-9))
    reason = (f"{demand:.0f} tok/s demand / {per_worker:.0f} tok/s per worker "
              f"(capacity {capacity:.0f} x correction {correction:.2f})")
    return wanted, reason


def load_target(pool: str, current: int, stats: IntervalStats,
                cfg: PlannerConfig) -> tuple[int, str]:
    """The load-mode worker count of ``pool`` (one more, one fewer, or the same)."""
    if pool == "prefill":
        loads = [(stats.prefill_queue, cfg.prefill_queue_high, "queued prefill tokens")]
    else:
        loads = [(stats.decode_kv, cfg.decode_kv_high, "KV usage"),
                 (stats.decode_waiting, cfg.decode_waiting_high, "waiting requests")]
    for value, high, name in loads:
        if value > high:
            return current + 1, f"saturated: mean {name} {value:.2f} > {high:g}"
    if current > 1:
        shrunk = [(value * current / (current - 1), high, name) for value, high, name in loads]
        if all(v < cfg.headroom * high for v, high, _ in shrunk):
            worst = max(shrunk, key=lambda x: x[0] / x[1])
            return current - 1, (f"idle: on {current - 1} workers mean {worst[2]} would be "
                                 f"{worst[0]:.2f} < {cfg.headroom:g} x {worst[1]:g}")
    return current, "within thresholds"


class Planner:
    """The planning loop: elect, sample, decide, apply.

    Args:
        config: the policy.
        reader: what the routers reported.
        controller: applies the targets.
        election: this process's candidacy (:class:`~tandem.control.election.LeaderElection`);
            None = always the leader (one planner by construction).
        clock: monotonic seconds (tests may pass their own).
        on_interval: called with the pool sizes and the decisions of each interval
            decided (metrics).

    Attributes:
        intervals: ``(clock time, IntervalStats, decisions)`` of each interval
            decided, oldest first (the last 1000).
    """

    def __init__(self, config: PlannerConfig, reader: LoadReader, controller: PoolController,
                 election=None, clock=time.monotonic, on_interval=None) -> None:
        self.config = config
        self.reader = reader
        self.controller = controller
        self.election = election
        self.clock = clock
        self.on_interval = on_interval
        self.intervals: list[tuple[float, IntervalStats, list[PoolDecision]]] = []
        self._last_change: dict[str, float] = {}
        self._down_votes: dict[str, int] = {p: 0 for p in POOLS}
        self._loads: list[dict[str, WorkerLoad]] = []
        self._obs = Observations([], [])
        self._interval_start: float | None = None
        self._task: asyncio.Task | None = None

    # -- one decision ------------------------------------------------------------------------
    def decide(self, stats: IntervalStats, sizes: dict[str, PoolSize],
               now: float) -> list[PoolDecision]:
        """The targets for this interval, after the guards (no I/O; see the module
        docstring). Updates the cooldown and scale-down bookkeeping."""
        cfg = self.config
        out = []
        for pool in POOLS:
            size = sizes[pool]
            current = size.ready + size.pending
            lo, hi = cfg.bounds(pool)
            sized = slo_target(pool, stats, cfg) if cfg.mode == "slo" else None
            rule = "slo"
            if sized is None:
                rule = "load"
                sized = load_target(pool, size.ready, stats, cfg)
            wanted, reason = sized
            target = min(hi, max(lo, wanted))
            since = now - self._last_change.get(pool, -math.inf)
            if size.pending or size.draining:
                # The pool is changing: its load says little about its next size yet,
                # and the cooldowns count from when the change is complete.
                self._down_votes[pool] = 0
                self._last_change[pool] = now
                if target != current:
                    target, reason = current, (f"{reason}; held: {size.pending} pending, "
                                               f"{size.draining} draining")
            elif target > current:
                self._down_votes[pool] = 0
                if since < cfg.scale_up_cooldown_s:
                    target, reason = current, f"{reason}; held: cooldown"
            elif target < current:
                self._down_votes[pool] += 1
                if self._down_votes[pool] < cfg.scale_down_intervals:
                    target, reason = current, (f"{reason}; held: {self._down_votes[pool]}/"
                                               f"{cfg.scale_down_intervals} intervals")
                elif since < cfg.scale_down_cooldown_s:
                    target, reason = current, f"{reason}; held: cooldown"
                else:
                    target = current - 1          # one at a time
                    if rule == "slo" and not self._slo_allows_down(pool, stats, current):
                        target, reason = current, f"{reason}; held: N/(N-1) check"
            else:
                self._down_votes[pool] = 0
            out.append(PoolDecision(pool, current, wanted, target, rule, reason))
        out = self._within_budget(out, sizes)
        for d in out:
            if d.target != d.current:
                self._last_change[d.pool] = now
                self._down_votes[d.pool] = 0
        return out

    def _within_budget(self, decisions: list[PoolDecision],
                       sizes: dict[str, PoolSize]) -> list[PoolDecision]:
        """Cut growth to ``max_total_workers`` workers and ``max_total_devices``
        devices, a worker costing its pool's ``devices_per_worker`` (draining
        workers still count), the pool asking for the larger relative increase
        first. A pool is never grown by part of a worker: a group of N devices
        needs N free devices."""
        cfg = self.config
        if cfg.max_total_workers is None and cfg.max_total_devices is None:
            return decisions
        workers_room = devices_room = 0
        if cfg.max_total_workers is not None:
            workers_room = (cfg.max_total_workers - sum(d.current for d in decisions)
                            - sum(s.draining for s in sizes.values()))
        if cfg.max_total_devices is not None:
            devices_room = cfg.max_total_devices - sum(s.devices for s in sizes.values())
        out = {d.pool: d for d in decisions}
        for d in sorted((d for d in decisions if d.target > d.current),
                        key=lambda d: -d.target / max(1, d.current)):
            per = sizes[d.pool].devices_per_worker
            grow, capped_by = d.target - d.current, ""
            if cfg.max_total_workers is not None and workers_room < grow:
                grow, capped_by = max(0, workers_room), f"{cfg.max_total_workers} workers in all"
            if cfg.max_total_devices is not None and devices_room // per < grow:
                grow = max(0, devices_room // per)
                capped_by = (f"{cfg.max_total_devices} devices in all, {per} per "
                             f"{d.pool} worker")
            workers_room -= grow
            devices_room -= grow * per
            if capped_by:
                out[d.pool] = PoolDecision(d.pool, d.current, d.wanted, d.current + grow, d.rule,
                                           f"{d.reason}; capped: {capped_by}")
        return [out[d.pool] for d in decisions]

    def _slo_allows_down(self, pool: str, stats: IntervalStats, current: int) -> bool:
        """Demand stays under ``headroom`` x the capacity of ``current - 1`` workers."""
        cfg = self.config
        capacity = cfg.prefill_capacity_tok_s if pool == "prefill" else cfg.decode_capacity_tok_s
        rate = stats.num_arrivals / stats.seconds
        demand = rate * (stats.mean_isl if pool == "prefill" else stats.mean_osl)
        return demand < cfg.headroom * capacity * (current - 1)

    # -- the loop ----------------------------------------------------------------------------
    async def step(self) -> list[PoolDecision]:
        """One tick: keep (or take) the lead; sample; decide and apply once per interval.

        Returns:
            The decisions applied in this tick (empty on most ticks).
        """
        cfg = self.config
        if self.election is not None and not await asyncio.to_thread(self.election.poll):
            self._interval_start = None          # a new leader starts a fresh interval
            return []
        now = self.clock()
        sizes = self.controller.pool_sizes()
        ages = self.controller.worker_ages()
        obs = await asyncio.to_thread(self.reader.read)
        loads = await asyncio.to_thread(self.reader.worker_loads, list(ages))
        if self._interval_start is None:        # first tick as leader: discard the backlog
            self._interval_start, self._loads, self._obs = now, [], Observations([], [])
            await asyncio.to_thread(self._restore_cooldowns, now)
            return []
        self._loads.append(loads)
        self._obs.arrivals += obs.arrivals
        self._obs.finished += obs.finished
        if now - self._interval_start < cfg.interval_s:
            return []
        warm = {wid for wid, age in ages.items() if age >= cfg.warmup_s}
        roles = {wid: load.role for sample in self._loads for wid, load in sample.items()}
        stats = aggregate(now - self._interval_start, self._obs, self._loads, roles, warm)
        self._interval_start, self._loads, self._obs = now, [], Observations([], [])
        decisions = self.decide(stats, sizes, now)
        for d in decisions:
            log = logger.info if d.target != d.current else logger.debug
            log("planner: %s %d -> %d (%s: %s)", d.pool, d.current, d.target, d.rule, d.reason)
            if d.target != d.current:
                await self.controller.scale(d.pool, d.target)
        self.intervals = (self.intervals + [(now, stats, decisions)])[-1000:]
        if self.on_interval is not None:
            self.on_interval(sizes, decisions)
        await asyncio.to_thread(self._record, stats, decisions, now)
        return decisions

    def _record(self, stats: IntervalStats, decisions: list[PoolDecision], now: float) -> None:
        """Keep the last decisions in the cluster state (``{ns}:planner:decisions``),
        with the seconds since each pool's last change (what the cooldowns count
        from), for the next leader."""
        state = self.reader.state
        ages = {p: now - t for p, t in self._last_change.items() if math.isfinite(t)}
        try:
            state.redis.xadd(state.key("planner", "decisions"),
                             {"stats": json.dumps(asdict(stats)),
                              "decisions": json.dumps([asdict(d) for d in decisions]),
                              "last_change_age_s": json.dumps(ages)},
                             maxlen=1000, approximate=True)
        except Exception as exc:
            logger.debug("recording planner decisions failed: %s", exc)

    def _restore_cooldowns(self, now: float) -> None:
        """On taking the lead: each pool's last change as the previous leader last
        recorded it (the newest ``{ns}:planner:decisions`` entry; its id is on the
        Redis clock, so no two hosts' clocks are compared), so a fail-over neither
        skips a cooldown (adding a worker right after the old leader did) nor
        forgets one. Without a record (Redis down, a first leader) nothing changes."""
        state = self.reader.state
        try:
            secs, micros = state.redis.time()
            newest = state.redis.xrevrange(state.key("planner", "decisions"), count=1)
        except Exception as exc:
            logger.debug("reading the last planner decisions failed: %s", exc)
            return
        if not newest or "last_change_age_s" not in newest[0][1]:
            return
        entry_id, fields = newest[0]
        since_entry = max(0.0, secs + micros / 1e6 - int(entry_id.split("-")[0]) / 1000)
        for pool, age in json.loads(fields["last_change_age_s"]).items():
            if pool in POOLS:
                t = now - since_entry - float(age)
                self._last_change[pool] = max(self._last_change.get(pool, -math.inf), t)

    def start(self) -> None:
        """Run :meth:`step` every ``sample_interval_s`` on the running loop until :meth:`stop`."""
        async def run() -> None:
            while True:
                try:
                    await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:      # Redis down, a failed scale: try next tick
                    logger.warning("planner step failed: %s", exc)
                await asyncio.sleep(self.config.sample_interval_s)
        self._task = asyncio.ensure_future(run())

    async def stop(self) -> None:
        """Stop the loop and give the lead up."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.election is not None:
            await asyncio.to_thread(self.election.resign)


__all__ = ["PlannerConfig", "PoolSize", "PoolController", "IntervalStats", "PoolDecision",
           "Planner", "aggregate", "slo_target", "load_target", "percentile", "POOLS",
           "PLANNER_MODES"]
