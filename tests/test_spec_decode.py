"""Speculative decoding through the offline engine (``LLM(speculative_config=...)``)
on the real model: greedy outputs equal the non-speculative ones token for token
for both proposers, self-drafting accepts every draft, stops, stop strings and
max_tokens inside an accepted run end the request exactly there, preemption
works with speculative requests, seeded samples reproduce, and no block of the
target's or the draft's cache is left behind.
"""

from __future__ import annotations

import pytest

from tandem.engine.config import SpeculativeConfig
from tandem.engine.llm import LLM
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import RequestStatus

pytestmark = pytest.mark.slow

PASSAGE = ("The river runs past the old mill, under the stone bridge and into the lake, "
           "where the fishermen wait for the morning mist to lift before they row out.")
COPY = f"Repeat this sentence word for word.\n\nSentence: {PASSAGE}\n\nRepeated: "
OPEN = "Write a short story about a robot who learns to paint."
PROMPTS = [COPY, OPEN, "List three facts about the moon.", COPY.replace("river", "stream")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
SELF_DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def plain(f32_weights):
    return LLM(dtype="float32", num_blocks=256, weights_from=f32_weights)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]


def _spec_llm(f32_weights, config, **kwargs):
    return LLM(dtype="float32", speculative_config=config, weights_from=f32_weights,
               **{"num_blocks": 256, **kwargs})


def _assert_all_free(llm):
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    proposer = llm.engine.proposer
    if hasattr(proposer, "kv"):
        assert proposer.num_tracked_requests == 0
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert llm.engine.runner.sampler.num_seeded_requests == 0


@pytest.fixture(scope="module")
def ngram_llm(f32_weights):
    return _spec_llm(f32_weights, NGRAM)


@pytest.fixture(scope="module")
def draft_llm(f32_weights):
    return _spec_llm(f32_weights, SELF_DRAFT)


def test_ngram_greedy_equals_no_speculation(ngram_llm, reference):
    outs = ngram_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    st = ngram_llm.engine.scheduler.spec_stats
    # The copy prompts are copied: most drafts are accepted there.
    assert st.num_accepted_tokens >= 24 and st.num_drafts > 0
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    _assert_all_free(ngram_llm)


def test_self_draft_accepts_every_draft_and_equals_no_speculation(draft_llm, reference):
    st = draft_llm.engine.scheduler.spec_stats
    outs = draft_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    # Sampled rows too: the draft distribution is the target's, so min(1, p/q) = 1.
    before = st.num_draft_tokens, st.num_accepted_tokens
    draft_llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, top_k=40, top_p=0.9,
                                                   min_p=0.02, seed=5, max_tokens=16))
    drafted, accepted = st.num_draft_tokens - before[0], st.num_accepted_tokens - before[1]
    assert drafted > 0 and accepted == drafted
    _assert_all_free(draft_llm)


def test_stop_token_inside_an_accepted_run(ngram_llm, reference):
    ref = reference[0]
    stop = ref[9]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=(stop,))
    out = ngram_llm.generate([COPY], params)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    _assert_all_free(ngram_llm)


def test_stop_string_inside_an_accepted_run(ngram_llm, plain):
    """The stop string ends the sample on the token that completes it: no token of the
    same speculative step after it is returned."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=("bridge",))
    want = plain.generate([COPY], params)[0].outputs[0]
    st = ngram_llm.engine.scheduler.spec_stats
    before = st.num_accepted_tokens
    got = ngram_llm.generate([COPY], params)[0].outputs[0]
    assert st.num_accepted_tokens > before
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
        (want.token_ids, want.text, "stop", "bridge")
    assert "bridge" not in got.text and len(got.token_ids) < 40
    _assert_all_free(ngram_llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_inside_an_accepted_run(ngram_llm, reference, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = ngram_llm.generate([COPY], params)[0].outputs[0]
    assert out.token_ids == reference[0][:max_tokens] and out.finish_reason == "length"
    _assert_all_free(ngram_llm)


def test_penalties_with_speculation_equal_no_speculation(ngram_llm, plain):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.3)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], params)]
    assert [o.outputs[0].token_ids for o in ngram_llm.generate(PROMPTS[:2], params)] == want


@pytest.mark.parametrize("config,mode", [(NGRAM, "recompute"), (SELF_DRAFT, "swap")],
                         ids=["ngram-recompute", "draft_model-swap"])
def test_preemption_with_speculative_requests(f32_weights, reference, config, mode):
    """A pool too small for four requests at once: they are preempted while they
    speculate (a preempted request's draft state is dropped and rebuilt when it
    resumes); every step keeps the invariants."""
    llm = _spec_llm(f32_weights, config, num_blocks=14, num_host_blocks=16, block_size=16,
                    preemption_mode=mode)
    engine = llm.engine
    reqs = [engine.add_request(llm.tokenizer.encode(p), GREEDY)[0] for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert [r.output_token_ids for r in reqs] == reference
    sch = engine.scheduler
    assert (sch.num_swap_preemptions if mode == "swap" else sch.num_recompute_preemptions) > 0
    assert sch.spec_stats.num_accepted_tokens > 0
    _assert_all_free(llm)


def test_seeded_samples_reproduce_whatever_the_batch(ngram_llm):
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02, seed=9,
                            max_tokens=24, ignore_eos=True)
    alone = ngram_llm.generate([COPY], params)[0].outputs[0].token_ids
    crowd = ngram_llm.generate([OPEN, COPY, PROMPTS[2]], params)[1].outputs[0].token_ids
    assert alone == crowd and len(alone) == 24
    _assert_all_free(ngram_llm)


def test_abort_frees_the_draft_state(draft_llm):
    engine = draft_llm.engine
    req = engine.add_request(draft_llm.tokenizer.encode(COPY), GREEDY)[0]
    for _ in range(3):
        engine.step()
    assert engine.proposer.num_tracked_requests == 1 and req.status is RequestStatus.RUNNING
    assert engine.abort_request(req.request_id)
    _assert_all_free(draft_llm)


@pytest.mark.parametrize("kwargs,field", [
    ({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"draft_num_blocks": 0}, "draft_num_blocks")])
def test_bad_speculative_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SpeculativeConfig(**{"method": "ngram", **kwargs})


@pytest.mark.parametrize("config,message", [
    ({"num_speculative_tokens": 4}, "speculative_config: method is required"),
    ({"method": "ngram", "num_spec_tokens": 4}, "speculative_config: unknown field"),
    ({"method": "draft_model", "draft_model": "/nonexistent.gguf"}, "draft_model: ")])
def test_the_offline_api_names_a_bad_speculative_config(f32_weights, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", num_blocks=16, speculative_config=config, weights_from=f32_weights)


@pytest.mark.parametrize("argv,message", [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens: needs --speculative-method"),
    (["--speculative-method", "ngram", "--speculative-draft-model", "x.gguf"],
     "draft_model: --speculative-draft-model needs")])
def test_the_cli_refuses_a_bad_speculative_config(capsys, argv, message):
    from tandem.router.cli import main

    assert main(["generate", *argv, "hello"]) == 2
    assert message in capsys.readouterr().err
