"""Structured outputs in the engine, on the real default model (float32): JSON schemas,
regex, choice and EBNF constraints; the mask beside unconstrained requests, under
chunked prefill, recompute preemption, a resumed request and speculative decoding;
refusals naming the field."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling.grammar import check_structured_outputs, constrain_row, constrain_rows
from tandem.engine.sampling.sampling_params import (InvalidParameterError, SamplingParams,
                                                    StructuredOutputsParams as SO)
from tandem.engine.scheduling.request import RequestStatus

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}, "required": ["city", "population"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "maximum": 9999}, "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
        "required": ["id", "email"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "integer", "maximum": 999}, "y": {"type": "integer", "maximum": 999}}, "required": ["x", "y"]},
     "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "code": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["colour", "code"]},
]
QUESTION = "Describe a person from Paris in JSON."


@pytest.fixture(scope="module")
def llm(f32_weights):
    return LLM(dtype="float32", num_blocks=256, weights_from=f32_weights)


def _chat(llm, question: str, params: SamplingParams):
    return llm.chat([{"role": "user", "content": question}], params)[0].outputs[0]


def _ids(llm, question: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])


# -- parameters ------------------------------------------------------------------------------

def test_params_need_exactly_one_constraint_and_round_trip_as_dicts():
    with pytest.raises(InvalidParameterError) as e:
        SO()
    assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidParameterError) as e:
        SO(regex="a", choice=["a"])
    assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidParameterError) as e:
        SO(json="{not json")
    assert e.value.field == "structured_outputs.json"
    with pytest.raises(InvalidParameterError) as e:
        SO(choice="yes")
    assert e.value.field == "structured_outputs.choice"
    assert SO(json={"type": "object"}).json == '{"type": "object"}'
    p = SamplingParams(structured_outputs=SO(choice=["a", "b"]))
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))   # the journal's way
    assert again == p and again.structured_outputs.key == ("choice", ("a", "b"))


@pytest.mark.parametrize("so, field", [
    (SO(json='{"type": "objectx"}'), "structured_outputs.json"),
    (SO(regex="(ab"), "structured_outputs.regex"),
    (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_uncompilable_constraints_are_refused_by_name(llm, so, field):
    with pytest.raises(InvalidParameterError) as e:
        check_structured_outputs(so)
    assert e.value.field == field
    with pytest.raises(InvalidParameterError) as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(structured_outputs=so))
    assert e.value.field == field
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3, 4]])
def test_masking_rows_at_once_equals_masking_each(rows):
    """The batched mask (the sampler's) gives exactly the per-row one, the fallback
    included: row 3 has every allowed token at -inf (``min_tokens`` banned them), so
    it takes its raw logits masked by the grammar alone."""
    import torch

    g = torch.Generator().manual_seed(0)
    raw = torch.randn(5, 100, generator=g)
    processed = raw * 0.5
    allowed = torch.rand(5, 100, generator=g) < 0.2
    processed[3][allowed[3]] = float("-inf")
    want = processed.clone()
    for i in rows:
        constrain_row(want[i], allowed[i], raw[i])
    got = processed.clone()
    constrain_rows(got, rows, allowed[rows], raw)
    assert torch.equal(got, want)
    assert torch.equal(torch.isfinite(got[3]), allowed[3])       # the fallback row


# -- outputs ---------------------------------------------------------------------------------

def test_json_schemas_validate_greedy_and_sampled(llm):
    ids = _ids(llm, QUESTION)
    compiles = llm.engine.structured_outputs.num_compiles
    params = [SamplingParams(temperature=t, seed=7, max_tokens=120,
                             structured_outputs=SO(json=s))
              for t in (0.0, 0.8) for s in SCHEMAS]
    outs = llm.generate([ids] * len(params), params)
    for p, out in zip(params, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        assert o.token_ids[-1] == llm.tokenizer.eos_token_id
        jsonschema.validate(json.loads(o.text), json.loads(p.structured_outputs.json))
    engine = llm.engine
    assert engine.structured_outputs.num_matchers == 0      # freed with their requests
    assert engine.structured_outputs.num_compiles - compiles == len(SCHEMAS)   # cached by key


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (SO(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (SO(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
        (SO(grammar='root ::= "Answer: " ("A" | "B" | "C")'),
         lambda t: t in ("Answer: A", "Answer: B", "Answer: C")),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for so, ok in cases:
        for temperature in (0.0, 1.0):
            # Sampled, a JSON object may wander inside a string past max_tokens (2 of
            # seeds 0-11 do); seed 0's closes.
            o = _chat(llm, "Is the sky blue? Answer briefly.",
                      SamplingParams(temperature=temperature, seed=0, max_tokens=60,
                                     structured_outputs=so))
            assert ok(o.text) and o.finish_reason == "stop", (so, o.text)


def test_a_complete_grammar_stops_even_with_ignore_eos_and_min_tokens(llm):
    o = _chat(llm, "Is the sky blue?", SamplingParams(
        temperature=0.0, max_tokens=50, ignore_eos=True, min_tokens=20,
        structured_outputs=SO(choice=["yes", "no"])))
    assert o.text in ("yes", "no") and o.finish_reason == "stop"
    assert o.token_ids[-1] == llm.tokenizer.eos_token_id


# -- beside other requests, across engine events ------------------------------------------------

def test_constrained_rows_leave_their_batch_neighbours_identical(llm):
    free = [_ids(llm, q) for q in ("Name three colours.", "What is 2 + 2?", "Say hello.")]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=120,
                                 structured_outputs=SO(json=SCHEMAS[3]))
    alone = llm.generate(free, [plain, seeded, plain])
    c_alone = llm.generate([_ids(llm, QUESTION)], constrained)[0].outputs[0].token_ids
    mixed = llm.generate([free[0], _ids(llm, QUESTION), free[1], free[2]],
                         [plain, constrained, seeded, plain])
    assert [m.outputs[0].token_ids for m in (mixed[0], mixed[2], mixed[3])] == \
        [a.outputs[0].token_ids for a in alone]
    assert mixed[1].outputs[0].token_ids == c_alone


def test_every_mask_of_a_plain_step_is_computed_beside_the_forward_pass(llm):
    sampler = llm.engine.runner.sampler
    before = sampler.num_prefetched_masks
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(json=SCHEMAS[1]))
    out = llm.generate([_ids(llm, QUESTION)], params)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    # One sampling call per output token (the prefill's and each decode step's).
    assert sampler.num_prefetched_masks - before == len(out.token_ids)


def test_chunked_prefill_preemption_resume_and_speculation_keep_the_output(f32_weights):
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=SCHEMAS[0]))
    base = LLM(dtype="float32", num_blocks=256, weights_from=f32_weights)
    ids = _ids(base, QUESTION)
    want = base.generate([ids], params)[0].outputs[0].token_ids
    jsonschema.validate(json.loads(base.tokenizer.decode(want)), SCHEMAS[0])

    # Chunked prefill (8-token chunks) and recompute preemption (too few blocks for four).
    tight = LLM(dtype="float32", num_blocks=9, block_size=16, max_num_batched_tokens=8,
                enable_prefix_caching=False, preemption_mode="recompute",
                weights_from=f32_weights)
    outs = tight.generate([ids] * 4, params)
    assert tight.engine.num_preemptions > 0
    assert all(o.outputs[0].token_ids == want for o in outs)

    # A resumed request (migrated from a dead worker): the matcher replays its tokens.
    engine = base.engine
    [req] = engine.add_request(ids, params, output_token_ids=want[:5])
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == want and req.status is RequestStatus.FINISHED_STOPPED

    # Speculative decoding (n-gram drafts, verified against the grammar).
    spec = LLM(dtype="float32", num_blocks=256, weights_from=f32_weights,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert spec.generate([ids], params)[0].outputs[0].token_ids == want
    assert spec.engine.scheduler.spec_stats.num_drafts > 0


# -- compiling off the engine loop -----------------------------------------------------------

# ~0.5-1 s to compile on this machine's CPUs: long enough to see steps go on meanwhile.
_SLOW_SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(80)], "properties": {
    f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},{i % 7 + 8}}}[0-9]{{2,{i % 4 + 3}}}$"}
    for i in range(80)}}


def test_a_worker_compiles_grammars_while_its_engine_loop_keeps_decoding(llm):
    """The decode worker compiles a new grammar on a thread of its own: a running
    stream keeps getting tokens during the compile (on the loop, it would stall)."""
    import asyncio
    import time

    from tandem.decode_worker.worker import DecodeWorker
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.runtime.outputs import WorkerRequest

    running = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=SO(json=_SLOW_SCHEMA))

    async def scenario():
        worker = DecodeWorker("colocated-0", EngineConfig(dtype="float32",
                                                          cache=CacheConfig(num_blocks=64)),
                              role="colocated", kv_transport=None, weights_from=llm.engine)
        arrivals: list[float] = []
        stop = asyncio.Event()

        async def consume():
            while not stop.is_set():
                for step in await worker.poll(0.2):
                    arrivals.extend(time.monotonic() for d in step.deltas
                                    if d.request_id == "r1" and d.new_token_ids)
        try:
            await worker.add_request(WorkerRequest("r1", tuple(_ids(llm, "Count to fifty.")),
                                                   running))
            consumer = asyncio.create_task(consume())
            while len(arrivals) < 2:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            await worker.add_request(WorkerRequest("r2", tuple(_ids(llm, QUESTION)), constrained))
            end = time.monotonic()
            stop.set()
            await consumer
            during = [t for t in arrivals if start < t < end]
            stats = worker.engine.structured_outputs
            assert await worker.abort("r1") and await worker.abort("r2")
            return end - start, len(during), stats.num_compiles, stats.num_cache_hits
        finally:
            await worker.shutdown()

    compile_s, steps_during, compiles, hits = asyncio.run(scenario())
    # Compiled once (on the worker's thread), then found in the cache by add_request
    # (and by the matcher's creation, if r2 reached a step before its abort).
    assert compiles == 1 and hits >= 1
    assert compile_s > 0.2, f"the schema compiled in {compile_s:.2f} s: too fast to tell"
    # Measured: ~30 deltas during a ~1 s compile; 1 when the loop compiled it (a step
    # already under way when the request arrived).
    assert steps_during >= 5, f"{steps_during} deltas of r1 during a {compile_s:.2f} s compile"
