"""Resuming a request after tokens an earlier attempt already emitted (request migration
after a decode worker died), on the real model, float32.

A request generates 24 tokens on one engine; on a fresh engine the same prompt,
added with the first 9 of them as ``output_token_ids``, must produce exactly the
other 15: greedy, seeded sampling (the random stream skips one draw per resumed
token) and with penalties (which see the resumed tokens as output). Through a
:class:`DecodeWorker` the first delta carries only new tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.runtime.outputs import WorkerRequest
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the nineteenth century were"
NUM_TOKENS, NUM_RESUMED = 24, 9

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=NUM_TOKENS,
                             ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=NUM_TOKENS,
                                ignore_eos=True, repetition_penalty=1.3,
                                frequency_penalty=0.4, presence_penalty=0.2),
}


@pytest.fixture(scope="module")
def base(f32_weights):
    return LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)


def _fresh(base: LLM) -> LLMEngine:
    return LLMEngine(base.config, weights_from=base.engine)


def _generate(engine: LLMEngine, prompt: list[int], params: SamplingParams, **resume):
    req = engine.add_request(prompt, params, **resume)[0]
    for _ in range(200):
        if req.is_finished:
            break
        engine.step()
        engine.check_invariants()
    assert req.is_finished
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return req


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_continues_as_if_never_interrupted(base, case):
    params = CASES[case]
    prompt = base.tokenizer.encode(PROMPT)
    want = _generate(_fresh(base), prompt, params).output_token_ids
    assert len(want) == NUM_TOKENS
    engine = _fresh(base)
    req = _generate(engine, prompt, params, output_token_ids=want[:NUM_RESUMED])
    assert req.output_token_ids == want
    assert req.status.finish_reason == "length"
    assert engine.runner.sampler.num_seeded_requests == 0


def test_each_sample_of_a_seeded_n_request_resumes_alone(base):
    """Parallel sampling (n = 3, seeded): sample i resumed alone (n == 1,
    ``sample_index`` i) after some of its tokens gives exactly sample i's tokens."""
    prompt = base.tokenizer.encode(PROMPT)
    params = dataclasses.replace(CASES["penalties"], n=3)
    engine = _fresh(base)
    ref = engine.add_request(prompt, params)
    for _ in range(200):
        if all(r.is_finished for r in ref):
            break
        engine.step()
    want = [r.output_token_ids for r in ref]
    assert all(len(w) == NUM_TOKENS for w in want) and len({tuple(w) for w in want}) == 3
    single = dataclasses.replace(params, n=1)
    for i, resumed in ((0, NUM_RESUMED), (1, 3), (2, NUM_RESUMED), (2, 0)):
        req = _generate(_fresh(base), prompt, single, output_token_ids=want[i][:resumed],
                        sample_index=i)
        assert req.output_token_ids == want[i], (i, resumed)
    # Without its index the sample draws from sample 0's stream instead.
    other = _generate(_fresh(base), prompt, single, output_token_ids=want[2][:NUM_RESUMED])
    assert other.output_token_ids != want[2]


def test_logprobs_continue_and_stop_tokens_count_only_new_tokens(base):
    prompt = base.tokenizer.encode(PROMPT)
    params = dataclasses.replace(CASES["greedy"], logprobs=2)
    ref = _generate(_fresh(base), prompt, params)
    want, want_lps = ref.output_token_ids, ref.output_logprobs
    req = _generate(_fresh(base), prompt, params, output_token_ids=want[:NUM_RESUMED],
                    output_logprobs=want_lps[:NUM_RESUMED])
    assert req.output_token_ids == want
    assert [lp.token_id for lp in req.output_logprobs] == want
    for got, exp in zip(req.output_logprobs[NUM_RESUMED:], want_lps[NUM_RESUMED:]):
        assert got.logprob == pytest.approx(exp.logprob, abs=1e-3)
    # A stop token among the resumed tokens does not end the request; its first
    # new occurrence does.
    rest = want[NUM_RESUMED:]
    stop = next(t for t in want[:NUM_RESUMED] if t in rest)
    stopped = _generate(_fresh(base), prompt,
                        dataclasses.replace(CASES["greedy"], stop_token_ids=(stop,)),
                        output_token_ids=want[:NUM_RESUMED])
    assert stopped.output_token_ids == want[:NUM_RESUMED + rest.index(stop) + 1]
    assert stopped.stop_reason == stop and stopped.status.finish_reason == "stop"


def test_resume_arguments_are_checked(base):
    engine = _fresh(base)
    prompt = base.tokenizer.encode(PROMPT)
    p = SamplingParams(max_tokens=4)
    vocab = engine.model_config.vocab_size
    bad = [
        ("output_token_ids", dict(params=dataclasses.replace(p, n=2), output_token_ids=[5])),
        ("output_token_ids", dict(params=p, output_token_ids=[5, 6, 7, 8])),
        ("output_token_ids", dict(params=p, output_token_ids=[5, vocab])),
        ("output_logprobs", dict(params=dataclasses.replace(p, logprobs=0),
                                 output_token_ids=[5, 6], output_logprobs=[None])),
        ("sample_index", dict(params=dataclasses.replace(p, n=2), sample_index=1)),
        ("sample_index", dict(params=p, sample_index=-1)),
    ]
    for field, kwargs in bad:
        with pytest.raises(InvalidParameterError, match=field) as err:
            engine.add_request(prompt, kwargs.pop("params"), **kwargs)
        assert err.value.field == field
    consumer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo")
    try:
        with pytest.raises(InvalidParameterError, match="output_token_ids"):
            consumer.add_request(prompt, p, kv_transfer_params=KVTransferParams("prefill-0"),
                                 output_token_ids=[5])
    finally:
        consumer.kv_connector.close()
    assert not engine.has_unfinished_requests()


def test_a_decode_worker_publishes_only_the_new_tokens(base):
    from tandem.decode_worker.worker import DecodeWorker

    prompt = base.tokenizer.encode(PROMPT)
    params = dataclasses.replace(CASES["seeded"], logprobs=1)
    ref = _generate(_fresh(base), prompt, params)
    want = ref.output_token_ids

    async def scenario():
        worker = DecodeWorker("colocated-0", base.config, role="colocated", kv_transport=None,
                              weights_from=base.engine)
        try:
            await worker.add_request(WorkerRequest(
                "r1", tuple(prompt), params, output_token_ids=tuple(want[:NUM_RESUMED]),
                output_logprobs=tuple(ref.output_logprobs[:NUM_RESUMED]), attempt=1))
            deltas = []
            while not deltas or deltas[-1].finish_reason is None:
                for step in await worker.poll(1.0):
                    deltas += [d for d in step.deltas if d.request_id == "r1"]
            counts = await worker.check_invariants()
        finally:
            await worker.shutdown()
        return deltas, counts

    deltas, counts = asyncio.run(scenario())
    first = deltas[0]
    assert first.new_token_ids == (want[NUM_RESUMED],)
    assert first.num_output_tokens == NUM_RESUMED + 1
    assert [lp.token_id for lp in first.new_logprobs] == [want[NUM_RESUMED]]
    assert [t for d in deltas for t in d.new_token_ids] == want[NUM_RESUMED:]
    assert deltas[-1].num_output_tokens == NUM_TOKENS
    assert deltas[-1].finish_reason == "length"
    assert counts["num_free_blocks"] == counts["num_blocks"]
