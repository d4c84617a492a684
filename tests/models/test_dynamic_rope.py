"""Dynamic NTK RoPE scaling (``rope_type: dynamic``) gives transformers' greedy
tokens exactly (float32): a tiny Llama with ``max_position_embeddings`` 32 and factor
2, prompts within and past the 32 tokens, and a generation that crosses them.

transformers' rotary module keeps state across ``generate`` calls (the longest
context it has grown to), so each reference comes from a freshly loaded model:
what one ``generate`` of that prompt alone gives."""

from __future__ import annotations

import random

import pytest

from tandem.engine.llm import LLM
from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint
from tests.models.test_architectures import GREEDY, NUM_TOKENS, _prompts

DYNAMIC = {"max_position_embeddings": 32,
           "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}


def _fresh_greedy(path, prompt: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(model, prompt, NUM_TOKENS)


def _dynamic_prompts() -> list[list[int]]:
    """5, 40 and 52 tokens (:func:`_prompts`' third cut so that 52 + 12 fits the
    64-token context), then 26 tokens whose 12 generated ones cross 32."""
    rng = random.Random(1)
    return [p[:52] for p in _prompts()] + [[rng.randrange(3, VOCAB) for _ in range(26)]]


@pytest.fixture(scope="module")
def dynamic_checkpoint(tmp_path_factory):
    """``(path, transformers' greedy tokens per :func:`_dynamic_prompts` prompt)``."""
    path = tmp_path_factory.mktemp("llama-dynamic")
    save_tiny_checkpoint(path, "LlamaConfig", **DYNAMIC)
    return path, [_fresh_greedy(path, p) for p in _dynamic_prompts()]


def test_dynamic_context_is_extended_by_factor(dynamic_checkpoint):
    """As vLLM: the served context is ``max_position_embeddings * factor``."""
    llm = LLM(str(dynamic_checkpoint[0]), dtype="float32", num_blocks=16)
    assert llm.engine.model_config.max_model_len == 64
    assert llm.engine.model_config.rope_scaling.rope_type == "dynamic"


def test_dynamic_greedy_equals_transformers(dynamic_checkpoint):
    """Each prompt alone, chunked prefill (32-token budget); then all four in one
    batch: each sequence keeps its own base (transformers' reference is one prompt at
    a time). Prefix caching is off for this scaling: nothing is read from it."""
    path, reference = dynamic_checkpoint
    llm = LLM(str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    prompts = _dynamic_prompts()
    assert [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts] == reference
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_dynamic_with_preemption_and_speculation(dynamic_checkpoint, mode):
    """8 blocks (7 usable) cannot hold the four requests at once: preempted ones
    resume (recomputed generated tokens keep the base of their position + 1); n-gram
    drafts are verified several tokens per step, each rotated as its own decode
    step would be."""
    path, reference = dynamic_checkpoint
    llm = LLM(str(path), dtype="float32", num_blocks=8, num_host_blocks=64,
              preemption_mode=mode, max_num_batched_tokens=32,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    outs = llm.generate(_dynamic_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.stats("offline", "colocated")
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0, stats
    assert stats.num_free_blocks == stats.num_blocks


def test_each_token_rotates_with_the_base_transformers_gives_it(dynamic_checkpoint):
    """The rows one step reads, against transformers' own rotary module (fresh, so
    the length of its one call sets the base): a recomputed request (prompt 52,
    tokens 48..58 again: the prompt's base up to 51, then each generated token's own
    ``p + 1``), a chunk of a 40-token prompt, a decode step, a short prompt."""
    import dataclasses

    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tandem.engine.runtime.model_runner import pack_chunks
    from tests.models.conftest import BASE

    def hf_row(position: int, seq_len: int) -> torch.Tensor:
        """transformers' cos/sin ``[D]`` (the table's layout) of ``position`` in the
        forward of a ``seq_len``-token sequence."""
        rotary = LlamaRotaryEmbedding(LlamaConfig(**(BASE | DYNAMIC)))
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(seq_len)[None])
        half = cos.shape[-1] // 2
        return torch.cat([cos[0, position, :half], sin[0, position, :half]])

    llm = LLM(str(dynamic_checkpoint[0]), dtype="float32", num_blocks=16)
    model = llm.engine.model
    # (start, end, prompt length) per sequence: tokens start..end-1 in this step
    seqs = [(48, 59, 52), (0, 27, 40), (45, 46, 40), (0, 5, 5)]
    _, positions, meta = pack_chunks([([7] * (end - start), start, list(range(4)))
                                      for start, end, _ in seqs], 16, "cpu")
    meta = dataclasses.replace(meta, prompt_lens_cpu=[p for _, _, p in seqs])
    rows, table = model._dynamic_ntk_rows(positions, meta)
    got = table[rows]
    offset = 0
    for start, end, prompt_len in seqs:
        for p in range(start, end):
            want = hf_row(p, max(prompt_len, p + 1))
            assert torch.equal(got[offset + p - start], want), (start, p, prompt_len)
        offset += end - start
