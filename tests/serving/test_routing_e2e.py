"""Prefix-aware routing on a real cluster: two colocated workers report the blocks they
cache as KV events on their Redis streams; the router sends a prompt to the
worker holding its longest cached prefix, where least-loaded routing would not.
"""

from __future__ import annotations

import threading
import time

import pytest

from .conftest import greedy, serve_config, serving

pytestmark = pytest.mark.slow

PREFIX = ("You are a careful assistant. Answer in one short sentence, and never use lists. "
          "The user is asking about the history and geography of European capital cities. ")


@pytest.fixture(scope="module")
def pair(ray_session):
    yield from serving(serve_config("colocated", num_blocks=256, num_decode=2))


def test_the_worker_holding_the_prefix_gets_the_request(pair):
    srv = pair.server.server
    assert srv.config.routing_policy == "prefix_aware"
    # Both workers' first stats are in (a worker with none ranks last, not first).
    deadline = time.monotonic() + 30
    while any(w.stats is None for w in srv.cluster.decode) and time.monotonic() < deadline:
        time.sleep(0.05)
    # A long request takes colocated-0 (both idle: ties go to the first worker) ...
    long_started = threading.Event()
    long_done: list = []

    def run_long():
        for resp in pair.stub.Generate(greedy("Count slowly from one to two hundred:", 160),
                                       timeout=300):
            long_started.set()
            long_done.append(resp)

    t = threading.Thread(target=run_long)
    t.start()
    assert long_started.wait(120)
    # ... so the prefixed request goes to the less loaded colocated-1, which caches it.
    first = pair.generate(greedy(PREFIX + "What is the capital of France?", 4))
    assert first[-1].usage.cached_tokens == 0
    t.join(300)
    assert long_done and long_done[-1].usage.completion_tokens == 160
    pair.wait_idle()
    policy = srv.cluster.policy
    # The router learns what each worker caches from the workers' Redis streams.
    deadline = time.monotonic() + 10
    while not policy.index.hashes_of("colocated-1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(policy.index.hashes_of("colocated-1")) > 0
    # Both idle and equally free now: least-loaded would pick colocated-0; the cached
    # prefix sends the next request to colocated-1, where it hits.
    second = pair.generate(greedy(PREFIX + "What is the capital of Spain?", 4))
    bs = srv.cluster.decode[1].block_size
    num_prefix_tokens = len(_tokenize(PREFIX))
    assert second[-1].usage.cached_tokens >= (num_prefix_tokens // bs - 1) * bs > 0
    text = pair.metrics_text()
    hits = {w: _metric(text, "tandem:prefix_cache_hits_total", w)
            for w in ("colocated-0", "colocated-1")}
    assert hits["colocated-0"] == 0 and hits["colocated-1"] == second[-1].usage.cached_tokens
    counts = pair.wait_idle()
    for c in counts.values():
        assert c["num_free_blocks"] == c["num_blocks"], counts


def _tokenize(text: str) -> list[int]:
    from tandem.engine.model.model_files import resolve_model
    from tandem.engine.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model(None)).encode(text)


def _metric(text: str, name: str, worker: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("worker") == worker:
                return s.value
    raise AssertionError(f"{name}{{worker={worker}}} not exposed")
