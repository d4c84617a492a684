"""KV transfer bandwidth between two processes, against plain peers in the same run.

What is timed, per prompt length and dtype, for the default model's KV shape
(30 layers, 3 KV heads, head_dim 64, block size 16):

* ``kvtransfer``: the prefill process gathers each layer's blocks (scattered ids
  in a 512-block cache) and calls ``send_layer`` for layers 0..29 back to back,
  then ``finish``; the decode process's ``receive`` scatters them into its own
  scattered blocks. Clock: from just before the first ``send_layer`` to the
  return of ``receive`` (all 30 layers in the destination cache).
* ``gloo_whole``: the same bytes as one contiguous tensor, one
  ``ProcessGroupGloo.send`` into a receive posted in advance (no gather,
  scatter or headers: the raw wire).
* ``pipe_pickle``: the same tensor pickled through a ``multiprocessing`` pipe and
  unpickled (what passing KV through a control plane would cost at best).
* ``kv_overlap``: ``kvtransfer`` with ``--layer-compute-ms`` of sleep before each
  ``send_layer``, standing in for the layer's compute (a sleep, so that it does
  not compete for the cores); its total time includes that compute, so only its
  ``tail_ms`` is of interest.

``tail_ms`` is the part of that time after the prefill side handed over its last
layer (for ``kvtransfer``, when the 30th ``send_layer`` returned; for the peers,
which send everything at once, the whole time): with compute between layers,
this is what a transfer adds to time to first token. Both ends read
``time.monotonic()``, one clock for all processes on Linux.
Bandwidth is KV bytes moved / seconds, in GB/s (1e9 bytes). Each cell is the
median of ``--reps`` runs after one warm-up.

Usage::

    python benchmarks/kv_transfer.py --out /tmp/kv_transfer.json

Recorded with ``.venv/bin/python benchmarks/kv_transfer.py --reps 9 --out
/tmp/kv_transfer.json`` (Gloo over loopback, 2 CPU cores shared with other jobs:
1-minute load average 2.1-2.3 during the run, so single cells vary 2-3x between
runs; medians of 9)::

    dtype     tokens     MB   kvtransfer ms (GB/s, tail)   gloo_whole ms (GB/s)   pipe_pickle ms (GB/s)   kv_overlap tail ms
    float32      128    5.9      19.4 (0.30,   6.6)           7.5 (0.78)            30.7 (0.19)           0.32
    float32      512   23.6      37.9 (0.62,  25.6)          16.0 (1.48)           100.0 (0.24)           0.64
    float32     2048   94.4      82.1 (1.15,  17.9)          73.8 (1.28)           282.0 (0.34)           1.37
    bfloat16     128    2.9       8.3 (0.35,   4.2)           1.3 (2.27)             3.0 (0.99)           0.47
    bfloat16     512   11.8      17.2 (0.69,   9.1)           7.4 (1.58)            11.4 (1.04)           0.41
    bfloat16    2048   47.2      41.1 (1.15,   7.8)          37.4 (1.26)           168.1 (0.28)           1.20

Reading: sent back to back, the per-layer pipeline (a header, a Gloo message and
a scatter per layer) costs 0.2-0.4 ms a layer over the raw wire, which dominates
small prompts; from 2048 tokens on it is within 10-20 % of one contiguous Gloo
send. With 1 ms of compute per layer (``kv_overlap``) a transfer finishes
0.3-1.4 ms after the last layer is computed, where sending the whole KV after
prefill would add the full ``gloo_whole`` time (1.3-74 ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tandem.kvtransfer.base import get_transport
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 30, 16, 3, 64
CACHE_BLOCKS = 512  # blocks in each worker's cache; prompts use a scattered subset


def _layout(dtype: str) -> KVLayout:
    return KVLayout(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)


def _cache(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, CACHE_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.torch_dtype)


def _scattered(num_blocks: int, seed: int) -> list[int]:
    return torch.randperm(CACHE_BLOCKS, generator=torch.Generator().manual_seed(seed))[:num_blocks].tolist()


def _plain_group(host: str, port: int, rank: int) -> dist.ProcessGroupGloo:
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.PrefixStore("whole", store), rank, 2, opts)


def _prefill_process(conn, data_conn, transport: str, rendezvous: dict, store_port: int,
                     layer_compute_s: float) -> None:
    """The sending side: runs each command from ``conn`` and answers with its start time."""
    sender = get_transport(transport).sender.connect(rendezvous, timeout_s=60)
    group = _plain_group(rendezvous["host"], store_port, rank=1)
    caches: dict[str, torch.Tensor] = {}
    while True:
        command = conn.recv()
        if command[0] == "exit":
            sender.close()
            return
        kind, ticket_dict, src_ids = command
        ticket = KVTransferTicket.from_dict(ticket_dict)
        layout = ticket.layout
        if layout.dtype not in caches:
            caches[layout.dtype] = _cache(layout, seed=1)
        kv_cache = caches[layout.dtype]
        whole = kv_cache[:, :, src_ids].contiguous()  # same bytes, prepared outside the clock
        if kind in ("kvtransfer", "kv_overlap"):
            start = time.monotonic()
            for layer in range(layout.num_layers):
                if kind == "kv_overlap":
                    time.sleep(layer_compute_s)
                sender.send_layer(ticket, layer, src_ids, kv_cache)
            handed_over = time.monotonic()
            sender.finish(ticket, timeout_s=60)
        elif kind == "gloo_whole":
            start = handed_over = time.monotonic()
            group.send([whole.view(-1).view(torch.uint8)], 0, 1).wait()
        elif kind == "pipe_pickle":
            start = handed_over = time.monotonic()
            data_conn.send_bytes(pickle.dumps(whole))
        else:
            raise ValueError(f"unknown command {kind!r}")
        conn.send((start, handed_over))


def run(transport: str, tokens_list: list[int], dtypes: list[str], reps: int,
        layer_compute_ms: float) -> list[dict]:
    receiver = get_transport(transport).receiver.listen()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    data_recv, data_send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_prefill_process,
                        args=(child_conn, data_send, transport, receiver.rendezvous, store.port,
                              layer_compute_ms / 1e3))
    child.start()
    group = _plain_group("127.0.0.1", store.port, rank=0)
    results = []
    transfer_id = 0
    try:
        for dtype in dtypes:
            layout = _layout(dtype)
            dst_cache = torch.zeros(layout.num_layers, 2, CACHE_BLOCKS, layout.block_size,
                                    layout.num_kv_heads, layout.head_dim, dtype=layout.torch_dtype)
            for num_tokens in tokens_list:
                num_blocks = -(-num_tokens // BLOCK_SIZE)
                src_ids, dst_ids = _scattered(num_blocks, seed=2), _scattered(num_blocks, seed=3)
                nbytes = NUM_LAYERS * num_blocks * layout.bytes_per_block_per_layer
                for method in ("kvtransfer", "gloo_whole", "pipe_pickle", "kv_overlap"):
                    seconds, tails = [], []
                    for rep in range(reps + 1):
                        transfer_id += 1
                        ticket = KVTransferTicket(f"bench-{transfer_id}", transfer_id, tuple(dst_ids), 0,
                                                  num_tokens, layout)
                        if method == "gloo_whole":
                            buffer = torch.empty(nbytes, dtype=torch.uint8)
                            work = group.recv([buffer], 1, 1)
                        conn.send((method, ticket.to_dict(), src_ids))
                        if method in ("kvtransfer", "kv_overlap"):
                            receiver.receive(ticket, dst_cache, timeout_s=60)
                        elif method == "gloo_whole":
                            work.wait()
                        else:
                            pickle.loads(data_recv.recv_bytes())
                        end = time.monotonic()
                        start, handed_over = conn.recv()
                        if rep:  # rep 0 warms up connections and allocators
                            seconds.append(end - start)
                            tails.append(end - handed_over)
                    median = statistics.median(seconds)
                    results.append({"dtype": dtype, "num_tokens": num_tokens, "num_blocks": num_blocks,
                                    "bytes": nbytes, "method": method,
                                    "median_ms": round(median * 1e3, 3),
                                    "median_gb_per_s": round(nbytes / median / 1e9, 3),
                                    "median_tail_ms": round(statistics.median(tails) * 1e3, 3),
                                    "all_ms": [round(s * 1e3, 3) for s in seconds]})
                    print(_row(results[-1]), flush=True)
    finally:
        conn.send(("exit",))
        child.join(30)
        receiver.close()
    return results


def _row(r: dict) -> str:
    return (f"{r['dtype']:>9} {r['num_tokens']:>7} {r['num_blocks']:>7} {r['bytes'] / 1e6:>9.2f} "
            f"{r['method']:>12} {r['median_ms']:>10.2f} {r['median_gb_per_s']:>8.2f} "
            f"{r['median_tail_ms']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="gloo", choices=["gloo"],
                        help="KV transport under test (NCCL needs two GPUs and GPU-side peers)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layer-compute-ms", type=float, default=1.0,
                        help="stand-in compute per layer for kv_overlap (ms)")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    args = parser.parse_args()
    print(f"{'dtype':>9} {'tokens':>7} {'blocks':>7} {'MB':>9} {'method':>12} {'median_ms':>10} {'GB/s':>8} {'tail_ms':>8}")
    load_before = os.getloadavg()
    results = run(args.transport, args.tokens, args.dtypes, args.reps, args.layer_compute_ms)
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    # Other work on the same cores shows up here and in the spread of all_ms.
                    "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]]},
        "layout": {"num_layers": NUM_LAYERS, "block_size": BLOCK_SIZE, "num_kv_heads": NUM_KV_HEADS,
                   "head_dim": HEAD_DIM, "cache_blocks": CACHE_BLOCKS},
        "transport": args.transport, "reps": args.reps, "layer_compute_ms": args.layer_compute_ms,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
