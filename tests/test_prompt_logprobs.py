"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) on the real model, float32.

Every prompt position p >= 1 must carry the log-probability Hugging Face's
transformers gives prompt token p after tokens < p (within 1e-4, same top-k
ids), the first position None. The scores must not depend on how the prompt
is computed: in chunks, after the prompt was cached by another request, after
a recompute preemption mid-prefill or mid-decode; and each sample's stream
carries them once, on its first delta.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.runtime import model_runner
from tandem.engine.runtime.engine_loop import EngineLoop
from tandem.engine.sampling.sampler import gather_logprobs
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams
from tandem.engine.scheduling.request import RequestStatus, TokenLogprobs

TOL = 1e-4
PROMPT = "The capital of France is Paris, and the capital of Germany is Berlin. In Italy, the"


@pytest.mark.parametrize("value", [-1, 21, 1.5, "3"])
def test_prompt_logprobs_out_of_range_name_the_field(value):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.field == "prompt_logprobs"
    assert str(e.value).startswith("prompt_logprobs:")


def test_gather_logprobs_is_the_raw_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, float("-inf"), 1.0]])
    ref = torch.log_softmax(logits, dim=-1)
    got = gather_logprobs(logits, [3, 2], [2, 0])
    assert got[0] == TokenLogprobs(3, pytest.approx(float(ref[0, 3])),
                                   ((0, pytest.approx(float(ref[0, 0]))),
                                    (1, pytest.approx(float(ref[0, 1])))))
    assert got[1].token_id == 2 and got[1].top == ()
    assert math.isfinite(got[1].logprob) and got[1].logprob < -1e30    # -inf clamped


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 16        # spans chunks of 8 and blocks of 16
    return ids


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, prompt_ids):
    """``[P, V]`` float32: row q is transformers' log_softmax after prompt[:q + 1]."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def llm(f32_weights):
    return LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)


def _greedy(k: int | None, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          prompt_logprobs=k)


N2 = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True,
                    prompt_logprobs=2)


@pytest.fixture(scope="module")
def reference(llm, prompt_ids):
    """One batch: top 5, top 0, a one-token prompt, no prompt logprobs, n = 2."""
    return llm.generate([prompt_ids, prompt_ids, prompt_ids[:1], prompt_ids, prompt_ids],
                        [_greedy(5), _greedy(0), _greedy(2), _greedy(None), N2])


def assert_close(got: list, want: list) -> None:
    """Same positions, ids and values within TOL; ``got``'s top may be shorter."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for p, (a, b) in enumerate(zip(got[1:], want[1:]), start=1):
        assert a.token_id == b.token_id, p
        assert abs(a.logprob - b.logprob) <= TOL, p
        assert [t for t, _ in a.top] == [t for t, _ in b.top[:len(a.top)]], p
        assert all(abs(x - y) <= TOL for (_, x), (_, y) in zip(a.top, b.top)), p


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(reference, prompt_ids, hf_logprobs):
    top5, top0, one, plain, n2 = reference
    for out, k in ((top5, 5), (top0, 0)):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt_ids) and plp[0] is None
        for p in range(1, len(prompt_ids)):
            ref, got = hf_logprobs[p - 1], plp[p]
            assert got.token_id == prompt_ids[p]
            assert abs(got.logprob - float(ref[prompt_ids[p]])) <= TOL, p
            assert len(got.top) == k
            vals, ids = ref.topk(max(k, 1))
            for j, (t, v) in enumerate(got.top):
                # Same ids in the same order, unless two are tied within the tolerance.
                assert t == int(ids[j]) or abs(float(ref[t]) - float(vals[j])) <= TOL, (p, j)
                assert abs(v - float(vals[j])) <= TOL, (p, j)
    assert one.prompt_logprobs == [None]
    assert plain.prompt_logprobs is None
    assert len(n2.outputs) == 2       # one list for the prompt, whatever the samples
    assert_close(n2.prompt_logprobs, top5.prompt_logprobs)


@pytest.mark.slow
def test_chunked_prefill_and_sliced_logits_change_nothing(llm, reference, prompt_ids,
                                                          monkeypatch):
    want = reference[0]
    # Chunks of 8 tokens, and logits 3 rows at a time within each chunk.
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_SLICE_BYTES",
                        3 * 4 * llm.engine.model_config.vocab_size)
    chunked = LLM(dtype="float32", num_blocks=64, max_num_batched_tokens=8,
                  weights_from=llm)
    steps = []
    got = chunked.generate([prompt_ids], _greedy(3),
                           step_callback=lambda e: steps.append(e.check_invariants()))[0]
    assert len(steps) >= len(prompt_ids) // 8
    assert_close(got.prompt_logprobs, want.prompt_logprobs)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.slow
def test_a_cached_prompt_is_scored_whole_and_still_cached_for_others(llm, reference,
                                                                    prompt_ids):
    want = reference[0].prompt_logprobs
    kv = llm.engine.kv_cache_manager
    kv.reset_prefix_cache()
    first = llm.generate([prompt_ids], _greedy(2, max_tokens=1))[0]
    assert first.num_cached_tokens == 0
    # Its blocks were cached: a request without prompt logprobs hits them.
    assert llm.generate([prompt_ids], _greedy(None, max_tokens=1))[0].num_cached_tokens >= 16
    hits_before = kv.prefix_cache_hits
    again = llm.generate([prompt_ids], _greedy(2, max_tokens=1))[0]
    assert again.num_cached_tokens == 0 and kv.prefix_cache_hits == hits_before
    assert_close(again.prompt_logprobs, want)


def _run_with_deltas(engine: LLMEngine, params: SamplingParams, prompt: list[int],
                     request_id: str = "r", **kw):
    """Drive ``engine`` to completion, turning each step's changed requests into the
    deltas a worker would publish; returns ``(requests, deltas by request id)``."""
    loop = EngineLoop(engine, "test", "colocated")      # never started: deltas only
    reqs = engine.add_request(prompt, params, request_id, **kw)
    if kw.get("output_token_ids"):
        loop.mark_published(request_id, len(kw["output_token_ids"]))
    deltas: dict[str, list] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for r in engine.step():
            deltas[r.request_id].append(loop.delta(r))
        engine.check_invariants()
    return reqs, deltas


@pytest.mark.slow
def test_n_samples_each_carry_them_once_on_their_first_delta(llm, reference, prompt_ids):
    want = reference[0].prompt_logprobs
    reqs, deltas = _run_with_deltas(LLMEngine(llm.config, weights_from=llm.engine),
                                    N2, prompt_ids)
    assert sorted(deltas) == ["r", "r#1"]
    for rid, ds in deltas.items():
        assert ds[0].new_token_ids and ds[0].prompt_logprobs is not None, rid
        assert all(d.prompt_logprobs is None for d in ds[1:]), rid
        assert_close(list(ds[0].prompt_logprobs), want)
    assert deltas["r"][0].prompt_logprobs == deltas["r#1"][0].prompt_logprobs


@pytest.fixture(scope="module")
def long_prompt(llm, prompt_ids):
    """48 tokens (3 blocks) and its output and prompt logprobs run alone."""
    prompt = (prompt_ids * 3)[:48]
    return prompt, llm.generate([prompt], _greedy(1, max_tokens=2))[0]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["mid_prefill", "decoding"])
def test_recompute_preemption_neither_loses_nor_repeats_them(llm, prompt_ids, long_prompt,
                                                            when):
    """A less important request with prompt logprobs is preempted (recompute) by a
    more important one, after its first 32-token chunk or after its first token."""
    prompt, want = long_prompt
    params = _greedy(1, max_tokens=2)
    # 4 blocks of 16 tokens, 32-token steps: the other request's first chunk and the
    # victim's next tokens do not fit together.
    small = LLM(dtype="float32", num_blocks=4, max_num_batched_tokens=32,
                preemption_mode="recompute", weights_from=llm)
    engine = small.engine
    loop = EngineLoop(engine, "test", "colocated")
    victim = engine.add_request(prompt, params, "victim", priority=1)[0]
    deltas = []
    engine.step()
    if when == "decoding":
        deltas += [loop.delta(r) for r in engine.step() if r is victim]
        assert victim.num_output_tokens == 1
    assert engine.num_preemptions == 0
    other = (prompt_ids[::-1] * 3)[:40]          # shares no cached block with the victim
    engine.add_request(other, _greedy(None, max_tokens=2), "vip", priority=0)
    engine.step()
    assert victim.status is RequestStatus.PREEMPTED and engine.num_preemptions == 1
    # Mid-prefill it keeps the positions of its first chunk (32 + None), recomputed unscored.
    assert len(victim.prompt_logprobs) == (33 if when == "mid_prefill" else len(prompt))
    while engine.has_unfinished_requests():
        deltas += [loop.delta(r) for r in engine.step() if r is victim]
        engine.check_invariants()
    assert engine.stats().num_recompute_preemptions >= 1 and victim.num_preemptions >= 1
    assert victim.output_token_ids == want.outputs[0].token_ids
    carried = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1 and deltas[0].prompt_logprobs is not None
    assert_close(list(carried[0]), want.prompt_logprobs)
    assert_close(victim.prompt_logprobs, want.prompt_logprobs)


@pytest.mark.slow
def test_a_resumed_request_does_not_score_its_prompt_again(llm, reference, prompt_ids):
    want = reference[0].outputs[0].token_ids
    engine = LLMEngine(llm.config, weights_from=llm.engine)
    reqs, deltas = _run_with_deltas(engine, _greedy(2), prompt_ids, output_token_ids=want[:2])
    assert reqs[0].output_token_ids == want
    assert reqs[0].prompt_logprobs == []
    assert all(d.prompt_logprobs is None for d in deltas["r"])


@pytest.mark.slow
def test_remote_prefill_refuses_prompt_logprobs(llm):
    consumer = LLMEngine(llm.config, weights_from=llm.engine, kv_transport="gloo")
    try:
        with pytest.raises(InvalidParameterError, match="prompt_logprobs") as err:
            consumer.add_request([1, 2, 3], _greedy(1), kv_transfer_params=KVTransferParams(
                "prefill-0"))
        assert err.value.field == "kv_transfer_params"
    finally:
        consumer.kv_connector.close()
    assert not consumer.has_unfinished_requests()


def test_sampling_params_round_trip_keeps_the_field():
    p = SamplingParams(prompt_logprobs=0)
    assert dataclasses.replace(p, n=2).prompt_logprobs == 0
    assert SamplingParams(**dataclasses.asdict(p)) == p


def test_grpc_responses_carry_them_on_each_samples_first_message(tokenizer):
    from tandem.engine.runtime.outputs import RequestDelta
    from tandem.router.server import to_response
    from tandem.router.stream import new_sample_streams

    prompt = (11, 12, 13)
    entries = (None, TokenLogprobs(12, -1.5, ((7, -0.5),)), TokenLogprobs(13, -2.0, ((13, -2.0),)))
    s = new_sample_streams(tokenizer, prompt, SamplingParams(prompt_logprobs=1), True)[0]
    first = s.add(RequestDelta("r", (42,), prompt_logprobs=entries))
    assert first.prompt_logprobs == entries == s.prompt_logprobs
    msg = to_response("r", s, first.text, first.token_ids, first.logprobs, len(prompt))
    assert [(p.token_id, p.HasField("logprob")) for p in msg.prompt_logprobs] == \
        [(11, False), (12, True), (13, True)]
    assert msg.prompt_logprobs[1].logprob == -1.5 and not msg.prompt_logprobs[0].top_logprobs
    assert [(t.token_id, t.logprob) for t in msg.prompt_logprobs[2].top_logprobs] == [(13, -2.0)]
    second = s.add(RequestDelta("r", (43,), finish_reason="length"))
    assert second.prompt_logprobs is None
    assert not to_response("r", s, second.text, second.token_ids, second.logprobs,
                           len(prompt)).prompt_logprobs
    # Not streamed: the one message per sample carries them.
    final = to_response("r", s, "".join(s.pieces), s.token_ids, s.logprobs, len(prompt))
    assert len(final.prompt_logprobs) == len(prompt)
