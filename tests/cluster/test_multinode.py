"""Prefill and decode workers on different Ray nodes: placement by custom resource, the
KV pair across the nodes' addresses, greedy output equal to transformers.

The cluster (a head and two worker nodes, each on its own loopback alias) runs in a
subprocess, multinode_scenario.py: this pytest process may already own an embedded
Ray (tests/serving). Whatever the subprocess leaves behind (it starts Ray's daemons
in its own session) is killed by process id when it is done, even on failure.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .multinode_scenario import DECODE_IP, HEAD_IP, NUM_BLOCKS, PREFILL_IP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCENARIO = Path(__file__).with_name("multinode_scenario.py")

CONTENT = "Name three rivers in Europe and say in which countries they flow."
MAX_TOKENS = 24
RUN_TIMEOUT_S = 180


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": CONTENT}])


def session_pids(sid: int) -> list[int]:
    """Processes in session ``sid`` (the scenario and every Ray process it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:      # exited while listing
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def kill_session(sid: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of session ``sid``; returns those still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = session_pids(sid)
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def scenario(request, tokenizer):
    # Ray's socket paths must stay under the AF_UNIX limit (107 bytes): a short
    # directory of our own, which also keeps the cluster's address file away from
    # every other Ray on this machine (ray.init() would otherwise join this one).
    ray_tmp = tempfile.mkdtemp(prefix="tdm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    request_file, result_file, log_file = (os.path.join(ray_tmp, name) for name in (
        "request.json", "result.json", "scenario.log"))
    with open(request_file, "w") as f:
        json.dump({"content": CONTENT, "max_tokens": MAX_TOKENS}, f)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp,
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)

    def log_tail() -> str:
        with open(log_file) as f:
            return f.read()[-6000:]

    # Output to a file, not a pipe: nobody reads a pipe while the reference runs.
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, str(SCENARIO), request_file, result_file],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # transformers' reference (cached by the fixture) is made while the cluster
        # boots: that is mostly Ray starting its daemons.
        request.getfixturevalue("hf_greedy")(prompt_ids(tokenizer), MAX_TOKENS)
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"scenario did not finish within {RUN_TIMEOUT_S} s:\n{log_tail()}")
        assert proc.returncode == 0, f"scenario failed (exit {proc.returncode}):\n{log_tail()}"
        with open(result_file) as f:
            facts = json.load(f)
    finally:
        # Before any test runs: a failed assertion must not leave a cluster behind.
        left = kill_session(proc.pid)
        proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert left == [], f"processes of the scenario survived SIGKILL: {left}"
    return facts


def test_workers_run_on_the_node_of_their_kind(scenario):
    nodes = {n["ip"]: n for n in scenario["nodes"]}
    assert sorted(nodes) == sorted([HEAD_IP, PREFILL_IP, DECODE_IP])
    assert nodes[PREFILL_IP]["resources"]["prefill"] == 1
    assert nodes[DECODE_IP]["resources"]["decode"] == 1
    # Ray's own record of placement, by node id ...
    assert scenario["placed"] == {"PrefillWorker": nodes[PREFILL_IP]["node_id"],
                                  "DecodeWorker": nodes[DECODE_IP]["node_id"]}
    # ... and what each worker reports about itself.
    workers = scenario["workers"]
    assert {w: (i["role"], i["node_ip"]) for w, i in workers.items()} == {
        "prefill-0": ("prefill", PREFILL_IP), "decode-0": ("decode", DECODE_IP)}


def links_between(workers: dict) -> set[tuple[str, str]]:
    """(connecting worker, address it connected to) of every TCP connection between
    two of ``workers``; the connected-to end is the one on a listening port."""
    out = set()
    for wid, w in workers.items():
        for other, o in workers.items():
            listening = {s["local"][1] for s in o["sockets"] if s["state"] == "LISTEN"}
            ends = {(tuple(s["local"]), tuple(s["remote"])) for s in o["sockets"]
                    if s["state"] == "ESTABLISHED"}
            for s in w["sockets"]:
                if (other != wid and s["state"] == "ESTABLISHED" and s["remote"][1] in listening
                        and (tuple(s["remote"]), tuple(s["local"])) in ends):
                    out.add((wid, s["remote"][0]))
    return out


def test_kv_pair_runs_between_the_node_addresses(scenario):
    workers = scenario["workers"]
    # No worker socket touches a non-loopback address (listeners on "any" aside).
    for wid, w in workers.items():
        for s in w["sockets"]:
            for ip, _ in (s["local"], s["remote"]):
                addr = ipaddress.ip_address(ip)
                assert addr.is_loopback or addr.is_unspecified, (wid, s)
    # Each end's Gloo device listens on its own node's address.
    for wid, ip in (("prefill-0", PREFILL_IP), ("decode-0", DECODE_IP)):
        assert any(s["state"] == "LISTEN" and s["local"][0] == ip for s in workers[wid]["sockets"]), wid
    # The only direct links between the two workers are the KV pair's: the prefill
    # worker joined the store at the decode worker's rendezvous host (its node IP,
    # not 127.0.0.1), and the decode worker's Gloo connected to the prefill node.
    assert links_between(workers) == {("prefill-0", DECODE_IP), ("decode-0", PREFILL_IP)}


def test_greedy_output_equals_transformers(scenario, tokenizer, hf_greedy):
    prompt = prompt_ids(tokenizer)
    assert scenario["prompt_tokens"] == len(prompt)
    assert scenario["finish_reason"] == "FINISH_REASON_LENGTH"
    assert scenario["token_ids"] == hf_greedy(prompt, MAX_TOKENS)


def test_kv_bytes_crossed_and_blocks_are_idle(scenario, tokenizer):
    prompt = prompt_ids(tokenizer)
    layout = scenario["workers"]["decode-0"]["kv_layout"]
    counts = scenario["counts"]
    # Every prompt block travels (nothing was cached on the decode side): K and V,
    # every layer, 4 bytes each.
    assert layout["dtype"] == "float32"
    block_bytes = 2 * layout["block_size"] * layout["num_kv_heads"] * layout["head_dim"] * 4
    num_prompt_blocks = math.ceil(len(prompt) / layout["block_size"])
    assert counts["prefill-0"]["kv_transfer_bytes"] == (
        num_prompt_blocks * block_bytes * layout["num_layers"])
    for wid in ("prefill-0", "decode-0"):
        c = counts[wid]
        assert (c["num_running"], c["num_waiting"], c.get("num_reserved", 0), c["num_swapped"],
                c["num_free_blocks"], c["num_blocks"]) == (0, 0, 0, 0, NUM_BLOCKS, NUM_BLOCKS), wid
