"""Greedy parity with Hugging Face transformers on the real default model (float32),
and the same outputs whatever the engine's memory-management settings."""

from __future__ import annotations

import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 48

_LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Before that, books were copied by hand in monasteries, a slow and expensive craft. "
    "Within fifty years presses had spread to more than two hundred cities across Europe, "
    "and millions of volumes had been printed. Pamphlets, newspapers and scientific "
    "journals followed, and literacy rose as printed material became cheaper. ")


def parity_prompts(tokenizer) -> list[list[int]]:
    """8 prompts: chat and raw, short and long (~700 tokens), different lengths."""
    chat = [
        "What is the capital of France?",
        "Write a short poem about autumn leaves.",
        "Explain recursion to a child in two sentences.",
        "Summarize this text:\n" + _LONG_TEXT * 7,
    ]
    raw = [
        "The quick brown fox",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village by the sea,",
        _LONG_TEXT * 8 + "In conclusion,",
    ]
    out = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chat]
    out += [tokenizer.encode(r) for r in raw]
    return out


@pytest.fixture(scope="module")
def prompts(tokenizer):
    p = parity_prompts(tokenizer)
    lengths = sorted(len(x) for x in p)
    assert lengths[0] < 16 and 600 <= lengths[-1] <= 900, lengths
    return p


@pytest.fixture(scope="module")
def reference(prompts, hf_greedy):
    return [hf_greedy(p, NUM_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def base_llm(f32_weights):
    return LLM(dtype="float32", num_blocks=512, weights_from=f32_weights)


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def check_parity(llm: LLM, prompts, reference, **kw):
    def invariants(engine):
        engine.check_invariants()

    outs = llm.generate(prompts, GREEDY, step_callback=invariants, **kw)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"prompt {i}: first mismatch at {next(j for j, (a, b) in enumerate(zip(g, r)) if a != b)}"
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks   # every block back (cached ones are evictable)
    assert not llm.engine.has_unfinished_requests()
    return outs


def test_greedy_parity_batched(base_llm, prompts, reference):
    check_parity(base_llm, prompts, reference)


def test_parity_each_prompt_alone(base_llm, prompts, reference):
    for p, r in zip(prompts[:2] + prompts[-1:], reference[:2] + reference[-1:]):
        assert base_llm.generate([p], GREEDY)[0].outputs[0].token_ids == r


# Unchunked prefill at a 2048 budget schedules these prompts as the default does
# (none exceeds it): test_greedy_parity_batched; serving/test_batch_invariance turns
# chunking off. Here the small budget splits every long prompt into chunks.
@pytest.mark.parametrize("chunked,budget", [(True, 64)])
def test_chunked_prefill_on_off(base_llm, prompts, reference, chunked, budget):
    llm = LLM(dtype="float32", num_blocks=512, enable_chunked_prefill=chunked,
              max_num_batched_tokens=budget, weights_from=base_llm)
    # Both long prompts (661 and 715 tokens: 11 and 12 chunks) beside two short ones,
    # whose decode steps share the budget with those chunks.
    keep = [0, 3, 4, 7]
    check_parity(llm, [prompts[i] for i in keep], [reference[i] for i in keep])


def test_prefix_caching_on_off(base_llm, prompts, reference):
    on = base_llm                      # prefix caching is on by default
    assert on.config.cache.enable_prefix_caching
    if on.engine.kv_cache_manager.prefix_cache_queries == 0:
        check_parity(on, prompts, reference)            # run alone: fill the cache first
    second = check_parity(on, prompts, reference)       # same prompts again: served from the cache
    bs = on.engine.kv_cache.block_size
    for o, p in zip(second, prompts):
        assert o.num_cached_tokens == ((len(p) - 1) // bs) * bs
    off = LLM(dtype="float32", num_blocks=512, enable_prefix_caching=False, weights_from=base_llm)
    check_parity(off, prompts[:2], reference[:2])
    # The same prompts again: no hits (looked up when a prompt is admitted, so one
    # token each shows it).
    second_off = off.generate(prompts[:2], SamplingParams(max_tokens=1, temperature=0.0))
    assert all(o.num_cached_tokens == 0 for o in second_off)
    assert off.engine.kv_cache_manager.prefix_cache_hits == 0


def test_recompute_preemption_keeps_outputs(base_llm, prompts, reference):
    # 80 blocks x 16 tokens: the two ~700-token prompts alone need ~96 blocks at the end.
    llm = LLM(dtype="float32", num_blocks=80, max_num_batched_tokens=256,
              preemption_mode="recompute", weights_from=base_llm)
    check_parity(llm, prompts, reference)
    stats = llm.engine.stats()
    assert stats.num_preemptions == stats.num_recompute_preemptions > 0
    assert stats.num_swap_preemptions == 0 and stats.num_host_blocks == 0


def test_max_model_len_capped_by_pool(base_llm):
    llm = LLM(dtype="float32", num_blocks=4, weights_from=base_llm)
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([list(range(100, 160))], SamplingParams(max_tokens=8))


def test_greedy_parity_torch_backend(base_llm, prompts, reference):
    """The pure-torch CPU path (used where no C++ compiler builds the kernels)."""
    llm = LLM(dtype="float32", num_blocks=512, attention_backend="torch", weights_from=base_llm)
    assert llm.engine.backend.name == "torch"
    # Short chat and raw prompts, and the longest (its prefill spans several chunks).
    keep = [0, 4, 5, 7]
    check_parity(llm, [prompts[i] for i in keep], [reference[i] for i in keep])


def _agreement(outputs, reference) -> int:
    """Generated tokens equal to the reference before each prompt's first mismatch."""
    total = 0
    for out, ref in zip(outputs, reference):
        got = out.outputs[0].token_ids
        total += next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    return total


def test_bfloat16_kernels_track_the_float32_reference(prompts, reference):
    """bfloat16 greedy outputs drift from float32 ones at near-ties whatever the
    kernels; the compiled CPU kernels (decode + chunked prefill mixed, budget 256)
    must stay about as close to the float32 reference as the torch ops do. The
    count is a sum of agreeing prefixes, so one near-tie flip drops the rest of a
    prompt's tokens: measured at budget 256, 247 of 384 tokens vs 185 (both with
    the compiled linear kernel on CPUs without oneDNN bfloat16), on an AVX-512 BF16
    CPU 137 vs 102 with oneDNN's linear layers and 157 vs 228 with dpbf16_linear's
    (cpu/torch 0.69-1.34x on the same kernels). A wiring error gives ~0.
    The longest raw prompt is left out (emulated bfloat16 prefill is slow here); the
    ~700-token chat prompt still spans three prefill chunks."""
    keep = [i for i in range(len(prompts)) if i != 7]
    prompts, reference = [prompts[i] for i in keep], [reference[i] for i in keep]
    runs, first = {}, None
    for backend in ("cpu", "torch"):
        llm = LLM(dtype="bfloat16", num_blocks=512, max_num_batched_tokens=256,
                  attention_backend=backend, weights_from=first)   # one bf16 load for both
        first = first or llm
        assert llm.engine.backend.name == backend
        runs[backend] = _agreement(llm.generate(prompts, GREEDY), reference)
    print(f"\nbfloat16 agreement with float32: {runs}")
    assert runs["cpu"] >= 0.5 * runs["torch"] and runs["torch"] > NUM_TOKENS, runs
