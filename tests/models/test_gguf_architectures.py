"""GGUF files of every dense architecture, as llama.cpp's converter writes them
(``tests/models/gguf_files.py``), give transformers' greedy tokens exactly (float32,
offline through ``LLM``) for prompts of one block and of several, and GGUF keys
Tandem does not serve are refused by key."""

from __future__ import annotations

import pytest

from tandem.engine.config import ModelConfig
from tandem.engine.llm import LLM
from tandem.engine.model.registry import UnsupportedModelError
from tests.models.conftest import hf_greedy, save_tiny_checkpoint
from tests.models.gguf_files import write_gguf
from tests.models.test_architectures import CASES, NUM_TOKENS, _prompts, assert_greedy_and_cached

# case -> (transformers config class, overrides, the architecture Tandem resolves).
# What a GGUF file cannot say is left at what llama.cpp assumes: Gemma's query
# scalar is its head size (16), Gemma 2's output projection is tied (the converter
# drops an untied one), Gemma 3's sliding layers are five in six (6 layers: 0-4
# slide with window 24 and local base 100, layer 5 is global with base 1e6 and
# linear scaling 2). Mistral and Qwen2 windows are not written by the converter, so
# their files have none (see docs/models.md).
GGUF_CASES = {
    "llama": CASES["llama"],
    # Q/K biases are permuted with their rows
    "llama-attention-bias": CASES["llama-attention-bias"],
    "llama-linear-rope": CASES["linear-rope"],
    # llama3 scaling becomes a rope_freqs tensor, YaRN rope.scaling.* keys
    "llama3-rope": CASES["llama3-rope"],
    "yarn-rope": CASES["yarn-rope"],
    # written as general.architecture "llama"
    "mistral": (*CASES["mistral"][:2], "LlamaForCausalLM"),
    "qwen2": CASES["qwen2"],
    "qwen3": CASES["qwen3"],
    "gemma2": ("Gemma2Config", {"sliding_window": 24, "query_pre_attn_scalar": 16,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                                "tie_word_embeddings": True}, "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 6, "sliding_window": 24, "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
        "Gemma3ForCausalLM"),
    # Mixtral is written as general.architecture "llama" with expert tensors
    "mixtral": CASES["mixtral"],
    "qwen2-moe": CASES["qwen2-moe"],
    # all layers sparse: the converter cannot convert mlp_only_layers' dense layers
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True},
                  "Qwen3MoeForCausalLM"),
    "phi3": CASES["phi3"],
    "phi3-longrope": CASES["phi3-longrope"],
}


@pytest.fixture(scope="module", params=sorted(GGUF_CASES))
def served(request, tmp_path_factory):
    """``(case, LLM on the GGUF file, transformers' greedy tokens per prompt)``."""
    config_class, overrides, _ = GGUF_CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(path / "hf", config_class, **overrides)
    reference = [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]
    gguf_path = write_gguf(path / "hf", path / f"{request.param}.gguf")
    llm = LLM(str(gguf_path), dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    return request.param, llm, reference


def test_gguf_greedy_tokens_equal_transformers(served):
    """Chunked prefill on the first pass; the second reads the prompts' full blocks
    from the prefix cache."""
    case, llm, reference = served
    assert llm.engine.model_config.architecture == GGUF_CASES[case][2]
    assert_greedy_and_cached(llm, reference)


BASE_FIELDS = {"general.architecture": "qwen3", "qwen3.embedding_length": 64,
               "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
               "qwen3.attention.key_length": 16, "qwen3.feed_forward_length": 128,
               "qwen3.block_count": 2, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
               "qwen3.context_length": 256, "qwen3.rope.freq_base": 1e6}


def test_gguf_config_fields():
    cfg = ModelConfig.from_gguf_fields(BASE_FIELDS | {"tokenizer.ggml.tokens": ["a"] * 512},
                                       True, ("blk.0.attn_q.weight",))
    assert (cfg.architecture, cfg.vocab_size, cfg.head_dim, cfg.rope_theta,
            cfg.tie_word_embeddings, cfg.attention_bias) == (
        "Qwen3ForCausalLM", 512, 16, 1e6, False, False)
    gemma = {k.replace("qwen3", "gemma2"): v for k, v in BASE_FIELDS.items()} | {
        "general.architecture": "gemma2", "gemma2.vocab_size": 512,
        "gemma2.attention.sliding_window": 8,
        "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}
    gemma["gemma2.attention.key_length"] = 32
    cfg = ModelConfig.from_gguf_fields(gemma | {"gemma2.block_count": 3}, False)
    assert cfg.layer_windows == (8, None, 8) and cfg.query_pre_attn_scalar == 32
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    # llama.cpp's rule for the 27B model (46 layers): scale by hidden / heads
    assert ModelConfig.from_gguf_fields(gemma | {"gemma2.block_count": 46},
                                        False).query_pre_attn_scalar == 16


@pytest.mark.parametrize("extra, names, field", [
    ({"general.architecture": "bert"}, (), "general.architecture"),
    ({"qwen3.rope.scaling.type": "longrope"}, (), "qwen3.rope.scaling.type"),
    ({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
      "qwen3.rope.scaling.original_context_length": 64,
      "qwen3.rope.scaling.yarn_ext_factor": 0.5}, (), "qwen3.rope.scaling.yarn_ext_factor"),
    ({"qwen3.rope.dimension_count": 8}, (), "qwen3.rope.dimension_count"),
    ({"qwen3.attention.value_length": 32}, (), "qwen3.attention.value_length"),
    ({}, ("rope_freqs.weight",), "rope_freqs.weight"),
])
def test_gguf_keys_are_refused_by_name(extra, names, field):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_gguf_fields(BASE_FIELDS | {"qwen3.vocab_size": 512} | extra, True,
                                     names)
    assert info.value.field == field
