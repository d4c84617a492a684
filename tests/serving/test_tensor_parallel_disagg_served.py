"""Disaggregated ``tandem serve`` with each phase's tensor parallelism chosen on its own:
prefill workers of 2 ranks and decode workers of 1, then the reverse (one cluster
each, float32, embedded redis-server, supervision on).

The KV of every prompt travels from each prefill rank straight to the decode ranks
that own its heads (kvtransfer/sharded.py); the served greedy tokens equal one
unsharded engine's, the first tokens come on the KV channel (pair (0, 0)), the
bytes sent are the whole prompt's KV, and every block is free afterwards. Killing
rank 1 of the sharded worker under load loses no request: the streams end with
the same tokens (a prefill worker's requests are prefilled again, a decode
worker's migrate) and the supervisor starts a new group.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from tests.serving.conftest import serve_config, serving
from tests.serving.test_fault_tolerance import _assert_idle, _back_to_size, _handle, _wait
from tests.serving.test_tensor_parallel_served import (_check_group, _join_unchanged, _streams,
                                                        prompt_ids, reference)

__all__ = ["prompt_ids", "reference"]      # module fixtures, shared


@pytest.fixture(scope="module", params=["prefill", "decode"])
def cluster(request, ray_session):
    """``request.param``: the pool whose workers have 2 ranks (the other has 1)."""
    config = serve_config("disaggregated", num_blocks=256)
    sharded = dataclasses.replace(config.engine, tensor_parallel_size=2)
    if request.param == "prefill":
        config = dataclasses.replace(config, prefill_engine=sharded)
    else:
        config = dataclasses.replace(config, engine=sharded,
                                     prefill_engine=config.engine)
    for client in serving(config):
        client.sharded = f"{request.param}-0"
        yield client


def test_served_greedy_tokens_equal_one_unsharded_engine(cluster, prompt_ids, reference):
    _check_group(_handle(cluster, cluster.sharded))
    before = cluster.block_counts()
    _join_unchanged(_streams(cluster, prompt_ids[:1]), reference[:1])   # cached after
    _join_unchanged(_streams(cluster, prompt_ids), reference)
    after = cluster.block_counts()
    # Every request's first token came on the KV channel, none from the router.
    assert after["decode-0"]["first_tokens_from_peer"] - \
        before["decode-0"]["first_tokens_from_peer"] == 2 + 2 * len(prompt_ids)
    assert after["decode-0"]["first_tokens_from_router"] == \
        before["decode-0"]["first_tokens_from_router"]
    # Whole blocks of every KV head: 30 layers x K,V x 16 tokens x 3 heads x 64 x 4 bytes.
    sent = after["prefill-0"]["kv_transfer_bytes"] - before["prefill-0"]["kv_transfer_bytes"]
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    assert sent > 0 and sent % per_block == 0
    _assert_idle(cluster)


def test_kill_rank_1_of_the_sharded_worker_under_load(cluster, prompt_ids, reference):
    """Rank 1 killed once the first stream has a token (others may still be in their
    prefill), and 4 more requests sent into the outage: all end with the tokens."""
    old = _handle(cluster, cluster.sharded)
    streams = _streams(cluster, prompt_ids)
    _wait(lambda: any(s.tokens for s in streams), 180, "a stream to start")
    os.kill(old.info["rank_pids"][0], signal.SIGKILL)
    late = _streams(cluster, prompt_ids)[:4]
    _join_unchanged(streams, reference)
    _join_unchanged(late, reference)
    _back_to_size(cluster, cluster.sharded, old.generation)
    _check_group(_handle(cluster, cluster.sharded))
    _join_unchanged(_streams(cluster, prompt_ids)[:4], reference)
    _assert_idle(cluster)
