"""The engine's features on architectures other than Llama: swap and recompute
preemption, n-gram speculative decoding and the batch-invariant mode leave
transformers' greedy tokens unchanged (float32, tiny checkpoints transformers wrote).

A KV pool of 7 blocks cannot hold the three requests together (5-, 40- and
70-token prompts plus 12 tokens each need 1 + 4 + 6 blocks) but holds each alone,
so they are preempted and resumed. The n-gram proposer looks up suffixes from one
token on, so it finds drafts to verify (a prompt repeats a pattern; the 70-token one
holds many of the vocabulary's ids). Windowed layers (Gemma 2 and 3, Mistral,
Qwen2), soft-capped scores (Gemma 2), llama3 RoPE scaling, longrope (Phi-3), Q/K
norms (Qwen3) and mixture-of-experts blocks (Mixtral, Qwen2-MoE's shared expert,
Qwen3-MoE) are on the path. Chunked prefill and the prefix
cache per architecture: tests/models/test_architectures.py; served and
disaggregated: tests/serving/test_architectures_served.py.
"""

from __future__ import annotations

import random

import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams
from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint
from tests.models.test_architectures import CASES

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
FEATURE_CASES = ["llama3-rope", "qwen2-window", "gemma2", "gemma3", "qwen3", "phi3-longrope",
                 "mistral-window", "mixtral", "qwen2-moe", "qwen3-moe"]
MOE_CASES = {"mixtral", "qwen2-moe", "qwen3-moe"}


def _prompts() -> list[list[int]]:
    """5, 40 and 70 tokens; the 40-token one repeats a 6-token pattern."""
    rng = random.Random(2)
    pattern = [rng.randrange(3, VOCAB) for _ in range(6)]
    return [[rng.randrange(3, VOCAB) for _ in range(5)], (pattern * 7)[:40],
            [rng.randrange(3, VOCAB) for _ in range(70)]]


@pytest.fixture(scope="module", params=FEATURE_CASES)
def checkpoint(request, tmp_path_factory):
    """``(case, path, transformers' greedy tokens per prompt)``."""
    config_class, overrides, _ = CASES[request.param]
    path = tmp_path_factory.mktemp(f"features-{request.param}")
    hf = save_tiny_checkpoint(path, config_class, **overrides)
    return request.param, str(path), [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_the_tokens(checkpoint, mode):
    case, path, reference = checkpoint
    llm = LLM(path, dtype="float32", num_blocks=7, num_host_blocks=16, preemption_mode=mode,
              max_num_batched_tokens=32)
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference, case
    stats = llm.engine.stats("offline", "colocated")
    preempted = stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions
    assert preempted > 0 and stats.num_preemptions == preempted, stats
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_ngram_speculation_keeps_the_tokens(checkpoint):
    case, path, reference = checkpoint
    llm = LLM(path, dtype="float32", num_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference, case
    stats = llm.engine.stats("offline", "colocated")
    assert stats.spec_decode_num_draft_tokens > 0, stats
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_batch_invariant_mode_keeps_the_tokens(checkpoint):
    """Windowed and soft-capped layers in batch-invariant mode (every query token
    through the decode kernel over its own window). Mixture-of-experts models are
    refused by name (no batch-invariant expert kernel)."""
    case, path, reference = checkpoint
    if case in MOE_CASES:
        with pytest.raises(ValueError, match="batch_invariant: mixture-of-experts layers"):
            LLM(path, dtype="float32", num_blocks=64, batch_invariant=True)
        return
    llm = LLM(path, dtype="float32", num_blocks=64, batch_invariant=True,
              max_num_batched_tokens=32)
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference, case
