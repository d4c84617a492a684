"""How long a killed worker takes to be back in service, and where the time goes.

Starts the default deployment in this process (1 prefill + 1 decode Ray actor,
embedded Redis, supervision on; float32, 640 KV blocks as the fault tests use),
then ``kill -9``s one worker ``--rounds`` times and times, from the kill:
the registry seeing it down, the new actor's first answer (``info``: Ray starting
the process, imports, the engine build), the KV channels wired, the replacement
in service. The phases are read by wrapping the server's own methods in this
script (no instrumentation in the server). Then it builds the engine in this
process, cold imports aside, to show the engine's share.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/worker_restart.py --role decode --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peers import isa_flags  # noqa: E402
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def measure_restarts(role: str, rounds: int) -> list[dict]:
    from tandem.router.launcher import init_ray
    from tests.serving.conftest import Client, serve_config, start_server

    init_ray()
    bg = start_server(serve_config("disaggregated", transfer_timeout_s=8.0))
    client, srv = Client(bg), bg.server
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.monotonic())

    start_worker, wire_kv = srv._start_worker, srv._wire_kv

    async def timed_start(worker_id):
        mark("spawn")
        handle = await start_worker(worker_id)
        mark("first_answer")
        return handle

    async def timed_wire(prefill, decode):
        result = await wire_kv(prefill, decode)
        mark("kv_wired")
        return result

    srv._start_worker, srv._wire_kv = timed_start, timed_wire
    srv.registry.add_worker_down_listener(lambda worker_id: mark("seen_down"))
    out = []
    try:
        for r in range(rounds):
            marks.clear()
            wid = f"{role}-0"
            victim = next(w for w in client.workers() if w.worker_id == wid)
            t0 = time.monotonic()
            os.kill(victim.info["pid"], signal.SIGKILL)
            while True:
                w = next(w for w in client.workers() if w.worker_id == wid)
                done = [rec for rec in srv.supervisor.recoveries if rec.worker_id == wid]
                if w.alive and w.generation > victim.generation and len(done) > r:
                    break
                time.sleep(0.02)
            row = {"round": r, "in_service_s": round(time.monotonic() - t0, 3),
                   **{k: round(v - t0, 3) for k, v in marks.items()}}
            print(json.dumps(row), flush=True)
            out.append(row)
            time.sleep(1.0)
    finally:
        client.close()
        bg.stop()
    return out


def measure_engine_build() -> dict:
    """The engine build alone, in this process (torch and Tandem already imported)."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.runtime.llm_engine import LLMEngine

    t = time.perf_counter()
    LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=640)),
              kv_transport="gloo", enable_kv_events=True)
    return {"engine_build_s": round(time.perf_counter() - t, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()
    result = {"role": args.role, "cpu_flags": isa_flags(),
              "restarts": measure_restarts(args.role, args.rounds), **measure_engine_build()}
    print(json.dumps({k: v for k, v in result.items() if k != "restarts"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
