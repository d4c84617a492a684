"""Which prefill/decode placement serves the most goodput: DistServe's question, simulated.

DistServe (Zhong et al. 2024, "DistServe: Disaggregating Prefill and Decoding for
Goodput-optimized Large Language Model Serving", sections 3-4) argues that prefill
and decode want different parallelism, so a disaggregated cluster should pick each
phase's tensor-parallel size (and instance count) separately, for the most requests
per second per device that meet a TTFT and a TPOT SLO (*goodput*). This script asks
that question of the Llama family with a latency model and a discrete-event
simulation of the cluster, and answers it for every placement that fits a device
budget, beside colocated instances of each TP size.

**Latency model** (per step; roofline terms as in DistServe section 3 and the
Megatron split Tandem implements, docs/tensor_parallel.md):

* prefill of ``T`` prompt tokens on ``t`` ranks:
  ``(2 P T + 2 L H sum_i n_i^2) / (t F e_F)`` (``P`` matmul parameters, ``L``
  layers, ``H`` hidden size, ``n_i`` the prompt lengths: causal attention's two
  products, half of each) ``+ 2 L AR(T H b)`` ``+ o``;
* decode step of ``B`` sequences with contexts ``c_i`` on ``t`` ranks:
  ``max((W + K sum_i c_i) / (t M e_M), 2 P B / (t F e_F)) + 2 L AR(B H b) + o``
  (``W`` weight bytes, ``K`` KV bytes per token);
* ``AR(n) = 0`` for ``t = 1``, else ``a + 2 (t - 1) / t * n / X`` (ring all-reduce:
  latency ``a``, link ``X`` bytes/s);
* the KV of a prompt moves from a prefill to a decode instance in ``a + n K / X_kv``.

``F`` (FLOP/s), ``M`` (bytes/s), ``X``, ``X_kv``, ``a``, the efficiencies ``e_F``,
``e_M``, the per-step overhead ``o`` and the memory per device are the device
preset's (:data:`DEVICES`; ``cpu`` takes its peaks from a roofline JSON this
repository measured, ``benchmarks/roofline.py``). What the model leaves out:
kernel efficiency varying with shape, queueing inside a step, preemption, prefix
caching, pipeline parallelism, and the network between nodes (every link is the
device preset's).

**Simulation.** Poisson arrivals (seeded) of requests with fixed input and output
lengths. Disaggregated: ``np`` prefill instances of ``tp`` ranks take queued
prompts first come first served, up to a token budget per batch; each prompt's
first token leaves when its batch ends (TTFT); its KV then moves to the decode
instance with the fewest requests, which runs continuous batching (up to
``--max-batch`` sequences and its KV capacity, ``(t mem - W) / K`` tokens), one
token per sequence per step. Colocated: each instance of ``t`` ranks runs a
waiting prefill batch whenever one is queued (its running sequences stall for it,
no chunking), else a decode step. A request meets the SLO when its TTFT and its
TPOT (``(last - first token) / (O - 1)``, so a disaggregated request's KV
transfer counts in its first gap) both do; a rate is served when at least
``--attainment`` of the requests meet it; *goodput* is the largest such rate
(bisection), per device.

    python benchmarks/placement.py --model llama-2-70b --device a100 --devices 8 \\
        --input-len 512 --output-len 64 --ttft-slo 2.0 --tpot-slo 0.1
    python benchmarks/placement.py --model smollm2-135m --device cpu --devices 4 \\
        --roofline benchmarks/results/roofline_bfloat16.json --ttft-slo 1.0 --tpot-slo 0.1
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Model:
    """What the latency model reads of a model (bfloat16 weights and KV)."""

    name: str
    layers: int
    hidden: int
    matmul_params: float          # parameters in the layers' and LM head's matmuls
    weight_bytes: float
    kv_bytes_per_token: float     # 2 (K and V) x layers x KV heads x head size x 2 bytes
    dtype_bytes: int = 2


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab) -> Model:
    head = hidden // heads
    per_layer = hidden * (hidden + 2 * kv_heads * head) + hidden * hidden + 3 * hidden * ffn
    params = layers * per_layer + vocab * hidden
    return Model(name, layers, hidden, params, 2.0 * (params + vocab * hidden),
                 2 * layers * kv_heads * head * 2)


MODELS = {
    "llama-2-70b": _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    "smollm2-135m": _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152),
}


@dataclass(frozen=True)
class Device:
    """One device's peaks (``flops`` FLOP/s, ``mem_bw`` and ``link_bw`` bytes/s,
    ``mem`` bytes) and the latency model's efficiencies and overheads (seconds)."""

    name: str
    flops: float
    mem_bw: float
    mem: float
    link_bw: float                # all-reduce link between the ranks of an instance
    kv_link_bw: float             # prefill -> decode KV transfer
    link_latency: float
    flops_eff: float = 0.6
    mem_eff: float = 0.8
    step_overhead: float = 2e-3


DEVICES = {
    # A100-SXM 80 GB, bfloat16 dense peak, NVLink 3 (300 GB/s each way).
    "a100": Device("a100", 312e12, 2.0e12, 80e9, 300e9, 300e9, 10e-6),
    # H200 141 GB: Hopper bfloat16 dense peak, NVLink 4 (450 GB/s each way).
    "h200": Device("h200", 989e12, 4.8e12, 141e9, 450e9, 450e9, 10e-6),
}


def cpu_device(roofline: dict) -> Device:
    """A "device" of this repository's CPU measurements (``roofline.py`` JSON): one
    machine like the one measured, with its GEMM and read-bandwidth peaks. Assumed,
    not measured: 20 GB for weights and KV, ranks of an instance linked at 10 GB/s
    with 10 us latency (the shared-memory all-reduce of two ranks on one machine
    measured 10 us, ``engine/parallel/shm_all_reduce.py``), KV moved at 1 GB/s."""
    return Device("cpu", roofline["gemm_peak_gflops"] * 1e9, roofline["stream_read_gbs"] * 1e9,
                  20e9, 10e9, 1e9, 10e-6, flops_eff=0.7, mem_eff=0.55, step_overhead=1e-3)


def all_reduce(nbytes: float, tp: int, d: Device) -> float:
    return 0.0 if tp == 1 else d.link_latency + 2 * (tp - 1) / tp * nbytes / d.link_bw


def prefill_time(m: Model, d: Device, lengths: list[int], tp: int) -> float:
    """Seconds to prefill prompts of ``lengths`` tokens in one batch on ``tp`` ranks."""
    tokens = sum(lengths)
    flops = 2 * m.matmul_params * tokens + 2 * m.layers * m.hidden * sum(n * n for n in lengths)
    comm = 2 * m.layers * all_reduce(tokens * m.hidden * m.dtype_bytes, tp, d)
    return flops / (tp * d.flops * d.flops_eff) + comm + d.step_overhead


def decode_time(m: Model, d: Device, contexts: list[int], tp: int) -> float:
    """Seconds for one decode step of sequences with ``contexts`` tokens on ``tp`` ranks."""
    mem = (m.weight_bytes + m.kv_bytes_per_token * sum(contexts)) / (tp * d.mem_bw * d.mem_eff)
    compute = 2 * m.matmul_params * len(contexts) / (tp * d.flops * d.flops_eff)
    comm = 2 * m.layers * all_reduce(len(contexts) * m.hidden * m.dtype_bytes, tp, d)
    return max(mem, compute) + comm + d.step_overhead


def kv_capacity(m: Model, d: Device, tp: int) -> int:
    """Tokens of KV an instance of ``tp`` ranks holds beside its weights (0: no fit)."""
    return max(0, int((0.9 * tp * d.mem - m.weight_bytes) / m.kv_bytes_per_token))


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    ttft_slo: float
    tpot_slo: float
    num_requests: int = 300
    prefill_budget: int = 4096     # prompt tokens per prefill batch
    max_batch: int = 128           # sequences per decode step
    seed: int = 0


class _Decoder:
    """One decode (or colocated) instance's continuous batching."""

    def __init__(self, m: Model, d: Device, tp: int, w: Workload):
        self.m, self.d, self.tp, self.w = m, d, tp, w
        self.capacity = kv_capacity(m, d, tp)
        self.waiting: list[list] = []           # [request id, ready time]
        self.running: dict[int, int] = {}      # request id -> tokens generated so far
        self.busy_until = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)


def simulate(m: Model, d: Device, w: Workload, rate: float, placement: tuple) -> float:
    """Fraction of ``w.num_requests`` requests arriving at ``rate`` per second that
    meet both SLOs under ``placement``: ``("disagg", tp, np, td, nd)`` or
    ``("colocated", t, n)``."""
    rng = random.Random(w.seed)
    t, arrivals = 0.0, []
    for _ in range(w.num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    n_in, n_out = w.input_len, w.output_len
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    events: list[tuple] = []                    # (time, seq, kind, instance, payload)
    seq = 0

    def push(time, kind, inst, payload=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, seq, kind, inst, payload))

    for i, a in enumerate(arrivals):
        push(a, "arrive", None, i)
    if placement[0] == "disagg":
        _, tp, n_p, td, n_d = placement
        prefill_queue: list[int] = []
        prefill_free = [0.0] * n_p
        decoders = [_Decoder(m, d, td, w) for _ in range(n_d)]
    else:
        _, tp, n_c = placement
        decoders = [_Decoder(m, d, tp, w) for _ in range(n_c)]
        prefill_queues: list[list[int]] = [[] for _ in range(n_c)]

    def take_batch(queue):
        batch, tokens = [], 0
        while queue and (not batch or tokens + n_in <= w.prefill_budget):
            batch.append(queue.pop(0))
            tokens += n_in
        return batch

    def start_decode_step(k, now):
        dec = decoders[k]
        if dec.busy_until > now:
            return
        if placement[0] == "colocated" and prefill_queues[k]:
            batch = take_batch(prefill_queues[k])
            dec.busy_until = now + prefill_time(m, d, [n_in] * len(batch), tp)
            push(dec.busy_until, "prefilled", k, batch)
            return
        used = sum(n_in + g for g in dec.running.values())
        while (dec.waiting and dec.waiting[0][1] <= now and len(dec.running) < w.max_batch
               and used + n_in + n_out <= dec.capacity):
            rid, _ = dec.waiting.pop(0)
            dec.running[rid] = 1
            used += n_in + n_out
        if not dec.running:
            if dec.waiting:
                push(max(now, dec.waiting[0][1]), "wake", k)
            return
        step = decode_time(m, d, [n_in + g for g in dec.running.values()], dec.tp)
        dec.busy_until = now + step
        push(dec.busy_until, "step", k)

    def start_prefills(now):
        for j in range(len(prefill_free)):
            if prefill_free[j] <= now and prefill_queue:
                batch = take_batch(prefill_queue)
                prefill_free[j] = now + prefill_time(m, d, [n_in] * len(batch), tp)
                push(prefill_free[j], "prefilled", j, batch)

    while events:
        now, _, kind, inst, payload = heapq.heappop(events)
        if kind == "arrive":
            if placement[0] == "disagg":
                prefill_queue.append(payload)
                start_prefills(now)
            else:
                k = min(range(len(decoders)),
                        key=lambda j: decoders[j].load + len(prefill_queues[j]))
                prefill_queues[k].append(payload)
                start_decode_step(k, now)
        elif kind == "prefilled":
            for rid in payload:
                first[rid] = now
            if placement[0] == "disagg":
                ready = now + d.link_latency + n_in * m.kv_bytes_per_token / d.kv_link_bw
                for rid in payload:
                    k = min(range(len(decoders)), key=lambda j: decoders[j].load)
                    decoders[k].waiting.append([rid, ready])
                    push(ready, "wake", k)
                start_prefills(now)
            else:
                decoders[inst].waiting.extend([rid, now] for rid in payload)
                decoders[inst].busy_until = now
                start_decode_step(inst, now)
        elif kind == "step":
            dec = decoders[inst]
            for rid in list(dec.running):
                dec.running[rid] += 1
                if dec.running[rid] >= n_out:
                    last[rid] = now
                    del dec.running[rid]
            start_decode_step(inst, now)
        elif kind == "wake":
            start_decode_step(inst, now)
    ok = 0
    for i, a in enumerate(arrivals):
        if i not in last:
            continue
        tpot = (last[i] - first[i]) / max(1, n_out - 1)
        ok += first[i] - a <= w.ttft_slo and tpot <= w.tpot_slo
    return ok / w.num_requests


def goodput(m: Model, d: Device, w: Workload, placement: tuple, attainment: float) -> float:
    """The largest rate (requests/s) at which ``attainment`` of the requests meet the
    SLOs (bisection between 0 and the first rate that fails)."""
    lo, hi = 0.0, 0.5
    while simulate(m, d, w, hi, placement) >= attainment:
        lo, hi = hi, hi * 2
        if hi > 1e5:
            return hi
    for _ in range(14):
        mid = (lo + hi) / 2
        if simulate(m, d, w, mid, placement) >= attainment:
            lo = mid
        else:
            hi = mid
    return lo


def placements(m: Model, d: Device, devices: int) -> list[tuple]:
    """Every placement within ``devices``: disaggregated ``(tp, np, td, nd)`` and
    colocated ``(t, n)``, TP sizes powers of two whose weights (and some KV) fit."""
    sizes = [t for t in (1, 2, 4, 8) if t <= devices and kv_capacity(m, d, t) > 0]
    out = [("colocated", t, devices // t) for t in sizes]
    for tp in sizes:
        for td in sizes:
            for n_p in range(1, devices // tp + 1):
                n_d = (devices - n_p * tp) // td
                if n_d >= 1:
                    out.append(("disagg", tp, n_p, td, n_d))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama-2-70b")
    p.add_argument("--device", choices=sorted(DEVICES) + ["cpu"], default="a100")
    p.add_argument("--roofline", help="roofline.py JSON for --device cpu")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args(argv)
    m = MODELS[args.model]
    if args.device == "cpu":
        if not args.roofline:
            p.error("--device cpu needs --roofline (a benchmarks/roofline.py JSON)")
        d = cpu_device(json.loads(Path(args.roofline).read_text()))
    else:
        d = DEVICES[args.device]
    w = Workload(args.input_len, args.output_len, args.ttft_slo, args.tpot_slo,
                 args.num_requests)
    rows = []
    for pl in placements(m, d, args.devices):
        g = goodput(m, d, w, pl, args.attainment)
        used = pl[1] * pl[2] + (pl[3] * pl[4] if pl[0] == "disagg" else 0)
        rows.append({"placement": pl, "devices": used, "goodput": g,
                     "per_device": g / used})
    rows.sort(key=lambda r: -r["per_device"])
    print(f"{m.name} on up to {args.devices} x {d.name}; input {args.input_len}, output "
          f"{args.output_len}; SLO TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s at "
          f"{args.attainment:.0%}")
    print("| placement | devices | goodput (req/s) | per device |")
    print("|---|---|---|---|")
    for r in rows[:12]:
        pl = r["placement"]
        name = (f"prefill {pl[2]} x TP{pl[1]} + decode {pl[4]} x TP{pl[3]}"
                if pl[0] == "disagg" else f"colocated {pl[2]} x TP{pl[1]}")
        print(f"| {name} | {r['devices']} | {r['goodput']:.2f} | {r['per_device']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
