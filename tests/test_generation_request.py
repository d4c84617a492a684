"""The front-end seam: both front ends build a GenerationRequest (gRPC from its
protobuf, HTTP from its OpenAI models), which one validator checks.

Runs the real tokenizer and validator; the HTTP conversion runs in the real
``OpenAIServer`` (its orchestrator is never reached before validation).
"""

from __future__ import annotations

import json
import struct

import pytest

from tandem.engine.sampling.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.router.generation_request import (ChatMessage, Constraint, GenerationRequest,
                                              SamplingFields)
from tandem.router.openai_api import OpenAIServer
from tandem.router.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                           _sampling_fields)
from tandem.router.server import request_from_proto
from tandem.router.validation import RequestValidator
from tandem.v1 import tandem_pb2 as pb

MAX_MODEL_LEN = 2048


def f32(x: float) -> float:
    """``x`` as a proto ``float`` field holds it."""
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture(scope="module")
def http(tokenizer) -> OpenAIServer:
    info = {"model_name": "m", "max_model_len": MAX_MODEL_LEN, "block_size": 16,
            "dtype": "float32", "vocab_size": tokenizer.vocab_size}
    return OpenAIServer(None, tokenizer, info)


@pytest.fixture(scope="module")
def validator(tokenizer) -> RequestValidator:
    return RequestValidator(tokenizer, MAX_MODEL_LEN)


# -- from the gRPC API's protobuf --------------------------------------------------------------

def test_a_proto_request_converts_field_by_field():
    request = pb.GenerateRequest(
        request_id="r-1", prompt="Hello", priority=-3, stream=True,
        sampling=pb.SamplingParams(
            n=2, max_tokens=7, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
            repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=2**64 - 1,
            stop_token_ids=[3, 4], stop=["\n\n", "END"], include_stop_str_in_output=True,
            ignore_eos=True, logprobs=2, min_tokens=1, skip_special_tokens=False,
            prompt_logprobs=0, choice=pb.Choices(choices=["yes", "no"]), length_penalty=0.5))
    assert request_from_proto(request) == GenerationRequest(
        request_id="r-1", prompt="Hello", priority=-3, stream=True,
        sampling=SamplingFields(
            n=2, max_tokens=7, temperature=f32(0.7), top_k=5, top_p=f32(0.9), min_p=f32(0.05),
            repetition_penalty=f32(1.1), presence_penalty=0.5, frequency_penalty=-0.5,
            seed=2**64 - 1, stop_token_ids=(3, 4), stop=("\n\n", "END"),
            include_stop_str_in_output=True, ignore_eos=True, logprobs=2, min_tokens=1,
            skip_special_tokens=False, prompt_logprobs=0,
            constraint=Constraint("choice", ("yes", "no")), length_penalty=0.5))


def test_unset_proto_fields_are_none_and_zero_values_are_sent():
    assert request_from_proto(pb.GenerateRequest()) == GenerationRequest()
    assert request_from_proto(pb.GenerateRequest(sampling=pb.SamplingParams())) == \
        GenerationRequest()
    # proto3 `optional`: an explicit 0 is sent, not the default.
    got = request_from_proto(pb.GenerateRequest(sampling=pb.SamplingParams(
        temperature=0.0, logprobs=0, json_object=True)))
    assert got.sampling == SamplingFields(temperature=0.0, logprobs=0,
                                          constraint=Constraint("json_object", True))


@pytest.mark.parametrize("request_, want", [
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3])),
     GenerationRequest(prompt_token_ids=(1, 2, 3))),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), GenerationRequest(prompt_token_ids=())),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user")])),
     GenerationRequest(messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "")))),
    (pb.GenerateRequest(prompt=""), GenerationRequest(prompt="")),
    (pb.GenerateRequest(sampling=pb.SamplingParams(json_schema='{"type": "object"}')),
     GenerationRequest(sampling=SamplingFields(
         constraint=Constraint("json", '{"type": "object"}')))),
])
def test_each_proto_input_and_constraint_converts(request_, want):
    got = request_from_proto(request_)
    assert got == want
    assert got.input_kind == want.input_kind


def test_a_request_with_two_inputs_is_a_front_end_bug():
    with pytest.raises(ValueError, match="at most one input may be set, got prompt and messages"):
        GenerationRequest(prompt="a", messages=())


# -- from the OpenAI HTTP models ---------------------------------------------------------------

def test_http_sampling_fields_convert_field_by_field():
    body = CompletionRequest(
        prompt="Hello", n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=2**64 - 1,
        stop="END", stop_token_ids=[3, 4], include_stop_str_in_output=True, ignore_eos=True,
        min_tokens=1, skip_special_tokens=False, guided_choice=["yes", "no"])
    fields, constraint_param = _sampling_fields(body, 7, 2)
    assert constraint_param == "guided_choice"
    # Floats in single precision, as the gRPC wire holds them.
    assert fields == SamplingFields(
        n=2, max_tokens=7, temperature=f32(0.7), top_k=5, top_p=f32(0.9), min_p=f32(0.05),
        repetition_penalty=f32(1.1), presence_penalty=0.5, frequency_penalty=-0.5,
        seed=2**64 - 1, stop_token_ids=(3, 4), stop=("END",), include_stop_str_in_output=True,
        ignore_eos=True, logprobs=2, min_tokens=1, skip_special_tokens=False,
        constraint=Constraint("choice", ("yes", "no")))


def test_http_defaults_convert_to_sent_values():
    fields, constraint_param = _sampling_fields(ChatCompletionRequest(messages=[]), None, None)
    assert constraint_param is None
    assert fields == SamplingFields(n=1)        # OpenAI's n defaults to 1, sent as such
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ChatCompletionRequest(messages=[], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    fields, constraint_param = _sampling_fields(body, None, None)
    assert (fields.constraint, constraint_param) == (
        Constraint("json", json.dumps(schema)), "response_format")


@pytest.mark.parametrize("kw, param, message", [
    (dict(n=-1), "n", "n: -1 is out of range"),
    (dict(top_k=2**31), "top_k", "top_k: 2147483648 is out of range"),
    (dict(seed=2**64), "seed", "seed: 18446744073709551616 is out of range"),
    (dict(min_tokens=-1), "min_tokens", "min_tokens: -1 is out of range"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids",
     "stop_token_ids: every id must be in [0, 2^32)"),
])
def test_http_integers_the_grpc_api_cannot_hold_are_refused(kw, param, message):
    with pytest.raises(APIError) as info:
        _sampling_fields(CompletionRequest(prompt="x", **kw), None, None)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


@pytest.mark.parametrize("prompt, inputs", [
    (["Hello", "World"], [dict(prompt="Hello"), dict(prompt="World")]),
    ([[1, 2, 3], [4]], [dict(token_ids=pb.TokenIds(ids=[1, 2, 3])),
                        dict(token_ids=pb.TokenIds(ids=[4]))]),
])
def test_a_completion_validates_as_the_same_grpc_request(http, validator, prompt, inputs):
    body = CompletionRequest(prompt=prompt, max_tokens=5, temperature=0.7, stop=["x"],
                             guided_regex="[a-z]+", priority=2, stream=True)
    got = http._completion_requests(body)[0]
    assert [v.request_id.rsplit("-", 1)[1] for v in got] == ["0", "1"]
    sampling = pb.SamplingParams(n=1, max_tokens=5, temperature=0.7, stop=["x"],
                                 regex="[a-z]+")
    want = [validator.validate(request_from_proto(pb.GenerateRequest(
        request_id=v.request_id, sampling=sampling, priority=2, stream=True, **inp)))
        for v, inp in zip(got, inputs)]
    assert got == want
    assert got[0].sampling_params.structured_outputs == StructuredOutputsParams(regex="[a-z]+")
    assert got[0].sampling_params.temperature == f32(0.7)


def test_a_chat_validates_as_the_same_grpc_request(http, validator, tokenizer):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], seed=7,
                                 max_completion_tokens=3, logprobs=True, top_logprobs=2)
    got = http._chat_request(body)
    want = validator.validate(request_from_proto(pb.GenerateRequest(
        request_id=got.request_id, chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Hi")]),
        sampling=pb.SamplingParams(n=1, max_tokens=3, seed=7, logprobs=2))),
        fill_max_tokens=False)
    assert got == want
    assert got.prompt_token_ids == tuple(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}]))
    assert got.sampling_params == SamplingParams(max_tokens=3, seed=7, logprobs=2)


def test_http_refusals_name_openai_fields_for_the_validators_paths(http, tokenizer):
    def refusal(make, body) -> tuple[str, str]:
        with pytest.raises(APIError) as info:
            make(body)
        return info.value.param, info.value.message

    chat = [{"role": "user", "content": "Hi"}]
    num_prompt = len(tokenizer.apply_chat_template(chat))
    assert num_prompt == 31
    assert refusal(http._completion_requests, CompletionRequest(prompt="x", top_p=1.5)) == (
        "top_p", "top_p: must be in (0, 1], got 1.5")
    assert refusal(http._completion_requests, CompletionRequest(prompt="x", temperature=1e39)) \
        == ("temperature", "temperature: must be a finite number, got inf")
    assert refusal(http._completion_requests, CompletionRequest(prompt=[1, 2**32])) == (
        "prompt", "prompt: token ids must be in [0, 2^32)")
    assert refusal(http._chat_request, ChatCompletionRequest(
        messages=[{"role": "us er", "content": "x"}]))[0] == "messages[0].role"
    assert refusal(http._chat_request, ChatCompletionRequest(
        messages=chat, max_completion_tokens=MAX_MODEL_LEN)) == (
        "max_completion_tokens", f"max_completion_tokens: prompt tokens (31) + max_tokens "
                                 f"({MAX_MODEL_LEN}) = {MAX_MODEL_LEN + 31} exceeds "
                                 f"max_model_len ({MAX_MODEL_LEN})")
    assert refusal(http._chat_request, ChatCompletionRequest(
        messages=chat, guided_json="{not json")) == (
        "guided_json", "guided_json: not valid JSON: Expecting property name enclosed in "
                       "double quotes: line 1 column 2 (char 1)")
    assert refusal(http._chat_request, ChatCompletionRequest(messages=chat, priority=2**31)) \
        == ("priority", "priority: 2147483648 is out of range")
