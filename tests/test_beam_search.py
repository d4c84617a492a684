"""Beam search: beams and scores identical to Hugging Face transformers'
``generate(num_beams=W)`` on the default model in float32, KV blocks shared by
the beams and all returned to the pool, refusals that name the field.

Cost: ~40 s on 2 CPU cores (the HF reference runs 3 prompts x 2 settings).
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.runtime.beam_search import BeamSearchParams
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams

WIDTH = 4
SETTINGS = [  # (max_tokens, length_penalty, early_stopping)
    (12, 1.0, False),
    (12, 0.5, True),
]


@pytest.fixture(scope="module")
def llm(f32_weights):
    return LLM(dtype="float32", num_blocks=128, block_size=16, weights_from=f32_weights)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    return [tok.encode("The capital of France is"),
            tok.apply_chat_template([{"role": "user", "content": "Say hi in one word."}]),
            tok.apply_chat_template([{"role": "user",
                                      "content": "What is 2+2? Answer with a number."}])]


def hf_beams(hf_model, prompt, max_tokens, length_penalty, early_stopping):
    """transformers' beams (generated ids, EOS kept, padding cut) and sequences_scores."""
    with torch.inference_mode():
        r = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=WIDTH, do_sample=False, max_new_tokens=max_tokens,
            num_return_sequences=WIDTH, output_scores=True, return_dict_in_generate=True,
            length_penalty=length_penalty, early_stopping=early_stopping)
    eos = hf_model.generation_config.eos_token_id
    beams = []
    for row in r.sequences[:, len(prompt):].tolist():
        beams.append(row[:row.index(eos) + 1] if eos in row else row)
    return beams, r.sequences_scores.tolist()


@pytest.mark.parametrize("max_tokens,length_penalty,early_stopping", SETTINGS)
def test_beams_and_scores_match_transformers(llm, prompts, hf_model, max_tokens,
                                             length_penalty, early_stopping):
    kv = llm.engine.kv_cache_manager
    free_before = kv.num_free_blocks
    shared_seen = []

    def check(engine):
        engine.check_invariants()
        # Every running beam of a search shares the prompt's first (full) block.
        for s in engine.beam_search.searches.values():
            if len(s.prompt_token_ids) >= kv.block_size and len(s.running) == WIDTH \
                    and s.running[0].request.num_computed_tokens:
                firsts = {kv.get_block_ids(b.request.request_id)[0] for b in s.running}
                block = kv.block_pool.blocks[firsts.pop()]
                shared_seen.append((not firsts, block.ref_cnt))

    params = BeamSearchParams(beam_width=WIDTH, max_tokens=max_tokens,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                           step_callback=check)
    assert kv.num_free_blocks == free_before           # no block leaked
    assert kv.usage == 0.0
    # (more than WIDTH holders when another prompt's beams hit the same cached block)
    assert shared_seen and all(same and ref >= WIDTH for same, ref in shared_seen)
    reasons = set()
    for prompt, out in zip(prompts, outs):
        beams, scores = hf_beams(hf_model, prompt, max_tokens, length_penalty, early_stopping)
        assert [s.output_token_ids for s in out.sequences] == beams
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=2e-5)
        for s in out.sequences:
            n = len(s.output_token_ids)
            assert s.tokens == prompt + s.output_token_ids
            assert s.score == pytest.approx(s.cum_logprob / n ** length_penalty, rel=1e-6)
            assert s.text == llm.tokenizer.decode(s.output_token_ids)
            reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"}       # both ways of finishing were exercised


def test_sampling_params_route_gives_the_same_beams(llm, prompts):
    """``generate`` with ``use_beam_search`` (the serving path's engine entry): the
    n outputs are the beams, best first, as ``beam_search`` returns them."""
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=8)
    [expected] = llm.beam_search([{"prompt_token_ids": prompts[1]}], params)
    [out] = llm.generate([{"prompt_token_ids": prompts[1]}], params.to_sampling_params())
    assert [o.token_ids for o in out.outputs] == [s.output_token_ids for s in expected.sequences]
    assert [o.index for o in out.outputs] == list(range(WIDTH))
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_abort_frees_every_block(llm, prompts):
    engine = llm.engine
    kv = engine.kv_cache_manager
    free_before = kv.num_free_blocks
    [first] = engine.add_request(prompts[0], SamplingParams(
        n=WIDTH, max_tokens=16, temperature=0.0, use_beam_search=True), request_id="bs-abort")[:1]
    for _ in range(3):
        engine.step()
    assert kv.usage > 0
    assert engine.abort_request("bs-abort")
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert kv.num_free_blocks == free_before
    assert first.is_finished


@pytest.mark.parametrize("kwargs,field", [
    (dict(beam_width=17, max_tokens=4), "beam_width"),
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=4, max_tokens=4, temperature=0.7), "temperature"),
    (dict(beam_width=4, max_tokens=0), "max_tokens"),
    (dict(beam_width=4, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
])
def test_beam_search_params_refusals(kwargs, field):
    with pytest.raises(InvalidParameterError) as e:
        BeamSearchParams(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("kwargs,field", [
    (dict(n=17), "n"),
    (dict(n=4, temperature=1.0), "temperature"),
    (dict(n=4, stop=["x"]), "stop"),
    (dict(n=4, logprobs=2), "logprobs"),
    (dict(n=4, structured_outputs={"regex": "a+"}), "structured_outputs.regex"),
])
def test_sampling_params_refusals(kwargs, field):
    kwargs = {"temperature": 0.0, **kwargs}
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(use_beam_search=True, **kwargs)
    assert e.value.field == field


def test_beam_fields_without_beam_search_are_refused():
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(length_penalty=0.5)
    assert e.value.field == "length_penalty"


def test_engine_refusals(llm, prompts):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4, use_beam_search=True)
    with pytest.raises(InvalidParameterError) as e:
        llm.engine.add_request(prompts[0], params, output_token_ids=[5])
    assert e.value.field == "output_token_ids"
    too_long = SamplingParams(n=2, temperature=0.0, max_tokens=llm.engine.max_model_len,
                              use_beam_search=True)
    with pytest.raises(InvalidParameterError) as e:
        llm.engine.add_request(prompts[0], too_long)
    assert e.value.field == "max_tokens"
    with pytest.raises(ValueError, match="params"):
        llm.beam_search("hi", SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_preempted_beams_give_the_same_beams(llm, prompts, f32_weights):
    """A pool too small for every beam at once: waiting beams are preempted (swap or
    recompute) and forks of a preempted parent start from the prefix cache; the
    beams are those of a roomy pool, and every block comes back."""
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=10)
    want = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    small = LLM(dtype="float32", num_blocks=14, block_size=16, weights_from=f32_weights,
                num_host_blocks=8)
    kv = small.engine.kv_cache_manager
    got = small.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                            step_callback=lambda e: e.check_invariants())
    assert small.engine.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    for g, w in zip(got, want):
        assert [s.output_token_ids for s in g.sequences] == \
            [s.output_token_ids for s in w.sequences]
        assert [s.score for s in g.sequences] == pytest.approx([s.score for s in w.sequences],
                                                               abs=1e-4)


def test_fork_request_shares_blocks_of_a_running_parent_and_none_of_a_waiting_one():
    """Scheduler.fork_request, exact blocks (plain Python, no model): a running
    parent's table is shared (ref counts up, nothing allocated) and the child's first
    write into the shared partly filled block is a copy-on-write; a parent off the
    device gives a waiting child holding nothing."""
    from tandem.engine.config import SchedulerConfig
    from tandem.engine.kv.kv_cache_manager import KVCacheManager
    from tandem.engine.scheduling.request import Request, RequestStatus
    from tandem.engine.scheduling.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=8, block_size=4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 32)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    parent = Request("p", [1, 2, 3, 4, 5, 6], params)
    sch.add_request(parent)
    sch.schedule()
    parent.num_computed_tokens = 6                 # the prompt's KV written: 2 blocks
    assert kv.get_block_ids("p") == [0, 1]
    child = Request("c", [1, 2, 3, 4, 5, 6], params, output_token_ids=[9])
    sch.fork_request(parent, child)
    assert child.status is RequestStatus.RUNNING and child.num_computed_tokens == 6
    assert kv.get_block_ids("c") == [0, 1] and kv.num_free_blocks == 6
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    sch.finish_request("p", RequestStatus.FINISHED_STOPPED)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    sch.check_invariants()
    other = Request("c2", [1, 2, 3, 4, 5, 6], params, output_token_ids=[9, 8])
    sch.fork_request(child, other)
    out = sch.schedule()                           # both write token 6 into block 1
    assert out.block_copies and all(src == 1 for src, _ in out.block_copies)
    sch.check_invariants()
    waiting = Request("w", [7, 7], params)
    sch.add_request(waiting)                       # not admitted yet: holds no block
    orphan = Request("w2", [7, 7], params, output_token_ids=[3])
    sch.fork_request(waiting, orphan)
    assert orphan.status is RequestStatus.WAITING and kv.num_blocks_of("w2") == 0
    sch.check_invariants()
