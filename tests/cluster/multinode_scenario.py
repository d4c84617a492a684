"""A three-node Ray cluster on one machine serving one request; run by test_multinode.py.

Nodes (each its own raylet and object store, like separate machines):

    head     HEAD_IP     the driver: router (gRPC on 127.0.0.1) and Ray's GCS
    prefill  PREFILL_IP  custom resource ``prefill``: the prefill worker lands here
    decode   DECODE_IP   custom resource ``decode``: the decode worker lands here

Every node is on its own loopback alias, so all traffic stays on loopback while the
two workers still see different node addresses (Ray replaces 127.0.0.1 itself by
the machine's outbound address, so it is not used).

Usage: ``python multinode_scenario.py REQUEST_JSON RESULT_JSON``. The request file
holds ``{"content": str, "max_tokens": int}`` (one user chat message, greedy); the
result file gets the facts the test asserts on. Everything this script starts is
stopped in ``finally`` blocks; the test also kills whatever is left of its process
session, in case this script itself is killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

HEAD_IP, PREFILL_IP, DECODE_IP = "127.0.0.10", "127.0.0.11", "127.0.0.12"
# Each node's object store lives in /dev/shm; nothing large travels through it here.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
NUM_BLOCKS = 64

_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (or the 32-digit IPv6 form) from /proc/net/tcp* -> (ip, port)."""
    import ipaddress

    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def tcp_sockets(pid: int) -> list[dict]:
    """The TCP sockets process ``pid`` holds: state, local and remote (ip, port)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:     # closed while listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] in inodes:
                    out.append({"state": _TCP_STATES.get(fields[3], fields[3]),
                                "local": _address(fields[1]), "remote": _address(fields[2])})
    return out


def wait_idle(server, actors: dict, timeout_s: float = 30.0) -> dict:
    """Block and queue counts of every worker once nothing is running, waiting,
    reserved or swapped and every block is free (cached ones count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {wid: server.run(a.check_invariants.remote()) for wid, a in actors.items()}
        idle = all(c["num_running"] == 0 and c["num_waiting"] == 0
                   and c.get("num_reserved", 0) == 0 and c["num_swapped"] == 0
                   and c["num_free_blocks"] == c["num_blocks"] for c in counts.values())
        if idle or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def run(request: dict) -> dict:
    import grpc
    import ray
    from ray.cluster_utils import Cluster

    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.router.launcher import BackgroundServer, ServeConfig
    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    t0 = time.monotonic()
    seconds = {}
    node = dict(num_cpus=0, object_store_memory=OBJECT_STORE_BYTES)
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(node_ip_address=HEAD_IP, include_dashboard=False, **node))
    try:
        cluster.add_node(node_ip_address=PREFILL_IP, resources={"prefill": 1}, **node)
        cluster.add_node(node_ip_address=DECODE_IP, resources={"decode": 1}, **node)
        seconds["cluster"] = time.monotonic() - t0
        server = BackgroundServer(ServeConfig(
            ray_address=cluster.address, port=0,
            engine=EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=NUM_BLOCKS))))
        try:
            seconds["serve"] = time.monotonic() - t0
            actors = server.server.actors
            infos = {wid: server.run(a.info.remote()) for wid, a in actors.items()}
            channel = grpc.insecure_channel(server.address)
            try:
                responses = list(pb_grpc.TandemStub(channel).Generate(pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                  content=request["content"])]),
                    sampling=pb.SamplingParams(max_tokens=request["max_tokens"], temperature=0,
                                               ignore_eos=True),
                    stream=True), timeout=120))
            finally:
                channel.close()
            seconds["request"] = time.monotonic() - t0
            counts = wait_idle(server, actors)
            # Where Ray itself placed each actor (the GCS actor table), independent of
            # what the workers report about themselves.
            placed = {a["ActorClassName"]: a["Address"]["NodeID"]
                      for a in ray._private.state.actors().values() if a["State"] == "ALIVE"}
            return {
                "nodes": [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                           "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]],
                "placed": placed,
                "workers": {wid: {"node_ip": i["node_ip"], "pid": i["pid"], "role": i["role"],
                                  "kv_layout": i["kv_layout"],
                                  "sockets": tcp_sockets(i["pid"])} for wid, i in infos.items()},
                "token_ids": [t for r in responses for t in r.token_ids],
                "prompt_tokens": responses[-1].usage.prompt_tokens,
                "finish_reason": pb.FinishReason.Name(responses[-1].finish_reason),
                "counts": counts,
                "seconds": seconds,
            }
        finally:
            server.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
