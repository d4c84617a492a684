"""Capacity profiling for the planner's ``slo`` mode, after the pre-deployment SLA
profiling of NVIDIA Dynamo's planner: how many prompt tokens per second one
prefill worker serves within a TTFT target, and how many output tokens per
second one decode worker serves within an ITL target, measured with the engine
the workers run, on the machine they run on (``tandem profile``).

* **Prefill.** Bursts of ``c`` prompts of ``isl`` tokens (``max_tokens=1``), for
  ``c = 1, 2, 4, ...``: the burst's TTFT p90 over its requests (from the burst's
  start: queueing included), and its throughput ``c * isl / wall time``.
* **Decode.** ``c`` sequences of ``isl`` prompt tokens, prefilled first, then
  decoding ``osl`` tokens together: the ITL p90 (time between consecutive tokens
  of a sequence) and the throughput (tokens / decode wall time).

A worker's capacity is the highest throughput of a point within its SLO; the sweep
stops at the first point over the SLO (more concurrency only queues longer) or at
``max_concurrency``. The planner then assumes ``capacity`` per worker and corrects
it down by ``slo / observed p90`` when the live latency exceeds the target (see
:mod:`tandem.control.planner`). p90 is the nearest-rank percentile.

Offline and in-process: an :class:`~tandem.engine.runtime.llm_engine.LLMEngine`
stands for the worker (no Ray, no gRPC); on a GPU node, run it there.

**Per worker, that is per group.** An engine of ``tensor_parallel_size`` N (``tandem
profile --tensor-parallel-size N``) is measured whole, all N ranks together, so
its capacities are those of one worker of N devices, which is what the planner
assumes of each worker of a pool of that size. The profile records N, and its
serve flags carry it, so that the capacities are not used for groups of another
size.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field

from tandem.engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProfilePoint:
    """One measured concurrency.

    Attributes:
        concurrency: requests in flight together.
        p90_s: TTFT (prefill) or ITL (decode) p90, seconds.
        tok_s: prompt (prefill) or output (decode) tokens per second.
        meets_slo: ``p90_s <= `` the target.
    """

    concurrency: int
    p90_s: float
    tok_s: float
    meets_slo: bool


@dataclass
class CapacityProfile:
    """The result of :func:`profile_capacity`: capacities in tokens/s per worker,
    None when no point met its SLO (even one request alone is too slow for it).

    Attributes:
        isl, osl: prompt and output lengths of the profiled requests (tokens).
        ttft_slo_s, itl_slo_s: the targets (p90), seconds.
        prefill, decode: the measured points, in sweep order.
        tensor_parallel_size: ranks of the profiled worker; its capacities are the
            whole group's (one worker of that many devices).
    """

    isl: int
    osl: int
    ttft_slo_s: float
    itl_slo_s: float
    prefill: list[ProfilePoint] = field(default_factory=list)
    decode: list[ProfilePoint] = field(default_factory=list)
    tensor_parallel_size: int = 1

    @property
    def prefill_capacity_tok_s(self) -> float | None:
        return _capacity(self.prefill)

    @property
    def decode_capacity_tok_s(self) -> float | None:
        return _capacity(self.decode)

    def serve_flags(self) -> list[str]:
        """The ``tandem serve --autoscale`` flags that use this profile; a profile
        of a sharded worker names its ``--tensor-parallel-size``, since its
        capacities are those of a group of that size."""
        flags = ["--planner-mode", "slo", "--ttft-slo", f"{self.ttft_slo_s:g}",
                 "--itl-slo", f"{self.itl_slo_s:g}"]
        if self.tensor_parallel_size > 1:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.prefill_capacity_tok_s is not None:
            flags += ["--prefill-capacity", f"{self.prefill_capacity_tok_s:.1f}"]
        if self.decode_capacity_tok_s is not None:
            flags += ["--decode-capacity", f"{self.decode_capacity_tok_s:.1f}"]
        return flags

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_capacity_tok_s": self.prefill_capacity_tok_s,
                "decode_capacity_tok_s": self.decode_capacity_tok_s,
                "serve_flags": self.serve_flags()}


def _capacity(points: list[ProfilePoint]) -> float | None:
    good = [p.tok_s for p in points if p.meets_slo]
    return max(good) if good else None


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _prompts(n: int, isl: int, vocab_size: int, gen: random.Random) -> list[list[int]]:
    """``n`` random prompts of ``isl`` ordinary token ids (no shared prefixes)."""
    low, high = min(1000, vocab_size - 1), min(40000, vocab_size)
    return [[gen.randrange(low, high) for _ in range(isl)] for _ in range(n)]


def _prefill_point(engine, c: int, isl: int, slo: float, gen, tag: str) -> ProfilePoint:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params, f"{tag}-{i}")[0]
            for i, p in enumerate(_prompts(c, isl, engine.model_config.vocab_size, gen))]
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            if r.output_token_ids and r.request_id not in ttft:
                ttft[r.request_id] = now - start
    wall = time.perf_counter() - start
    q = p90(list(ttft.values()))
    return ProfilePoint(c, q, c * isl / wall, q <= slo)


def _decode_point(engine, c: int, isl: int, osl: int, slo: float, gen, tag: str) -> ProfilePoint:
    params = SamplingParams(temperature=0.0, max_tokens=osl + 1, ignore_eos=True)
    reqs = [engine.add_request(p, params, f"{tag}-{i}")[0]
            for i, p in enumerate(_prompts(c, isl, engine.model_config.vocab_size, gen))]
    while not all(r.output_token_ids for r in reqs):          # every prompt prefilled
        engine.step()
    start = time.perf_counter()
    last = {r.request_id: (len(r.output_token_ids), start) for r in reqs}
    gaps: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        for r in reqs:
            n, t = last[r.request_id]
            if len(r.output_token_ids) > n:
                new = len(r.output_token_ids) - n
                gaps.extend([(now - t) / new] * new)
                tokens += new
                last[r.request_id] = (len(r.output_token_ids), now)
    wall = time.perf_counter() - start
    q = p90(gaps)
    return ProfilePoint(c, q, tokens / wall if wall > 0 else 0.0, q <= slo)


def profile_capacity(engine, isl: int, osl: int, ttft_slo_s: float, itl_slo_s: float,
                     max_concurrency: int = 64, seed: int = 0,
                     log=None) -> CapacityProfile:
    """Measure one worker's prefill and decode capacity within the SLOs.

    Args:
        engine: an idle :class:`~tandem.engine.runtime.llm_engine.LLMEngine` with the
            workers' configuration (its prefix cache sees only random prompts); a
            sharded one (``tensor_parallel_size`` N) is measured as the one worker
            its N ranks make.
        isl, osl: prompt and output lengths (tokens) of the profiled requests.
        ttft_slo_s, itl_slo_s: the targets (p90), seconds.
        max_concurrency: the sweep's last concurrency (powers of two up to it).
        seed: of the random prompts.
        log: optional ``callable(str)`` told each point as it is measured.

    Returns:
        The :class:`CapacityProfile`.

    Raises:
        ValueError: non-positive lengths, SLOs or concurrency, or an engine with
            requests in flight.
    """
    for name, value in (("isl", isl), ("osl", osl), ("ttft_slo_s", ttft_slo_s),
                        ("itl_slo_s", itl_slo_s), ("max_concurrency", max_concurrency)):
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")
    if engine.has_unfinished_requests():
        raise ValueError("engine: must be idle")
    gen = random.Random(seed)
    prof = CapacityProfile(isl, osl, ttft_slo_s, itl_slo_s,
                           tensor_parallel_size=engine.config.tensor_parallel_size)
    _prefill_point(engine, 1, isl, ttft_slo_s, gen, "profile-warmup")      # first-call costs
    for kind, points in (("prefill", prof.prefill), ("decode", prof.decode)):
        c = 1
        while c <= max_concurrency:
            tag = f"profile-{kind}-{c}"
            if kind == "prefill":
                point = _prefill_point(engine, c, isl, ttft_slo_s, gen, tag)
            else:
                point = _decode_point(engine, c, isl, osl, itl_slo_s, gen, tag)
            points.append(point)
            if log is not None:
                log(f"{kind} c={c}: p90 {point.p90_s * 1e3:.0f} ms, {point.tok_s:.0f} tok/s"
                    f"{'' if point.meets_slo else ' (over the SLO)'}")
            if not point.meets_slo:
                break
            c *= 2
    return prof
