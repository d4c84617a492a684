"""Autoscaling prefill and decode pools on Ray's fake multi-node autoscaler.

A Ray head is started with the fake multi-node node provider (``RAY_FAKE_CLUSTER=1``)
and two worker node types, ``prefill`` and ``decode``, each node advertising one
unit of its custom resource. ``tandem serve``'s server runs on it; a worker actor
asks for one unit of its pool's resource, so the Ray autoscaler adds a node when
the planner adds a worker and removes the idle node when the planner retires one.
Every node is a raylet on this machine: the scaling is real, the extra hardware
is not (all workers share this machine's cores).

The load comes in phases (clients in closed loop, each request of fresh random
token ids so that no prefix cache makes prompts free):

    prompt_heavy   long prompts, one output token
    answer_heavy   short prompts, long answers (ignore_eos)
    steady         the same answer-heavy load, held (no pool may change)
    light          one client (pools shrink to their minimum while it runs)

``--scenario test`` runs each phase until its pool condition holds (bounded), and
writes the pool timeline, the planner's events and every request's outcome to
``--out``; tests/cluster/test_autoscaling.py asserts on it. ``--scenario goodput``
runs a load that shifts from prompt-heavy to answer-heavy for fixed durations,
once with the planner and once per fixed split of the same number of workers, and
reports goodput: requests per second that met both the TTFT and the ITL SLO.

    python benchmarks/autoscaling.py --scenario goodput --out benchmarks/results/autoscaling_goodput_run2.json

The script runs in a process session of its own (it re-executes itself in a new
one when it is not a session leader) and kills what it started by session when
done, since the fake nodes are daemons of the Ray head.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

VOCAB_LOW, VOCAB_HIGH = 1000, 40000       # ordinary tokens of the default model's vocabulary


@dataclass(frozen=True)
class Phase:
    """One load phase: ``clients`` closed-loop clients sending ``prompt_tokens``
    random prompt tokens for ``max_tokens`` output tokens. The phase lasts at
    least ``min_s`` and at most ``max_s`` seconds, and ends early (after
    ``min_s``) once ``until`` holds: comma-separated ``POOL>=N`` / ``POOL<=N``
    on ready workers with nothing pending or draining in that pool, ``"min"``
    (both pools at their minimum, settled) or ``""`` (never)."""

    name: str
    clients: int
    prompt_tokens: int
    max_tokens: int
    min_s: float
    max_s: float
    until: str = ""


TEST_PHASES = (
    Phase("prompt_heavy", clients=4, prompt_tokens=200, max_tokens=1, min_s=6, max_s=120,
          until="prefill>=2"),
    Phase("answer_heavy", clients=12, prompt_tokens=16, max_tokens=48, min_s=6, max_s=120,
          until="decode>=2,prefill<=1"),
    Phase("steady", clients=12, prompt_tokens=16, max_tokens=48, min_s=8, max_s=8),
    Phase("light", clients=1, prompt_tokens=16, max_tokens=48, min_s=2, max_s=90, until="min"),
)

GOODPUT_PHASES = (
    Phase("prompt_heavy", clients=4, prompt_tokens=200, max_tokens=2, min_s=60, max_s=60),
    Phase("answer_heavy", clients=12, prompt_tokens=16, max_tokens=48, min_s=60, max_s=60),
)


def planner_config(max_total: int | None = None, **kw):
    """The planner of the scenarios: load mode, a 2 s interval, short cooldowns."""
    from tandem.control.planner import PlannerConfig

    return PlannerConfig(**{**dict(
        mode="load", interval_s=2.0, sample_interval_s=0.5, min_prefill=1, max_prefill=2,
        min_decode=1, max_decode=2, prefill_queue_high=300, decode_kv_high=0.6,
        decode_waiting_high=1.0, headroom=0.7, scale_up_cooldown_s=2.0,
        scale_down_cooldown_s=3.0, scale_down_intervals=2, warmup_s=2.0, leader_ttl_s=5.0,
        max_total_workers=max_total), **kw})


# Held loads: a wider hysteresis band and a longer wait before giving a worker back
# than the test scenario's, which ends each phase as soon as the pools have moved.
GOODPUT_PLANNER = dict(headroom=0.5, scale_down_intervals=3, scale_down_cooldown_s=10.0)


def engine_configs():
    """(decode, prefill) engine configs: a prefill worker runs at most 256 prompt
    tokens a step (so a prompt-heavy load queues on it), a decode worker at most 4
    sequences (so an answer-heavy load waits on it)."""
    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    decode = EngineConfig(dtype="bfloat16", cache=CacheConfig(num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    prefill = EngineConfig(dtype="bfloat16", cache=CacheConfig(num_blocks=256),
                           scheduler=SchedulerConfig(max_num_batched_tokens=256))
    return decode, prefill


# -- the fake cluster -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


HEAD_RESOURCES = {"prefill": 1, "decode": 1}
"""The head node runs the first prefill and decode worker (the pools' minimum), so
only workers beyond it wait for a node."""


def fake_cluster_config(gcs_address: str, max_per_type: int, idle_timeout_s: float) -> dict:
    """An autoscaling config for the fake multi-node provider: a head with one unit
    of each pool's resource and one node type per pool."""
    def node_type(role: str) -> dict:
        return {"resources": {"CPU": 1, role: 1, "object_store_memory": 80 * 1024 * 1024},
                "node_config": {}, "min_workers": 0, "max_workers": max_per_type}
    empty: list = []
    return {"cluster_name": "tandem-fake", "max_workers": 2 * max_per_type,
            "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60.0,
            # No node updaters (nothing to set up over SSH: a fake node is a raylet here).
            "provider": {"type": "fake_multinode", "gcs_address": gcs_address,
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "auth": {}, "docker": {},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": 2, **HEAD_RESOURCES},
                                     "node_config": {}, "max_workers": 0},
                "prefill": node_type("prefill"), "decode": node_type("decode")},
            "head_node_type": "ray.head.default", "file_mounts": {},
            "cluster_synced_files": empty, "file_mounts_sync_continuously": False,
            "rsync_exclude": empty, "rsync_filter": empty, "initialization_commands": empty,
            "setup_commands": empty, "head_setup_commands": empty,
            "worker_setup_commands": empty, "head_start_ray_commands": empty,
            "worker_start_ray_commands": empty}


def start_fake_cluster(tmp: str, max_per_type: int = 1, idle_timeout_s: float = 3.0) -> str:
    """Start the Ray head with the fake autoscaler; returns its GCS address."""
    import ray

    ip = ray._private.services.get_node_ip_address()
    address = f"{ip}:{_free_port()}"
    path = os.path.join(tmp, "autoscaling.json")
    with open(path, "w") as f:
        json.dump(fake_cluster_config(address, max_per_type, idle_timeout_s), f)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli, "start", "--head", f"--port={address.rsplit(':', 1)[1]}",
                    f"--autoscaling-config={path}", "--num-cpus=2",
                    f"--resources={json.dumps(HEAD_RESOURCES)}",
                    f"--temp-dir={os.path.join(tmp, 'ray')}", "--include-dashboard=false",
                    "--disable-usage-stats", "--object-store-memory=100000000"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return address


def start_fake_cluster_retrying(tmp: str, attempts: int = 3) -> str:
    """:func:`start_fake_cluster`, again from scratch if the head fails to start (on a
    loaded machine its raylet can time out waiting for its own agents)."""
    for attempt in range(attempts):
        try:
            return start_fake_cluster(os.path.join(tmp, f"try{attempt}") if attempt else tmp)
        except subprocess.CalledProcessError:
            if attempt == attempts - 1:
                raise
            print(f"ray start failed (attempt {attempt + 1}); retrying", flush=True)
            _kill_session()
            os.makedirs(os.path.join(tmp, f"try{attempt + 1}"), exist_ok=True)
    raise AssertionError("unreachable")


def nodes_by_type() -> dict[str, int]:
    """Alive Ray nodes advertising each custom resource."""
    import ray

    out = {"prefill": 0, "decode": 0}
    for n in ray.nodes():
        if n.get("Alive"):
            for role in out:
                if n.get("Resources", {}).get(role):
                    out[role] += 1
    return out


# -- load ------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    phase: str
    start: float
    ttft_s: float | None = None
    itl_s: float | None = None
    num_tokens: int = 0
    ok: bool = False
    error: str = ""


class Load:
    """Closed-loop gRPC clients of the current phase (``set_phase`` switches them)."""

    def __init__(self, address: str, seed: int = 0) -> None:
        import grpc

        from tandem.v1 import tandem_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.TandemStub(self.channel)
        self.records: list[RequestRecord] = []
        self.phase: Phase | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rng = random.Random(seed)

    def set_phase(self, phase: Phase) -> None:
        self.phase = phase
        while len(self._threads) < phase.clients:
            t = threading.Thread(target=self._client, args=(len(self._threads),), daemon=True)
            self._threads.append(t)
            t.start()

    def _client(self, index: int) -> None:
        from tandem.v1 import tandem_pb2 as pb

        while not self._stop.is_set():
            phase = self.phase
            if index >= phase.clients:
                time.sleep(0.05)
                continue
            with self._lock:
                ids = [self._rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(phase.prompt_tokens)]
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stream=True,
                                     sampling=pb.SamplingParams(max_tokens=phase.max_tokens,
                                                                temperature=0.0, ignore_eos=True))
            rec = RequestRecord(phase.name, time.monotonic())
            first = last = None
            try:
                for resp in self.stub.Generate(req, timeout=300):
                    n = len(resp.token_ids)
                    if n:
                        now = time.monotonic()
                        first = first or now
                        last = now
                        rec.num_tokens += n
                rec.ok = rec.num_tokens == phase.max_tokens
                if not rec.ok:
                    rec.error = f"{rec.num_tokens} of {phase.max_tokens} tokens"
            except Exception as exc:     # counted, reported: the test wants none
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            if first is not None:
                rec.ttft_s = first - rec.start
                if rec.num_tokens > 1:
                    rec.itl_s = (last - first) / (rec.num_tokens - 1)
            with self._lock:
                self.records.append(rec)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(310)
        self.channel.close()


# -- one run ---------------------------------------------------------------------------------

def _condition(until: str, sizes: dict, planner_cfg, nodes: dict | None = None) -> bool:
    if not until:
        return False
    if until == "min":      # and Ray has removed the idle nodes
        if nodes is not None and any(nodes[p] > planner_cfg.bounds(p)[0] for p in nodes):
            return False
        until = ",".join(f"{p}<={planner_cfg.bounds(p)[0]}" for p in ("prefill", "decode"))
    for cond in until.split(","):
        op = ">=" if ">=" in cond else "<="
        pool, n = cond.split(op)
        size = sizes[pool]
        if size["pending"] or size["draining"]:
            return False
        if not (size["ready"] >= int(n) if op == ">=" else size["ready"] <= int(n)):
            return False
    return True


def run_phases(address: str, phases, autoscale, num_prefill: int = 1, num_decode: int = 1) -> dict:
    """Start a server on the Ray cluster at ``address``, drive ``phases``, stop it.

    Returns:
        ``{"timeline": [...], "events": [...], "requests": [...], "phases": [...]}``:
        pool sizes and Ray nodes every 0.5 s, the controller's pool events, every
        request's outcome, each phase's start and end (seconds since the start).
    """
    import asyncio

    from tandem.router.launcher import BackgroundServer, ServeConfig

    decode_engine, prefill_engine = engine_configs()
    cfg = ServeConfig(port=0, ray_address=address, num_prefill=num_prefill, num_decode=num_decode,
                      engine=decode_engine, prefill_engine=prefill_engine, autoscale=autoscale,
                      drain_timeout_s=15.0)
    server = BackgroundServer(cfg, start_timeout_s=240)
    t0 = time.monotonic()
    timeline, spans = [], []

    async def sizes() -> dict:
        c = server.server.pool_controller
        if c is not None:
            return {p: asdict(s) for p, s in c.pool_sizes().items()}
        reg = server.server.registry
        return {p: {"ready": len(reg.alive(p)), "pending": 0, "draining": 0}
                for p in ("prefill", "decode")}

    load = Load(server.address)
    try:
        for phase in phases:
            load.set_phase(phase)
            start = time.monotonic()
            while True:
                now = time.monotonic()
                s = server.run(sizes())
                nodes = nodes_by_type()
                timeline.append({"t": now - t0, "phase": phase.name, **{
                    f"{p}_{k}": v for p, d in s.items() for k, v in d.items()},
                    **{f"{p}_nodes": n for p, n in nodes.items()}})
                elapsed = now - start
                if elapsed >= phase.max_s or (elapsed >= phase.min_s
                                              and _condition(phase.until, s, autoscale, nodes)):
                    break
                time.sleep(0.5)
            spans.append({"phase": phase.name, "start": start - t0, "end": time.monotonic() - t0,
                          "condition_met": _condition(phase.until, s, autoscale, nodes)
                          if autoscale else None})
        load.phase = Phase("drain", 0, 1, 1, 0, 0)      # clients finish their request, then idle
        load.stop()
        events, intervals = [], []
        if server.server.pool_controller is not None:
            events = [{**asdict(e), "t": e.t - t0} for e in server.server.pool_controller.events]
            intervals = [{"t": t - t0, "stats": asdict(st), "decisions": [asdict(d) for d in ds]}
                         for t, st, ds in server.server.planner.intervals]
    finally:
        server.stop()
    return {"timeline": timeline, "events": events, "phases": spans, "intervals": intervals,
            "requests": [{**asdict(r), "start": r.start - t0} for r in load.records]}


def goodput(records: list[dict], ttft_slo_s: float, itl_slo_s: float) -> dict:
    """Per phase and in all: requests, requests/s meeting both SLOs, their share."""
    out = {}
    for phase in sorted({r["phase"] for r in records}) + ["all"]:
        rs = [r for r in records if phase in ("all", r["phase"])]
        good = [r for r in rs if r["ok"] and r["ttft_s"] is not None and r["ttft_s"] <= ttft_slo_s
                and (r["itl_s"] is None or r["itl_s"] <= itl_slo_s)]
        span = (max(r["start"] for r in rs) - min(r["start"] for r in rs)) if rs else 0.0
        out[phase] = {"requests": len(rs), "good": len(good), "failed": sum(not r["ok"] for r in rs),
                      "good_share": round(len(good) / len(rs), 3) if rs else None,
                      "goodput_rps": round(len(good) / span, 3) if span else None}
    return out


# -- entry -----------------------------------------------------------------------------------

def _session_pids() -> list[int]:
    sid, me, out = os.getsid(0), os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _kill_session() -> None:
    for _ in range(50):
        pids = _session_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["test", "goodput"], default="goodput")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--ttft-slo", type=float, default=3.0, help="goodput: TTFT SLO, seconds")
    ap.add_argument("--itl-slo", type=float, default=0.25, help="goodput: ITL SLO, seconds")
    ap.add_argument("--total-workers", type=int, default=3,
                    help="goodput: workers in all (planner budget = fixed pools' size)")
    ap.add_argument("--planner-mode", choices=["load", "slo"], default="load",
                    help="goodput: the planner's mode (slo needs both capacities, e.g. "
                         "from `tandem profile` with the workers' engine settings)")
    ap.add_argument("--prefill-capacity", type=float, default=None,
                    help="slo mode: prompt tokens/s one prefill worker serves within --ttft-slo")
    ap.add_argument("--decode-capacity", type=float, default=None,
                    help="slo mode: output tokens/s one decode worker serves within --itl-slo")
    ap.add_argument("--planner-only", action="store_true",
                    help="goodput: skip the fixed pools (their runs do not depend on the planner)")
    args = ap.parse_args(argv)
    if args.planner_mode == "slo" and None in (args.prefill_capacity, args.decode_capacity):
        ap.error("--planner-mode slo: needs --prefill-capacity and --decode-capacity")
    if os.getsid(0) != os.getpid():        # not a session leader: run in a session of our own
        return subprocess.run([sys.executable, *sys.argv], start_new_session=True).returncode
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = tempfile.mkdtemp(prefix="tdm-as-", dir="/tmp")
    try:
        import ray

        address = start_fake_cluster_retrying(tmp)
        ray.init(address=address, namespace="tandem", log_to_driver=False)
        if args.scenario == "test":
            result = run_phases(address, TEST_PHASES, planner_config())
        else:
            result = {"command": "python benchmarks/autoscaling.py " + " ".join(argv or sys.argv[1:]),
                      "ttft_slo_s": args.ttft_slo, "itl_slo_s": args.itl_slo, "runs": {}}
            n = args.total_workers
            splits = [("planner", None)] + [(f"fixed_{p}p{n - p}d", p) for p in range(1, n)]
            if args.planner_only:
                splits = splits[:1]
            mode = dict(mode=args.planner_mode)
            if args.planner_mode == "slo":
                mode.update(ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo,
                            prefill_capacity_tok_s=args.prefill_capacity,
                            decode_capacity_tok_s=args.decode_capacity)
            for name, num_prefill in splits:
                if num_prefill is None:
                    run = run_phases(address, GOODPUT_PHASES,
                                     planner_config(max_total=n, **GOODPUT_PLANNER, **mode))
                else:
                    run = run_phases(address, GOODPUT_PHASES, None, num_prefill, n - num_prefill)
                result["runs"][name] = {"goodput": goodput(run["requests"], args.ttft_slo,
                                                           args.itl_slo),
                                        "events": run["events"], "phases": run["phases"]}
                print(name, json.dumps(result["runs"][name]["goodput"]["all"]), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    finally:
        try:
            import ray

            ray.shutdown()
        finally:
            _kill_session()
    return 0


if __name__ == "__main__":
    sys.exit(main())
