"""Speculative decoding through gRPC, in both deployment modes: the decode worker
(or the colocated worker) speculates; greedy outputs equal the offline engine's
without speculation token for token, a stop string inside an accepted run ends the
sample on its token (usage counts only what was returned), the ``spec_decode_*``
counters are exported per worker, and every block is free afterwards.

Disaggregated with a self-drafting draft model (the draft computes its own prompt
KV on the decode worker, and must accept every draft), colocated with n-gram
lookup (the offline tests cover both proposers in one engine; the decode worker
runs the same engine whichever proposer it has).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tandem.v1 import tandem_pb2 as pb

from .conftest import Client, start_server
from .test_metrics import samples

PASSAGE = ("The river runs past the old mill, under the stone bridge and into the lake, "
           "where the fishermen wait for the morning mist to lift before they row out.")
COPY = f"Repeat this sentence word for word.\n\nSentence: {PASSAGE}\n\nRepeated: "
PROMPTS = [COPY, "Write a short story about a robot who learns to paint.",
           COPY.replace("river", "stream")]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference(f32_weights):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(dtype="float32", num_blocks=256, weights_from=f32_weights)
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    stopped = llm.generate([COPY], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True, stop=("bridge",)))[0].outputs[0]
    return greedy, stopped


@pytest.fixture(scope="module", params=[("disaggregated", "draft_model"), ("colocated", "ngram")],
                ids=lambda p: "-".join(p))
def cluster(request, ray_session):
    from tandem.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
    from tandem.router.launcher import ServeConfig

    mode, method = request.param
    engine = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256),
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=3))
    server = start_server(ServeConfig(mode=mode, port=0, metrics_port=0, engine=engine))
    client = Client(server)
    client.method = method
    yield client
    client.close()
    server.stop()


def _greedy(prompt: str, **extra) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stream=True, sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra))


def _metric(client: Client, name: str) -> float:
    return sum(v for (n, _), v in samples(client.metrics_text()).items() if n == name)


def test_greedy_over_grpc_equals_no_speculation(cluster, reference):
    greedy, _ = reference
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        runs = list(pool.map(lambda p: cluster.generate(_greedy(p)), PROMPTS))
    assert [[t for r in run for t in r.token_ids] for run in runs] == greedy
    assert all(run[-1].usage.completion_tokens == MAX_TOKENS for run in runs)
    drafts = _metric(cluster, "tandem:spec_decode_num_draft_tokens_total")
    accepted = _metric(cluster, "tandem:spec_decode_num_accepted_tokens_total")
    assert _metric(cluster, "tandem:spec_decode_num_drafts_total") > 0 and accepted > 0
    per_pos = [v for (n, labels), v in samples(cluster.metrics_text()).items()
               if n == "tandem:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(per_pos) == accepted
    if cluster.method == "draft_model":
        assert accepted == drafts          # self-drafting accepts everything
    counts = cluster.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values())


def test_stop_string_inside_an_accepted_run_over_grpc(cluster, reference):
    _, want = reference
    before = _metric(cluster, "tandem:spec_decode_num_accepted_tokens_total")
    run = cluster.generate(_greedy(COPY, stop=["bridge"]))
    assert _metric(cluster, "tandem:spec_decode_num_accepted_tokens_total") > before
    tokens = [t for r in run for t in r.token_ids]
    assert tokens == want.token_ids and "".join(r.text for r in run) == want.text
    last = run[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_str == "bridge"
    assert last.usage.completion_tokens == len(want.token_ids) < MAX_TOKENS
    counts = cluster.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values())
