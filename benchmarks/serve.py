"""Serving benchmark: latency and throughput of a running Tandem server under load.

Like vLLM's ``benchmark_serving.py`` and SGLang's ``bench_serving``: a grpc.aio client
sends one streaming ``Generate`` call per request (prompt as ``token_ids`` so its
length is exact, ``ignore_eos`` so the output length is exact, greedy unless
``--temperature``) on a seeded arrival schedule, and times every streamed message.

Targets: ``--endpoint host:port`` measures a server that is already running;
``--launch disaggregated,colocated`` starts ``tandem serve`` once per mode, one after
the other, runs the same workloads and rates against each, and puts all modes in one
table, JSON file and plot.

Workloads (``--workload``):

* ``random``: prompt and output lengths uniform in ``--prompt-len`` / ``--output-len``.
* ``shared-prefix``: a system prefix of ``--prefix-len`` tokens, then a distinct
  suffix (``--suffix-len``); exercises prefix caching. One prefix shared by every
  request, or ``--num-prefixes`` K distinct ones that the requests take in turns
  (each round of K a seeded shuffle).
* ``prefill-heavy``: ``--num-long-gen`` long generations (short prompt, long output)
  are sent first; once each has its first token, ``--num-prompts`` long prompts with
  short outputs arrive at the request rate. The long generations' ITL (reported as
  group ``long-gen``) is where disaggregation differs from colocation: a colocated
  worker stalls its decode batch to prefill the long prompts.

Metrics, per request (seconds): TTFT, time from sending to the first message that
carries tokens; ITL, the gap between consecutive token-bearing messages; TPOT,
``(e2e - ttft) / (output_tokens - 1)``; e2e, sending to the end of the stream.
A message carrying k > 1 tokens contributes ONE ITL sample (its gap, which covers
all k tokens), as vLLM's benchmark does: that gap is the stall a reader sees, and
splitting it into k equal gaps would invent arrivals that never happened. The k
tokens still count in output tokens, so TPOT stays a per-token average.
Percentiles are numpy's linear interpolation over all samples of all successful
requests. Goodput is successful requests/s whose TTFT <= ``--slo-ttft`` and TPOT <=
``--slo-tpot`` (a 1-token output has no TPOT and meets that SLO).

Usage::

    python benchmarks/serve.py --endpoint 127.0.0.1:PORT --workload random \\
        --num-prompts 32 --request-rate 2,inf
    python benchmarks/serve.py --launch disaggregated,colocated --cpu-affinity \\
        --workload prefill-heavy --num-prompts 8 --request-rate 0.5,1 \\
        --slo-ttft 2 --slo-tpot 0.2 --out result.json --plot result.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from tandem.v1 import tandem_pb2, tandem_pb2_grpc

# Prompt ids come from the ordinary vocabulary: the first 100 ids of SmolLM2's
# 49152-token vocabulary are special/control tokens.
VOCAB_LO, VOCAB_HI = 100, 49152
MODES = ("disaggregated", "colocated")


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: exact prompt ids, ``output_len`` tokens to generate, and
    the group it is reported under (``random``, ``shared-prefix``, ``long-gen``,
    ``long-prompt``)."""

    prompt_ids: tuple[int, ...]
    output_len: int
    group: str


@dataclass(frozen=True)
class Workload:
    """``leading`` requests are all sent at time 0 and the ``paced`` ones follow the
    arrival schedule, which starts once every leading request has its first token."""

    leading: tuple[RequestSpec, ...]
    paced: tuple[RequestSpec, ...]

    @property
    def requests(self) -> tuple[RequestSpec, ...]:
        return self.leading + self.paced


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` token ids uniform in [VOCAB_LO, VOCAB_HI)."""
    return tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n))


def random_workload(num_prompts: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int) -> Workload:
    """Prompt and output lengths (tokens) uniform in the inclusive ranges given."""
    rng = random.Random(seed)
    paced = []
    for _ in range(num_prompts):
        n_in, n_out = rng.randint(*prompt_len), rng.randint(*output_len)
        paced.append(RequestSpec(random_ids(rng, n_in), n_out, "random"))
    return Workload((), tuple(paced))


def shared_prefix_workload(num_prompts: int, prefix_len: int, suffix_len: tuple[int, int],
                           output_len: tuple[int, int], seed: int, num_prefixes: int = 1) -> Workload:
    """``num_prefixes`` distinct ``prefix_len``-token prefixes; each request is one of
    them followed by a distinct random suffix whose length (tokens) is uniform in
    ``suffix_len``.

    Requests go through the prefixes in rounds, each round a seeded shuffle of all
    ``num_prefixes``: every prefix is used (when ``num_prompts >= num_prefixes``) and
    equally often to within one, with no fixed order a router could line up with.
    ``num_prefixes`` 1 draws the same prompts as before the parameter existed.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefixes: dict[tuple[int, ...], None] = {}   # insertion-ordered set
    for _ in range(10 * num_prefixes + 100):
        if len(prefixes) == num_prefixes:
            break
        prefixes.setdefault(random_ids(rng, prefix_len))
    if len(prefixes) < num_prefixes:
        raise ValueError(f"cannot draw {num_prefixes} distinct prefixes of {prefix_len} tokens")
    prefix_list = list(prefixes)
    order: list[int] = []
    paced, seen = [], set()
    # Repeats are only likely for 1-token suffixes; the bound stops a request for
    # more distinct suffixes than exist.
    for _ in range(10 * num_prompts + 100):
        if len(paced) == num_prompts:
            break
        if not order:
            order = list(range(num_prefixes))
            if num_prefixes > 1:
                rng.shuffle(order)
        suffix = random_ids(rng, rng.randint(*suffix_len))
        if suffix not in seen:
            seen.add(suffix)
            paced.append(RequestSpec(prefix_list[order.pop()] + suffix, rng.randint(*output_len),
                                     "shared-prefix"))
    if len(paced) < num_prompts:
        raise ValueError(f"cannot draw {num_prompts} distinct suffixes of {suffix_len} tokens")
    return Workload((), tuple(paced))


def prefill_heavy_workload(num_long_gen: int, long_gen_prompt_len: int, long_gen_output_len: int,
                           num_prompts: int, long_prompt_len: tuple[int, int],
                           long_prompt_output_len: int, seed: int) -> Workload:
    """``num_long_gen`` leading requests (short prompt, long output) and
    ``num_prompts`` paced long prompts (length uniform in ``long_prompt_len``) with
    short outputs. All lengths in tokens."""
    rng = random.Random(seed)
    leading = tuple(RequestSpec(random_ids(rng, long_gen_prompt_len), long_gen_output_len, "long-gen")
                    for _ in range(num_long_gen))
    paced = tuple(RequestSpec(random_ids(rng, rng.randint(*long_prompt_len)), long_prompt_output_len,
                              "long-prompt")
                  for _ in range(num_prompts))
    return Workload(leading, paced)


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``num`` requests; the first is at 0.

    Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and mean
    ``1 / rate`` (rate in req/s), so their variance is ``1 / (burstiness * rate**2)``:
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. ``rate`` inf
    sends everything at once.
    """
    if num <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=num - 1)
    return [0.0] + np.cumsum(gaps).tolist()


# --------------------------------------------------------------------------- metrics


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are ``time.perf_counter()`` seconds;
    ``chunk_times[i]`` is when the i-th token-bearing message arrived and
    ``chunk_tokens[i]`` how many tokens it carried; ``cached_tokens`` is the final
    message's ``usage.cached_tokens`` (prompt tokens the prefix cache served)."""

    group: str
    prompt_len: int
    output_len: int          # requested (max_tokens)
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    success: bool = False
    error: str = ""
    cached_tokens: int = 0


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request latencies in seconds; ``tpot`` is None for a 1-token output."""

    ttft: float
    tpot: float | None
    e2e: float
    itls: tuple[float, ...]
    output_tokens: int


def request_metrics(r: RequestRecord) -> RequestMetrics:
    """Latencies of a successful request (see the module docstring for definitions)."""
    if not r.chunk_times:
        raise ValueError("request has no token-bearing message")
    ttft, e2e = r.chunk_times[0] - r.start, r.end - r.start
    n_out = sum(r.chunk_tokens)
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    itls = tuple(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    return RequestMetrics(ttft, tpot, e2e, itls, n_out)


def distribution(values) -> dict[str, float | None]:
    """Mean, p50, p90, p99 of ``values`` (numpy linear interpolation); None when empty."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: list[RequestRecord], slo_ttft: float | None = None, slo_tpot: float | None = None,
              duration: float | None = None) -> dict:
    """Aggregate metrics of one run.

    ``duration`` (seconds) defaults to first send -> last end over ``records``;
    throughputs are per that duration (req/s, tokens/s). Goodput (req/s) counts
    successful requests meeting every SLO given (seconds); None when none is given.
    Input tokens count successful requests only, like output tokens.
    """
    if duration is None:
        duration = max(r.end for r in records) - min(r.start for r in records) if records else 0.0
    ok = [r for r in records if r.success]
    metrics = [request_metrics(r) for r in ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(m.output_tokens for m in metrics)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    goodput = None
    if slo_ttft is not None or slo_tpot is not None:
        good = sum(1 for m in metrics
                   if (slo_ttft is None or m.ttft <= slo_ttft)
                   and (slo_tpot is None or m.tpot is None or m.tpot <= slo_tpot))
        goodput = per_s(good)
    return {
        "num_requests": len(records), "num_completed": len(ok), "num_failed": len(records) - len(ok),
        # ignore_eos makes every output exactly as long as asked; anything else is a server bug.
        "num_wrong_length": sum(1 for r, m in zip(ok, metrics) if m.output_tokens != r.output_len),
        "errors": sorted({r.error for r in records if not r.success}),
        "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out), "goodput": goodput,
        "ttft_s": distribution(m.ttft for m in metrics),
        "tpot_s": distribution(m.tpot for m in metrics if m.tpot is not None),
        "itl_s": distribution(x for m in metrics for x in m.itls),
        "e2e_s": distribution(m.e2e for m in metrics),
    }


def summarize_groups(records: list[RequestRecord], slo_ttft: float | None,
                     slo_tpot: float | None) -> dict[str, dict]:
    """``summarize`` per request group, over the whole run's duration; empty when the
    run has a single group."""
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return {}
    duration = max(r.end for r in records) - min(r.start for r in records)
    return {g: summarize([r for r in records if r.group == g], slo_ttft, slo_tpot, duration)
            for g in groups}


# --------------------------------------------------------------------------- client


async def send_request(stub, spec: RequestSpec, request_id: str, temperature: float, timeout_s: float,
                       on_first_token=None) -> RequestRecord:
    """Streams one ``Generate`` call and records when its tokens arrived.

    Fails (``success`` False, ``error`` set) on an RPC error, a finish reason other
    than STOP/LENGTH, or a stream that ends without tokens; never raises for those.
    """
    sampling = tandem_pb2.SamplingParams(max_tokens=spec.output_len, temperature=temperature,
                                         ignore_eos=True)
    req = tandem_pb2.GenerateRequest(request_id=request_id, token_ids=tandem_pb2.TokenIds(ids=spec.prompt_ids),
                                     sampling=sampling, stream=True)
    rec = RequestRecord(spec.group, len(spec.prompt_ids), spec.output_len, start=time.perf_counter())
    finish = tandem_pb2.FINISH_REASON_UNSPECIFIED
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            now = time.perf_counter()
            if msg.token_ids:
                if not rec.chunk_times and on_first_token is not None:
                    on_first_token()
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(msg.token_ids))
            if msg.finish_reason != tandem_pb2.FINISH_REASON_UNSPECIFIED:
                finish = msg.finish_reason
            if msg.HasField("usage"):
                rec.cached_tokens = msg.usage.cached_tokens
        rec.end = time.perf_counter()
        if finish not in (tandem_pb2.FINISH_REASON_STOP, tandem_pb2.FINISH_REASON_LENGTH):
            rec.error = f"finish_reason {tandem_pb2.FinishReason.Name(finish)}"
        elif not rec.chunk_times:
            rec.error = "no tokens"
        else:
            rec.success = True
    except grpc.aio.AioRpcError as exc:
        rec.end = time.perf_counter()
        rec.error = f"{exc.code().name}: {exc.details()}"
    return rec


async def run_load(endpoint: str, workload: Workload, rate: float, burstiness: float, seed: int,
                   max_concurrency: int | None = None, temperature: float = 0.0,
                   timeout_s: float = 600.0, tag: str = "run") -> list[RequestRecord]:
    """Sends ``workload`` to ``endpoint`` and returns one record per request, in
    workload order. ``max_concurrency`` caps requests in flight (a request waiting
    for a slot is timed from when it is actually sent, as in vLLM)."""
    offsets = arrival_offsets(len(workload.paced), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    pending_leaders = len(workload.leading)
    leaders_started = asyncio.Event()
    if pending_leaders == 0:
        leaders_started.set()

    def leader_started() -> None:
        nonlocal pending_leaders
        pending_leaders -= 1
        if pending_leaders == 0:
            leaders_started.set()

    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)

        async def one(i: int, spec: RequestSpec, leader: bool) -> RequestRecord:
            async with sem:
                rec = await send_request(stub, spec, f"{tag}-{i}", temperature, timeout_s,
                                         leader_started if leader else None)
            if leader and not rec.chunk_times:   # failed before its first token: do not block the rest
                leader_started()
            return rec

        tasks = [asyncio.create_task(one(i, s, True)) for i, s in enumerate(workload.leading)]
        await asyncio.wait_for(leaders_started.wait(), timeout_s)
        t0 = time.perf_counter()
        for j, (spec, offset) in enumerate(zip(workload.paced, offsets)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(len(workload.leading) + j, spec, False)))
        return list(await asyncio.gather(*tasks))


async def model_info(endpoint: str, timeout_s: float = 30.0):
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await tandem_pb2_grpc.TandemStub(channel).GetModelInfo(tandem_pb2.GetModelInfoRequest(),
                                                                       timeout=timeout_s)


# --------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it). For ports
    only the caller's own process binds next (metrics, HTTP); a ``tandem serve`` gRPC
    port is better left to the server (``--port 0``), see ServerProcess."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...,
    starttime at index 19); None for a process that is gone or a zombie, which
    holds no resources but still answers kill(pid, 0)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


def _all_procs() -> dict[int, list[str]]:
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _proc_stat(int(d.name))) is not None:
            procs[int(d.name)] = st
    return procs


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time (clock ticks) of every live descendant of ``root``; the start
    time tells a survivor from an unrelated process that later reused its pid."""
    procs = _all_procs()
    found, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, st in procs.items():
            if int(st[1]) == p and child not in found:
                found[child] = st[19]
                frontier.append(child)
    return found


def _group_alive(pgid: int) -> bool:
    return any(int(st[2]) == pgid for st in _all_procs().values())


class ServerProcess:
    """``tandem serve --mode MODE`` on 127.0.0.1 and a free port, in its own process
    group, with output in ``log_path``. Use as a context manager: entering waits
    until the gRPC health service reports SERVING; leaving stops the whole group
    (SIGINT; SIGTERM after ``grace_s`` seconds; SIGKILL ``term_s`` seconds later)
    and any descendant that left the group."""

    def __init__(self, mode: str, log_path: Path, tandem_bin: str, dtype: str = "bfloat16",
                 cpu_affinity: bool = False, serve_args: tuple[str, ...] = (),
                 ready_timeout_s: float = 180.0, grace_s: float = 20.0, term_s: float = 10.0):
        self.mode, self.log_path, self.ready_timeout_s = mode, log_path, ready_timeout_s
        self.grace_s, self.term_s = grace_s, term_s
        # Port 0: the server binds a free port itself and prints it in its banner. A
        # port picked here and passed on could be taken meanwhile by one of the Ray
        # processes the server starts first (they bind ports of their own).
        self.endpoint: str | None = None
        self.cmd = [tandem_bin, "serve", "--mode", mode, "--host", "127.0.0.1", "--port", "0",
                    "--num-prefill", "1", "--num-decode", "1", "--dtype", dtype, "--http-port", "-1",
                    *(["--cpu-affinity"] if cpu_affinity else []), *serve_args]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> None:
        # A session of its own makes the server the leader of a fresh process group,
        # which Ray's daemons and actors join, so one killpg reaches all of them.
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self.ready_timeout_s
        while self.endpoint is None:
            found = re.search(rb"tandem: serving (?:\w+ )?on (\S+:\d+)[ (]", self.log_path.read_bytes()
                              if self.log_path.exists() else b"")
            if found:
                self.endpoint = found.group(1).decode()
            elif self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode} before serving; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"tandem serve printed no address after {self.ready_timeout_s:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            else:
                time.sleep(0.5)
        with grpc.insecure_channel(self.endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tandem serve exited with {self.proc.returncode} before serving; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass   # not listening yet
                time.sleep(1.0)
        raise TimeoutError(f"tandem serve not SERVING after {self.ready_timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, num_bytes: int = 3000) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        # Ray's daemons block SIGINT and the server's shutdown is what stops them, so
        # SIGINT goes first; SIGTERM/SIGKILL then reach whatever is left in the group.
        family = _descendants(pid)
        for sig, wait_s in ((signal.SIGINT, self.grace_s), (signal.SIGTERM, self.term_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                # poll() reaps the leader; the group outlives it until its last member exits.
                if self.proc.poll() is not None and not _group_alive(pid):
                    break
                time.sleep(0.1)
            else:
                continue
            break
        # Anything that moved to its own session escaped killpg; end it by pid.
        family.update(_descendants(pid))

        def survivors() -> list[int]:
            return [p for p, started in family.items() if (st := _proc_stat(p)) is not None and st[19] == started]

        for child in survivors():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 5.0   # SIGKILL lands asynchronously
        while survivors() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc = None


def default_tandem_bin() -> str:
    here = Path(sys.executable).parent / "tandem"
    return str(here) if here.exists() else (shutil.which("tandem") or "tandem")


# --------------------------------------------------------------------------- report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_run(run: dict) -> None:
    s = run["summary"]
    print(f"\n==== {run['mode']}  rate {run['request_rate']} req/s  ({run['workload']}) ====")
    print(f"requests ok/total      {s['num_completed']}/{s['num_requests']}   duration {s['duration_s']:.2f} s"
          f"   load avg {run['loadavg_1min_before_after'][0]:.2f} -> {run['loadavg_1min_before_after'][1]:.2f}")
    if s["num_wrong_length"]:
        print(f"WARNING                {s['num_wrong_length']} outputs differ from their max_tokens")
    if s["errors"]:
        print(f"errors                 {s['errors'][:3]}")
    print(f"input / output tokens  {s['total_input_tokens']} / {s['total_output_tokens']}")
    print(f"request throughput     {_num(s['request_throughput'])} req/s   goodput {_num(s['goodput'])} req/s")
    print(f"output / total tok/s   {_num(s['output_throughput'], '.1f')} / "
          f"{_num(s['total_token_throughput'], '.1f')}")
    print(f"{'(ms)':<22} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    rows = [(k.upper(), s[f"{k}_s"]) for k in ("ttft", "tpot", "itl", "e2e")]
    rows += [(f"{g} {k.upper()}", gs[f"{k}_s"]) for g, gs in run["groups"].items() for k in ("ttft", "itl")]
    for name, d in rows:
        print(f"{name:<22} {_ms(d['mean']):>9} {_ms(d['p50']):>9} {_ms(d['p90']):>9} {_ms(d['p99']):>9}")


def comparison_table(runs: list[dict]) -> str:
    """One Markdown row per (mode, rate): the numbers the README records."""
    head = ("| mode | rate (req/s) | ok | req/s | out tok/s | goodput (req/s) | TTFT p50 / p99 (ms) "
            "| TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | long-gen ITL p50 / p99 (ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        s, lg = run["summary"], run["groups"].get("long-gen")
        lg_itl = f"{_ms(lg['itl_s']['p50'])} / {_ms(lg['itl_s']['p99'])}" if lg else "-"
        lines.append(
            f"| {run['mode']} | {run['request_rate']} | {s['num_completed']}/{s['num_requests']} "
            f"| {_num(s['request_throughput'])} | {_num(s['output_throughput'], '.1f')} | {_num(s['goodput'])} "
            f"| {_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} "
            f"| {_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p99'])} "
            f"| {_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p99'])} | {lg_itl} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """Top row: p50 (dark) over p99 (light) bars of TTFT, ITL and the long generations'
    ITL (TPOT when there are none) per rate and mode. Bottom row: CDFs of TTFT, ITL
    and e2e per (mode, rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in runs))
    rates = list(dict.fromkeys(r["request_rate"] for r in runs))
    has_lg = any("long-gen" in r["groups"] for r in runs)
    third = ("long-gen ITL", lambda r: r["groups"].get("long-gen", {}).get("itl_s")) if has_lg \
        else ("TPOT", lambda r: r["summary"]["tpot_s"])
    bars = [("TTFT", lambda r: r["summary"]["ttft_s"]), ("ITL", lambda r: r["summary"]["itl_s"]), third]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    width = 0.8 / len(modes)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, get) in zip(axes[0], bars):
        for mi, mode in enumerate(modes):
            for ri, rate in enumerate(rates):
                d = next((get(r) for r in runs if r["mode"] == mode and r["request_rate"] == rate), None)
                if not d or d["p50"] is None:
                    continue
                x = ri + (mi - (len(modes) - 1) / 2) * width
                c = colors[mi % len(colors)]
                ax.bar(x, d["p99"] * 1e3, width, color=c, alpha=0.35, label=f"{mode} p99" if ri == 0 else None)
                ax.bar(x, d["p50"] * 1e3, width, color=c, label=f"{mode} p50" if ri == 0 else None)
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 / p99")
        ax.legend(fontsize=8)
    cdfs = [("TTFT", "ttft"), ("long-gen ITL" if has_lg else "ITL", "itl"), ("e2e", "e2e")]
    for ax, (name, key) in zip(axes[1], cdfs):
        for run in runs:
            reqs = [q for q in run["requests"] if q["success"] and (key != "itl" or not has_lg
                                                                   or q["group"] == "long-gen")]
            v = np.sort([x for q in reqs for x in (q["itls"] if key == "itl" else [q[key]])]) * 1e3
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post",
                        label=f"{run['mode']} @ {run['request_rate']}")
        if key == "itl":
            ax.set_xscale("log")   # stalls sit orders of magnitude above the median step
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Tandem serving benchmark: {runs[0]['workload']}" if runs else "Tandem serving benchmark")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- driver


def build_workload(args, seed: int) -> Workload:
    if args.workload == "random":
        return random_workload(args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.num_prompts, args.prefix_len, tuple(args.suffix_len),
                                      tuple(args.output_len), seed, args.num_prefixes)
    return prefill_heavy_workload(args.num_long_gen, args.long_gen_prompt_len, args.long_gen_output_len,
                                  args.num_prompts, tuple(args.long_prompt_len), args.long_prompt_output_len,
                                  seed)


def check_fits(workload: Workload, info) -> None:
    """Refuses a workload the server would reject, before timing anything."""
    if info.vocab_size < VOCAB_HI:
        raise SystemExit(f"server vocabulary has {info.vocab_size} ids; prompts use ids up to {VOCAB_HI - 1}")
    longest = max((len(s.prompt_ids) + s.output_len for s in workload.requests), default=0)
    if longest > info.max_model_len:
        raise SystemExit(f"a request needs {longest} tokens of context; server max_model_len is "
                         f"{info.max_model_len}")


def benchmark_endpoint(endpoint: str, mode: str, args) -> list[dict]:
    """Warm-up, then every rate in turn against one server; one result dict per rate."""
    try:
        info = asyncio.run(model_info(endpoint))
    except grpc.aio.AioRpcError as exc:
        raise SystemExit(f"{endpoint}: GetModelInfo failed: {exc.code().name}: {exc.details()}") from None
    # Warm-up prompts come from their own seed so they never seed the prefix cache
    # with a measured prompt; the lengths touch both short and long prefill shapes.
    warm = random_workload(args.num_warmup, (16, 256), (4, 8), seed=args.seed - 1)
    if warm.paced:
        recs = asyncio.run(run_load(endpoint, warm, math.inf, 1.0, 0, None, args.temperature,
                                    args.request_timeout, f"warmup-{mode}"))
        if not all(r.success for r in recs):
            raise SystemExit(f"warm-up failed on {mode}: {sorted({r.error for r in recs})}")
    runs = []
    for ri, rate in enumerate(args.request_rate):
        # The seed depends on the rate's position only, so every mode gets the same
        # prompts and arrival times at a given rate, and no rate reuses another's
        # prompts (which the prefix cache would then serve for free).
        seed = args.seed + ri
        workload = build_workload(args, seed)
        check_fits(workload, info)
        # Other work on the machine skews a CPU run; the load average records it.
        load_before = os.getloadavg()
        records = asyncio.run(run_load(endpoint, workload, rate, args.burstiness, seed, args.max_concurrency,
                                       args.temperature, args.request_timeout, f"{mode}-{rate}"))
        run = {
            "mode": mode, "endpoint": endpoint, "workload": args.workload, "request_rate": rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": seed,
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
            "model": {"name": info.model_name, "dtype": info.dtype, "max_model_len": info.max_model_len,
                      "block_size": info.block_size},
            "summary": summarize(records, args.slo_ttft, args.slo_tpot),
            "groups": summarize_groups(records, args.slo_ttft, args.slo_tpot),
            "requests": [_request_row(r) for r in records],
        }
        print_run(run)
        runs.append(run)
    return runs


def _request_row(r: RequestRecord) -> dict:
    row = {"group": r.group, "prompt_len": r.prompt_len, "output_len": r.output_len, "success": r.success,
           "error": r.error, "cached_tokens": r.cached_tokens}
    if r.success:
        m = request_metrics(r)
        row.update(ttft=m.ttft, tpot=m.tpot, e2e=m.e2e, output_tokens=m.output_tokens, itls=list(m.itls),
                   itl_tokens=r.chunk_tokens[1:])
    return row


def _rate(s: str) -> float:
    r = float(s)
    if not r > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {s}")
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--endpoint", help="host:port of a running Tandem server")
    target.add_argument("--launch", help=f"comma-separated modes to start in turn with `tandem serve`: {MODES}")
    ap.add_argument("--label", default="endpoint", help="mode name reported for --endpoint")

    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix", "prefill-heavy"])
    ap.add_argument("--num-prompts", type=int, default=32,
                    help="paced requests (for prefill-heavy: the long prompts)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                    help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                    help="random, shared-prefix: output tokens")
    ap.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared tokens")
    ap.add_argument("--num-prefixes", type=int, default=1,
                    help="shared-prefix: distinct prefixes the requests take turns on")
    ap.add_argument("--suffix-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                    help="shared-prefix: distinct suffix tokens")
    ap.add_argument("--num-long-gen", type=int, default=2, help="prefill-heavy: long generations sent first")
    ap.add_argument("--long-gen-prompt-len", type=int, default=32)
    ap.add_argument("--long-gen-output-len", type=int, default=256)
    ap.add_argument("--long-prompt-len", type=int, nargs=2, default=[512, 1024], metavar=("MIN", "MAX"))
    ap.add_argument("--long-prompt-output-len", type=int, default=8)

    ap.add_argument("--request-rate", type=lambda s: [_rate(x) for x in s.split(",")], default=[math.inf],
                    help="comma-separated req/s, each run in turn; inf sends all at once (default inf)")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier, >1 more regular")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmup", type=int, default=2, help="untimed requests before the first rate")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, seconds")
    ap.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, seconds")

    ap.add_argument("--tandem-bin", default=default_tandem_bin())
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-affinity", action="store_true", help="pass --cpu-affinity to tandem serve")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra flag for tandem serve (repeatable; use --serve-arg=--flag)")
    ap.add_argument("--server-timeout", type=float, default=180.0, help="seconds to wait for SERVING")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write all runs as JSON here")
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    args = ap.parse_args(argv)
    if args.launch:
        args.modes = [m.strip() for m in args.launch.split(",") if m.strip()]
        bad = [m for m in args.modes if m not in MODES]
        if bad or not args.modes:
            ap.error(f"--launch takes modes from {MODES}, got {args.launch!r}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if args.num_prefixes < 1:
        ap.error("--num-prefixes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[dict] = []
    if args.endpoint:
        runs += benchmark_endpoint(args.endpoint, args.label, args)
    else:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        for mode in args.modes:
            server = ServerProcess(mode, log_dir / f"serve-{mode}.log", args.tandem_bin, args.dtype,
                                   args.cpu_affinity, tuple(args.serve_arg), args.server_timeout)
            print(f"starting: {' '.join(server.cmd)}  (log {server.log_path})", flush=True)
            t = time.perf_counter()
            with server:
                print(f"{mode} serving after {time.perf_counter() - t:.1f} s", flush=True)
                runs += benchmark_endpoint(server.endpoint, mode, args)
    print("\n" + comparison_table(runs))
    if args.out:
        result = {"command": " ".join(sys.argv), "config": vars(args), "machine": platform.machine(),
                  "num_cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs}
        with open(args.out, "w") as f:
            json.dump(_jsonable(result), f, indent=1, allow_nan=False)
    if args.plot:
        plot(runs, args.plot)
    return 0 if all(r["summary"]["num_failed"] == 0 for r in runs) else 1


def _jsonable(x):
    """Strict JSON has no Infinity: an infinite rate is written as the string "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
