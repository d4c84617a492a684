"""Every registered architecture, from a tiny checkpoint transformers wrote, gives
transformers' greedy tokens exactly (float32, offline through ``LLM``), for prompts
of one block and of several; and ``LLM.generate`` takes vLLM's prompt forms."""

from __future__ import annotations

import random

import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams
from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

# case -> (transformers config class, config overrides, the architecture Tandem resolves)
CASES = {
    "llama": ("LlamaConfig", {}, "LlamaForCausalLM"),
    "llama-attention-bias": ("LlamaConfig", {"attention_bias": True}, "LlamaForCausalLM"),
    # original context 32 tokens: the prompts reach well past it, and head_dim 16's
    # wavelengths (6 to 2e4 tokens) fall in all three llama3 bands.
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, "LlamaForCausalLM"),
    "yarn-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}}, "LlamaForCausalLM"),
    "linear-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "LlamaForCausalLM"),
    "mistral": ("MistralConfig", {"sliding_window": None}, "MistralForCausalLM"),
    # a window as long as the context never binds: served, and still exact
    "mistral-inert-window": ("MistralConfig", {"sliding_window": 256}, "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", {}, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", {}, "Qwen3ForCausalLM"),
    # Windows shorter than the 40- and 70-token prompts (and the 5-token prompt's
    # 17 tokens within them): the issue's Mistral, and Qwen2's sliding layers from
    # max_window_layers on.
    "mistral-window": ("MistralConfig", {"sliding_window": 24}, "MistralForCausalLM"),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 20,
                                     "max_window_layers": 1}, "Qwen2ForCausalLM"),
    # Gemma 2: caps low enough to bend the scores and logits, a query scalar unlike
    # head_dim; layer 0 slides (window 24), layer 1 is global.
    "gemma2": ("Gemma2Config", {"sliding_window": 24, "query_pre_attn_scalar": 32,
                                "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 3.0}, "Gemma2ForCausalLM"),
    # Gemma 3: sliding layer with the local base, global layer with its own base
    # and linear scaling.
    "gemma3": ("Gemma3TextConfig", {
        "sliding_window": 24, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
        "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", {}, "Phi3ForCausalLM"),
    # original context 32: the 5-token prompt stays within it (short factors), the
    # 40- and 70-token ones start past it (long factors throughout, chunked or not).
    "phi3-longrope": ("Phi3Config", {
        "original_max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}},
        "Phi3ForCausalLM"),
    # Mixture-of-experts, 8 experts, top-2: Mixtral (weights renormalised, float32);
    # Qwen2-MoE (no renormalisation, a shared expert with its sigmoid gate); Qwen3-MoE
    # (renormalised, Q/K norms, layer 0 dense through mlp_only_layers).
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2},
                "MixtralForCausalLM"),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48},
                  "Qwen2MoeForCausalLM"),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "mlp_only_layers": [0]}, "Qwen3MoeForCausalLM"),
}


def _prompts() -> list[list[int]]:
    """5, 40 and 70 tokens: within one 16-token block, and across 3 and 5 blocks."""
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 70)]


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    """``(case, LLM, transformers' greedy tokens per prompt)`` for one checkpoint."""
    config_class, overrides, _ = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(path, config_class, **overrides)
    reference = [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]
    # a 32-token step budget: the 40- and 70-token prompts prefill in chunks
    llm = LLM(str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    return request.param, llm, reference


def assert_greedy_and_cached(llm: LLM, reference: list[list[int]]) -> None:
    """``llm`` gives ``reference`` for :func:`_prompts` twice: chunked prefill on the
    first pass; the second reads the prompts' full blocks from the prefix cache (its
    cached-token counts exact); every block free after each."""
    for cached in (False, True):
        outs = llm.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert [o.num_cached_tokens for o in outs] == ([0, 32, 64] if cached else [0, 0, 0])
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks


def test_greedy_tokens_equal_transformers(served):
    """Chunked prefill on the first pass; the second reads the prompts' full blocks
    from the prefix cache."""
    case, llm, reference = served
    assert llm.engine.model_config.architecture == CASES[case][2]
    assert_greedy_and_cached(llm, reference)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-prompts")
    save_tiny_checkpoint(path, "LlamaConfig")
    return LLM(str(path), dtype="float32", num_blocks=32)


def test_vllm_prompt_forms(tiny_llama):
    ids = [5, 17, 300, 42, 8]
    text = " ".join(f"w{i}" for i in ids)
    assert tiny_llama.tokenizer.encode(text) == ids
    want = tiny_llama.generate([ids], GREEDY)[0].outputs[0].token_ids
    outs = tiny_llama.generate([{"prompt_token_ids": ids}, {"prompt": text}, text], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    single = tiny_llama.generate({"prompt_token_ids": ids}, GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == want


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {}},
     r"prompts\[0\]: unsupported key\(s\) multi_modal_data"),
    ({"prompt_token_ids": ["a", "b"]}, r"prompts\[0\].prompt_token_ids: expected a list of "
                                       r"integer token ids"),
    ({"prompt_token_ids": "5 6"}, r"prompts\[0\].prompt_token_ids: expected a list of token ids"),
    ({"prompt": [5, 6]}, r"prompts\[0\].prompt: expected a string"),
    ({"text": "w5"}, r"prompts\[0\]: unsupported key\(s\) text"),
    ({}, r"prompts\[0\]: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompt_forms_are_refused_by_name(tiny_llama, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny_llama.generate([prompt], GREEDY)
    assert not tiny_llama.engine.has_unfinished_requests()


def test_gemma2_final_logit_softcapping_shapes_logprobs(tmp_path):
    """Greedy ids cannot see the final soft-cap (tanh keeps the order): the
    log-probabilities do, and equal transformers' (whose logits are capped)."""
    import torch

    config_class, overrides, _ = CASES["gemma2"]
    hf = save_tiny_checkpoint(tmp_path, config_class, **overrides)
    prompt = _prompts()[1]
    llm = LLM(str(tmp_path), dtype="float32", num_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params)[0].outputs[0]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    got = [lp.logprob for lp in out.logprobs]
    assert got == pytest.approx([want[i, t].item() for i, t in enumerate(out.token_ids)],
                                abs=1e-4)
    # capped at 3: no logit beyond +-3, so no token is far less likely than the best
    assert float(want.min()) > -2 * 3.0 - float(torch.logsumexp(torch.zeros(VOCAB), 0))
