"""Disaggregation inside the engine, without Ray: a producer (prefill) and a consumer
(decode) engine in one process, their KV connectors joined by a real Gloo pair.

Checks the consumer's WAITING_FOR_REMOTE_KV state end to end on the real model:
greedy tokens equal a single engine's, an abort while layers are in flight frees
every block once the load ends (and none of them enters the prefix cache), and a
failed remote prefill is computed on the consumer with the same tokens. And the
handshake on the channel itself: the producer takes the consumer's ticket from
the pair and hands the first token back on it, with no caller in between.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.scheduling.request import RequestStatus
from tandem.engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
          "goldsmith in Mainz combined a screw press with movable metal type, and")


@pytest.fixture(scope="module")
def pair(f32_weights):
    base = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    producer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    consumer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    rdv = consumer.kv_connector.open_channel("prefill-0", "127.0.0.1")
    producer.kv_connector.connect("decode-0", rdv, consumer.kv_connector.layout())
    yield base, producer, consumer
    producer.kv_connector.close()
    consumer.kv_connector.close()


def _run(engine: LLMEngine, until, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if until():
            return
        engine.step()
        engine.check_invariants()
    raise AssertionError("engine did not get there")


def _run_until(engine: LLMEngine, until, timeout_s: float = 20.0) -> None:
    """Step until ``until()``, waiting (not stepping idly) for what the pair brings."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "engine did not get there"
        engine.step()
        engine.check_invariants()
        if not engine.last_step_ran:
            time.sleep(0.005)


def _idle(engine: LLMEngine) -> None:
    _run(engine, lambda: not engine.has_unfinished_requests())
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def _reserve(consumer: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    req = consumer.add_request(prompt, params, rid,
                               kv_transfer_params=KVTransferParams("prefill-0"))[0]
    _run(consumer, lambda: req.kv_load_ticket is not None)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    return req, req.kv_load_ticket


def _prefill(producer: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
             ticket: dict):
    first = dataclasses.replace(params, max_tokens=1)
    req = producer.add_request(prompt, first, rid,
                               kv_transfer_params=KVTransferParams("decode-0", ticket))[0]
    _run(producer, lambda: req.is_finished)
    return req


def test_remote_prefill_decodes_the_same_tokens(pair):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    req, ticket = _reserve(consumer, "r1", prompt, params)
    num_blocks = -(-len(prompt) // base.config.cache.block_size)
    assert len(ticket["dst_block_ids"]) == num_blocks and ticket["num_cached_tokens"] == 0
    done = _prefill(producer, "r1", prompt, params, ticket)
    assert done.status is RequestStatus.FINISHED_LENGTH and done.output_token_ids == want[:1]
    assert producer.kv_connector.kv_transfer_bytes > 0
    consumer.start_decode("r1", done.output_token_ids[0])
    _run(consumer, lambda: req.is_finished)
    assert req.output_token_ids == want
    _idle(consumer)
    _idle(producer)


def test_abort_while_layers_are_in_flight_frees_blocks_after_the_load(pair):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode(PROMPT + " a second, different tail of text")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kv = consumer.kv_cache_manager
    cached_before = kv.block_pool.num_cached_blocks
    req, ticket = _reserve(consumer, "r2", prompt, params)
    held = kv.num_blocks - kv.num_free_blocks
    assert held == len(ticket["dst_block_ids"])
    assert consumer.abort_request("r2")
    sch = consumer.scheduler
    assert "r2" in sch.remote_kv.orphaned                # layers may still land: blocks kept
    assert kv.num_blocks - kv.num_free_blocks == held
    consumer.check_invariants()
    _idle(consumer)                                      # the cancelled load ends, blocks freed
    assert not sch.remote_kv.orphaned
    assert kv.block_pool.num_cached_blocks == cached_before   # nothing partial was cached
    # Only the prefix shared with the first test's prompt (cached before) is found.
    bs = base.config.cache.block_size
    assert ticket["num_cached_tokens"] == bs
    assert len(kv.find_cached_prefix(prompt)) * bs == ticket["num_cached_tokens"]
    # The producer's send to the discarded ticket drains and is not an error there.
    done = _prefill(producer, "r2", prompt, params, ticket)
    assert done.status is RequestStatus.FINISHED_LENGTH
    _idle(producer)
    _idle(consumer)


def test_failed_remote_prefill_is_computed_on_the_consumer(pair):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode("Write one sentence about the ocean.")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    req, ticket = _reserve(consumer, "r3", prompt, params)
    consumer.start_decode("r3", None)                    # the prefill worker failed
    _run(consumer, lambda: req.is_finished)
    assert req.output_token_ids == want
    assert req.kv_transfer_params is None
    _idle(consumer)


def test_a_late_failed_prefill_word_finds_the_prompt_computed_here_already(pair):
    # The router's "the prefill failed" can come after the consumer gave the remote
    # prefill up on its own (its KV load timed out): the prompt is computed here
    # already, so the word changes nothing (it used to raise KeyError: the request
    # failed with INTERNAL).
    base, producer, consumer = pair
    prompt = base.tokenizer.encode("Write one sentence about the mountains.")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    req, _ = _reserve(consumer, "r3b", prompt, params)
    consumer.start_decode("r3b", None)                   # the consumer's own give-up
    _run(consumer, lambda: req.num_output_tokens > 0)
    assert consumer.start_decode("r3b", None) is None    # the router's, late
    _run(consumer, lambda: req.is_finished)
    assert req.output_token_ids == want
    with pytest.raises(KeyError, match="r3c"):          # an unknown request still raises
        consumer.start_decode("r3c", None)
    _idle(consumer)


def test_save_to_an_unknown_peer_ends_the_request_with_an_error(pair):
    base, producer, _ = pair
    prompt = base.tokenizer.encode("Hello there")
    ticket = {"request_id": "r4", "transfer_id": 99, "dst_block_ids": [0],
              "num_cached_tokens": 0, "num_tokens": len(prompt),
              "layout": producer.kv_connector.layout()}
    req = producer.add_request(prompt, SamplingParams(max_tokens=1), "r4",
                               kv_transfer_params=KVTransferParams("decode-9", ticket))[0]
    _run(producer, lambda: req.is_finished)
    assert req.status is RequestStatus.FINISHED_ERROR
    assert req.stop_reason == "no KV channel to decode-9"
    _idle(producer)


def _taken_first_tokens(consumer: LLMEngine) -> list[str]:
    taken: list[str] = []
    consumer.on_remote_first_token = taken.append
    return taken


def test_ticket_and_first_token_travel_on_the_kv_channel(pair):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode(PROMPT + " then spread across Europe within decades")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = base.generate([prompt], params)[0].outputs[0]
    # The producer asks first (the router sends both requests at once).
    ticket_future = producer.kv_connector.ticket_future("decode-0", "r5", 0)
    assert not ticket_future.done()
    taken = _taken_first_tokens(consumer)
    try:
        req = consumer.add_request(prompt, params, "r5",
                                   kv_transfer_params=KVTransferParams("prefill-0"))[0]
        _run(consumer, lambda: req.kv_load_ticket is not None)
        assert ticket_future.result(timeout=10) == req.kv_load_ticket
        done = _prefill(producer, "r5", prompt, params, ticket_future.result())
        assert done.status is RequestStatus.FINISHED_LENGTH
        # No start_decode: the first token came on the pair.
        _run_until(consumer, lambda: req.is_finished)
        assert taken == ["r5"] and req.first_token_from_peer
        assert req.output_token_ids == want.token_ids
        assert req.output_logprobs[0] == done.output_logprobs[0]
        assert [lp.token_id for lp in req.output_logprobs] == want.token_ids
    finally:
        consumer.on_remote_first_token = None
    _idle(consumer)
    _idle(producer)


def test_a_late_failed_prefill_word_gets_the_token_the_channel_brought(pair):
    """The prefill worker handed its token over, then its reply to the router was
    lost: the router's "prefill failed" gets that token back, the request decodes on."""
    base, producer, consumer = pair
    prompt = base.tokenizer.encode("Write one sentence about the mountains, please.")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    taken = _taken_first_tokens(consumer)
    try:
        req, ticket = _reserve(consumer, "r6", prompt, params)
        _prefill(producer, "r6", prompt, params, ticket)
        _run_until(consumer, lambda: taken == ["r6"])
        assert consumer.start_decode("r6", None) == (want[0], None)
        _run_until(consumer, lambda: req.is_finished)
        assert req.output_token_ids == want
    finally:
        consumer.on_remote_first_token = None
    _idle(consumer)
    _idle(producer)


def test_a_forgotten_ticket_is_dropped_when_it_comes(pair):
    """An aborted prefill stops waiting; the ticket posted afterwards is not kept."""
    base, producer, consumer = pair
    connector = producer.kv_connector
    waiting = connector.ticket_future("decode-0", "r7", 0)
    connector.forget_ticket("decode-0", "r7")
    assert waiting.cancelled()
    forgotten, _ = _reserve(consumer, "r7", base.tokenizer.encode("A prompt nobody prefills."),
                            SamplingParams(max_tokens=2))
    # Tickets arrive in order: once the next one is here, r7's was handled.
    marker = connector.ticket_future("decode-0", "r8", 0)
    _reserve(consumer, "r8", base.tokenizer.encode("Another prompt."), SamplingParams(max_tokens=2))
    marker.result(timeout=10)
    assert not [key for key in connector._early_tickets if key[1] == "r7"]
    assert consumer.abort_request("r7") and consumer.abort_request("r8")
    _idle(consumer)
