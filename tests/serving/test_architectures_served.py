"""Architectures other than Llama through the whole serving path: a tiny checkpoint that
transformers wrote, served disaggregated (1 prefill + 1 decode Ray actor, the KV
streamed between them over Gloo, gRPC over loopback), gives transformers' greedy
tokens exactly (float32).

Every architecture of docs/models.md's table: Llama 3 (llama3 RoPE scaling), Qwen2
(Q/K/V biases, a sliding layer), Qwen3 (Q/K norms), Gemma 2 (soft-capping, query
scalar, alternating windows) and Gemma 3 (sliding and global layers with their own
RoPE bases, sandwich norms, GeGLU), Phi-3 (fused projections, longrope: the long
prompts start past the original context), Mistral (a window shorter than the
prompts), and the mixture-of-experts Mixtral, Qwen2-MoE (a shared expert, Q/K/V
biases) and Qwen3-MoE (a dense layer beside the sparse one). The offline engine's exactness per architecture is
tests/models/test_architectures.py; this checks that the KV layout, the transfer
and the decode worker carry it unchanged. One cluster per checkpoint.
"""

from __future__ import annotations

import random

import pytest

from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint
from tests.models.test_architectures import CASES
from tests.serving.conftest import Client, start_server

NUM_TOKENS = 12


def _prompts() -> list[list[int]]:
    """5, 40 and 70 tokens: within one 16-token block, and across 3 and 5 blocks."""
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 70)]


@pytest.fixture(scope="module", params=["llama3-rope", "qwen2-window", "qwen3", "gemma2",
                                        "gemma3", "phi3-longrope", "mistral-window", "mixtral",
                                        "qwen2-moe", "qwen3-moe"])
def served(request, ray_session, tmp_path_factory):
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.router.launcher import ServeConfig

    config_class, overrides, _ = CASES[request.param]
    path = tmp_path_factory.mktemp(f"served-{request.param}")
    hf = save_tiny_checkpoint(path, config_class, **overrides)
    reference = [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]
    engine = EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    server = start_server(ServeConfig(mode="disaggregated", port=0, metrics_port=0,
                                      engine=engine))
    client = Client(server)
    yield request.param, client, reference
    client.close()
    server.stop()


def test_disaggregated_greedy_equals_transformers(served):
    from tandem.v1 import tandem_pb2 as pb

    case, client, reference = served
    assert client.server.server.cluster.decode[0].info["model_name"]
    got = []
    for prompt in _prompts():
        responses = client.generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), stream=True, sampling=pb.SamplingParams(
                max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)))
        got.append([t for r in responses for t in r.token_ids])
    assert got == reference, case
    # Every prompt's KV came from the prefill worker, and every block is free again.
    counts = client.wait_idle()
    assert counts["prefill-0"]["kv_transfer_bytes"] > 0
    for wid, c in counts.items():
        assert c["num_free_blocks"] == c["num_blocks"], (wid, c)
