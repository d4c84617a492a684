"""KV fencing on a real Gloo pair inside one process (two engines, float32): a late or
zombie producer never writes into blocks that were reassigned.

* A load the consumer cancelled (abort) frees its blocks once the load ended;
  they go to another request whose own KV lands; when the producer then sends
  the first request's layers late, they are dropped on arrival: the second
  request's KV is untouched and its greedy tokens equal a single engine's.
* A load for a producer generation other than the channel's fails at once, and
  the request is prefilled on the consumer with the same tokens.
* A producer refuses a ticket for another generation of itself: it sends nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from tests.test_disagg_engine import _idle, _run

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.scheduling.request import RequestStatus
from tandem.engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GENERATION = 3            # the producer's incarnation in the cluster registry
PROMPT_A = ("The history of the printing press begins in the fifteenth century, when a "
            "goldsmith in Mainz combined a screw press with movable metal type, and within "
            "fifty years presses were at work in more than two hundred cities across Europe, "
            "printing bibles, calendars, pamphlets and the first newspapers for a public that "
            "was learning to read.")
PROMPT_B = ("Rivers shape the land they cross: they carve valleys, carry silt to the sea and "
            "build deltas where they slow down, and people have settled along their banks "
            "since the first farms, for water, fish, transport and fertile soil; the great "
            "civilisations of antiquity grew along the Nile, the Tigris, the Euphrates, the "
            "Indus and the Yellow River.")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(f32_weights):
    base = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    # A small consumer pool, so that a freed reservation's blocks are handed out again.
    small = dataclasses.replace(base.config,
                                cache=dataclasses.replace(base.config.cache, num_blocks=8))
    producer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    consumer = LLMEngine(small, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    rdv = consumer.kv_connector.open_channel("prefill-0", "127.0.0.1", peer_generation=GENERATION)
    producer.kv_connector.connect("decode-0", rdv, consumer.kv_connector.layout(),
                                  generation=GENERATION)
    yield base, producer, consumer
    producer.kv_connector.close()
    consumer.kv_connector.close()


def _reserve(consumer: LLMEngine, rid: str, prompt: list[int], **params):
    req = consumer.add_request(prompt, PARAMS, rid,
                               kv_transfer_params=KVTransferParams("prefill-0", **params))[0]
    _run(consumer, lambda: req.kv_load_ticket is not None)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    return req, req.kv_load_ticket


def _prefill(producer: LLMEngine, rid: str, prompt: list[int], ticket: dict):
    req = producer.add_request(prompt, dataclasses.replace(PARAMS, max_tokens=1), rid,
                               kv_transfer_params=KVTransferParams("decode-0", ticket))[0]
    _run(producer, lambda: req.is_finished)
    return req


def _receiver(consumer: LLMEngine):
    return consumer.kv_connector._receivers["prefill-0"]     # the one Gloo pair


def test_a_zombie_producer_never_writes_into_reassigned_blocks(pair):
    base, producer, consumer = pair
    prompt_a, prompt_b = base.tokenizer.encode(PROMPT_A), base.tokenizer.encode(PROMPT_B)
    want = base.generate([prompt_b], PARAMS)[0].outputs[0].token_ids
    bs = base.config.cache.block_size
    req_a, ticket_a = _reserve(consumer, "A", prompt_a, attempt=2, peer_generation=GENERATION)
    assert (ticket_a["attempt"], ticket_a["producer_generation"]) == (2, GENERATION)
    # The router gave A up (e.g. its prefill worker looked dead) before any layer was sent.
    assert consumer.abort_request("A")
    _idle(consumer)                                   # the cancelled load ended: blocks free
    req_b, ticket_b = _reserve(consumer, "B", prompt_b, peer_generation=GENERATION)
    reused = set(ticket_a["dst_block_ids"]) & set(ticket_b["dst_block_ids"])
    assert reused, "B must get some of A's blocks for this test to mean anything"
    done_b = _prefill(producer, "B", prompt_b, ticket_b)
    consumer.start_decode("B", done_b.output_token_ids[0])
    _run(consumer, lambda: req_b.status is RequestStatus.RUNNING)    # B's KV landed
    kv = consumer.kv_cache.tensor
    full = ticket_b["dst_block_ids"][:len(prompt_b) // bs]     # written by the load only
    landed = kv[:, :, full].clone()

    # The zombie: the producer runs A's prefill now and sends its layers to A's ticket.
    receiver = _receiver(consumer)
    dropped = receiver.num_dropped_layers
    done_a = _prefill(producer, "A", prompt_a, ticket_a)
    assert done_a.status is RequestStatus.FINISHED_LENGTH    # the wire took the bytes
    num_layers = base.engine.model_config.num_layers
    deadline = time.monotonic() + 10
    while receiver.num_dropped_layers < dropped + num_layers:
        assert time.monotonic() < deadline, "the late layers never reached the consumer"
        time.sleep(0.01)
    assert receiver.num_dropped_layers == dropped + num_layers
    assert receiver.staged_transfer_ids() == []
    assert bool((kv[:, :, full] == landed).all())           # B's KV untouched

    _run(consumer, lambda: req_b.is_finished)
    assert req_b.output_token_ids == want
    _idle(consumer)
    _idle(producer)


def test_a_load_for_a_stale_generation_fails_at_once_and_is_prefilled_here(pair, caplog):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode("Write one sentence about the ocean.")
    want = base.generate([prompt], PARAMS)[0].outputs[0].token_ids
    with caplog.at_level(logging.WARNING, logger="tandem.kvtransfer.connector"):
        req, ticket = _reserve(consumer, "S", prompt, peer_generation=GENERATION - 1)
        assert ticket["producer_generation"] == GENERATION     # the channel's
        _run(consumer, lambda: req.kv_load_finished)           # at once: nothing was sent
    assert not req.kv_load_ok
    assert f"generation {GENERATION - 1}" in caplog.text and f"generation {GENERATION}" in caplog.text
    consumer.start_decode("S", None)                   # the router falls back
    _run(consumer, lambda: req.is_finished)
    assert req.output_token_ids == want
    _idle(consumer)


def test_a_producer_refuses_a_ticket_for_another_generation_of_itself(pair):
    base, producer, consumer = pair
    prompt = base.tokenizer.encode("Name three colours of the rainbow.")
    want = base.generate([prompt], PARAMS)[0].outputs[0].token_ids
    req, ticket = _reserve(consumer, "R", prompt, peer_generation=GENERATION)
    sent = producer.kv_connector.kv_transfer_bytes
    dropped = _receiver(consumer).num_dropped_layers
    forged = dict(ticket, producer_generation=GENERATION + 1)
    done = _prefill(producer, "R", prompt, forged)
    assert done.status is RequestStatus.FINISHED_ERROR
    assert f"generation {GENERATION + 1}" in done.stop_reason
    assert f"generation {GENERATION}" in done.stop_reason
    assert producer.kv_connector.kv_transfer_bytes == sent             # nothing sent
    _idle(producer)
    consumer.start_decode("R", None)            # the prefill failed: prefill here
    _run(consumer, lambda: req.is_finished)
    assert req.output_token_ids == want
    assert _receiver(consumer).num_dropped_layers == dropped
    _idle(consumer)
