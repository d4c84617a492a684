"""KV transfer between tensor-parallel engines of different sizes, without Ray.

A 2-rank engine (rank 1 a real subprocess) and a 1-rank engine in this process,
their connectors joined by real Gloo pairs, one per (prefill rank, decode rank)
whose KV heads overlap (kvtransfer/sharded.py): the engines run a tiny random Llama
with the default model's 3 KV heads (tests/test_tensor_parallel_models.py's
``save_tiny_kv_checkpoint``), 0-1 on rank 0 and 2 on rank 1. Prefill on 2 ranks and
decode on 1, the reverse, and the 2-rank engine sending to itself (rank 0 to rank 0,
rank 1 to rank 1) each give the greedy tokens of one unsharded engine; the handshake
rides on pair (0, 0); an abort while a sharded consumer's ranks are receiving frees
every block once all ranks' parts ended; a head split that does not match the pairs
offered is refused by name. fp8 and int4 caches travel between sharded and
unsharded engines too (fp8: the scales' checksum over all the model's KV heads).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import RequestStatus
from tandem.kvtransfer.layout import KVLayoutMismatchError

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined a screw press with movable metal type, and",
    "Write one sentence about the ocean.",
    "A recipe for bread needs flour, water, salt and yeast; first",
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _wire(prefill: LLMEngine, prefill_id: str, decode: LLMEngine, decode_id: str) -> dict:
    rdv = decode.kv_connector.open_channel(prefill_id, "127.0.0.1",
                                           peer_layout=prefill.kv_connector.layout())
    prefill.kv_connector.connect(decode_id, rdv, decode.kv_connector.layout())
    return rdv


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory) -> str:
    from tests.test_tensor_parallel_models import save_tiny_kv_checkpoint

    return save_tiny_kv_checkpoint(tmp_path_factory.mktemp("tiny-kv"))


@pytest.fixture(scope="module")
def engines(tiny_kv):
    base = LLM(tiny_kv, dtype="float32", num_blocks=64)
    sharded = LLMEngine(dataclasses.replace(base.config, tensor_parallel_size=2),
                        kv_transport="gloo", transfer_timeout_s=20.0)
    single = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                       transfer_timeout_s=20.0)
    rdvs = {"tp2->tp1": _wire(sharded, "tp2-prefill", single, "tp1-decode"),
            "tp1->tp2": _wire(single, "tp1-prefill", sharded, "tp2-decode"),
            "tp2->tp2": _wire(sharded, "self-prefill", sharded, "self-decode")}
    yield base, sharded, single, rdvs
    single.kv_connector.close()
    sharded.kv_connector.close()
    sharded.shutdown()


def _step_both(engines_, until, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "engines did not get there"
        ran = False
        for engine in engines_:
            engine.step()
            engine.check_invariants()
            ran |= engine.last_step_ran
        if not ran:
            time.sleep(0.005)


def _idle(engine: LLMEngine) -> None:
    _step_both([engine], lambda: not engine.has_unfinished_requests())
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_the_pairs_carry_each_decode_rank_its_own_heads(engines):
    _, sharded, single, rdvs = engines
    assert sharded.kv_connector.layout()["kv_head_ranges"] == [[0, 2], [2, 1]]
    assert sharded.kv_connector.layout()["num_kv_heads"] == 3
    assert "kv_head_ranges" not in single.kv_connector.layout()
    pairs = {k: [p[:4] for p in v["pairs"]] for k, v in rdvs.items()}
    # [prefill rank, decode rank, first head, heads]
    assert pairs == {"tp2->tp1": [[0, 0, 0, 2], [1, 0, 2, 1]],
                     "tp1->tp2": [[0, 0, 0, 2], [0, 1, 2, 1]],
                     "tp2->tp2": [[0, 0, 0, 2], [1, 1, 2, 1]]}


@pytest.mark.parametrize("prefill_id, decode_id, direction", [
    ("tp2-prefill", "tp1-decode", "tp2->tp1"),
    ("tp1-prefill", "tp2-decode", "tp1->tp2"),
    ("self-prefill", "self-decode", "tp2->tp2"),
])
def test_greedy_tokens_equal_one_unsharded_engine(engines, prefill_id, decode_id, direction):
    base, sharded, single, _ = engines
    producer, consumer = {"tp2->tp1": (sharded, single), "tp1->tp2": (single, sharded),
                          "tp2->tp2": (sharded, sharded)}[direction]
    _transfer_and_compare(base, producer, prefill_id, consumer, decode_id, direction)


def _transfer_and_compare(base: LLM, producer: LLMEngine, prefill_id: str, consumer: LLMEngine,
                          decode_id: str, direction: str) -> None:
    """PROMPTS prefilled by ``producer`` and decoded by ``consumer`` give the greedy
    ids of ``base`` (one unsharded engine)."""
    prompts = [base.tokenizer.encode(p) for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    assert _transfer(producer, prefill_id, consumer, decode_id, direction, prompts) == want


def _transfer(producer: LLMEngine, prefill_id: str, consumer: LLMEngine, decode_id: str,
              direction: str, prompts: list[list[int]]) -> list[list[int]]:
    """``prompts`` prefilled by ``producer`` and decoded by ``consumer`` (greedy, 16
    tokens): the decode side's ids. Checks that the first token came on the channel
    and equals the prefill's, that every prompt's whole KV was sent, and that both
    engines' blocks are all free afterwards."""
    first = dataclasses.replace(GREEDY, max_tokens=1)
    sent_before = producer.kv_connector.kv_transfer_bytes
    decodes, prefills = [], []
    for i, prompt in enumerate(prompts):
        rid = f"{direction}-{i}"
        # Both calls at once, as the router makes them: the ticket and the first token
        # travel on pair (0, 0).
        ticket = producer.kv_connector.ticket_future(decode_id, rid, 0)
        decodes.append(consumer.add_request(prompt, GREEDY, rid,
                                            kv_transfer_params=KVTransferParams(prefill_id))[0])
        _step_both([consumer], lambda: ticket.done())
        prefills.append(producer.add_request(
            prompt, first, rid + "-p", kv_transfer_params=KVTransferParams(
                decode_id, ticket.result(timeout=10)))[0])
    _step_both({producer, consumer}, lambda: all(r.is_finished for r in decodes + prefills))
    assert [r.status for r in prefills] == [RequestStatus.FINISHED_LENGTH] * len(prompts)
    assert all(r.first_token_from_peer for r in decodes)
    assert [r.output_token_ids for r in prefills] == [r.output_token_ids[:1] for r in decodes]
    # Every prompt's whole KV left the producer (the whole layout's bytes, all heads).
    layout = consumer.kv_connector.layout()
    itemsize = consumer.kv_cache.tensor.element_size()
    per_block = 2 * layout["block_size"] * layout["num_kv_heads"] * layout["head_dim"] * itemsize
    blocks = sum(len(r.kv_load_ticket["dst_block_ids"])
                 - r.kv_load_ticket["num_cached_tokens"] // layout["block_size"] for r in decodes)
    assert producer.kv_connector.kv_transfer_bytes - sent_before == \
        blocks * per_block * layout["num_layers"]
    for engine in {producer, consumer}:
        _idle(engine)
    return [r.output_token_ids for r in decodes]


def test_abort_while_the_ranks_receive_frees_blocks_after_every_part_ended(engines):
    base, sharded, single, _ = engines
    prompt = base.tokenizer.encode(PROMPTS[0] + " and a tail no other test has")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kv = sharded.kv_cache_manager
    req = sharded.add_request(prompt, params, "abort-1",
                              kv_transfer_params=KVTransferParams("tp1-prefill"))[0]
    _step_both([sharded], lambda: req.kv_load_ticket is not None)
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    held = kv.num_blocks - kv.num_free_blocks
    assert sharded.abort_request("abort-1")
    assert kv.num_blocks - kv.num_free_blocks == held     # the parts may still land
    _idle(sharded)                    # rank 0's and rank 1's receives ended: blocks freed
    assert not sharded.scheduler.remote_kv.orphaned
    # The producer's send to the discarded ticket drains and is not an error there.
    done = single.add_request(prompt, dataclasses.replace(params, max_tokens=1), "abort-1-p",
                              kv_transfer_params=KVTransferParams("tp2-decode",
                                                                  req.kv_load_ticket))[0]
    _step_both([single], lambda: done.is_finished)
    assert done.status is RequestStatus.FINISHED_LENGTH
    _idle(single)
    _idle(sharded)


def test_a_head_split_that_does_not_match_the_pairs_is_refused(engines):
    _, sharded, single, rdvs = engines
    # The pairs a one-rank prefill worker was offered, given to the 2-rank one.
    with pytest.raises(KVLayoutMismatchError, match="KV head split mismatch"):
        sharded.kv_connector.connect("tp1-decode-2", rdvs["tp1->tp2"],
                                     single.kv_connector.layout())
    bad = {**sharded.kv_connector.layout(), "kv_head_ranges": [[0, 2], [1, 1]]}
    with pytest.raises(KVLayoutMismatchError, match="does not hold every one of the 3 KV heads"):
        single.kv_connector.open_channel("odd-prefill", "127.0.0.1", peer_layout=bad)


def _parts_only_at_near_ties(got: list[list[int]], reference: list[tuple],
                             other: list[tuple], label: str) -> int:
    """Each of ``got`` equals ``reference``'s ids (or ``other``'s) up to where they
    part, and there that reference's best two logprobs are within NEAR_TIE; returns
    how many equal ``reference`` throughout. ``reference``, ``other``: ``(ids,
    logprobs)`` per prompt."""
    from tests.test_tensor_parallel_models import NEAR_TIE

    def gap(ids: list[int], want: list[int], logprobs) -> float:
        if ids == want:
            return 0.0
        k = next(j for j, (a, b) in enumerate(zip(ids, want)) if a != b)
        (_, best), (_, second) = logprobs[k].top[:2]
        return best - second

    same = 0
    for i, ids in enumerate(got):
        gaps = [gap(ids, *reference[i]), gap(ids, *other[i])]
        same += ids == reference[i][0]
        assert min(gaps) < NEAR_TIE, (
            f"{label}: prompt {i} parts from both references' ids where their best two "
            f"logprobs are {gaps[0]:.3f} and {gaps[1]:.3f} nats apart")
    return same


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int4"])
def test_a_quantized_kv_cache_travels_between_sharded_and_unsharded_workers(kv_cache_dtype,
                                                                          tiny_kv):
    """fp8 (e4m3) caches: the 2-rank worker's layout carries the checksum of all
    three KV heads' scales (rank 1's head 2 gathered to rank 0), equal to one rank's,
    so both directions shake hands, and a peer with other scales is refused by name.
    The quantized bytes travel as they are (a pair's heads of them). The 2-rank
    worker sending to itself gives its own colocated ids for all prompts but at most
    one, which may part at a near tie (the batch around each request differs from
    the colocated run's); between 2 ranks and 1, the ids are one rank's up to where
    they part, and they part only at a near tie of one rank's distribution: a 2-rank
    prefill quantizes a few values on the other side of a rounding boundary (see
    tests/test_tensor_parallel_models.py, "quantized KV caches with 2 ranks")."""
    from tandem.engine.runtime.kv_scales import scales_checksum

    one_rank = LLM(tiny_kv, dtype="float32", num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    sharded = LLMEngine(dataclasses.replace(one_rank.config, tensor_parallel_size=2),
                        kv_transport="gloo", transfer_timeout_s=20.0)
    single = LLMEngine(one_rank.config, weights_from=one_rank.engine, kv_transport="gloo",
                       transfer_timeout_s=20.0)
    try:
        if kv_cache_dtype == "fp8_e4m3":
            assert sharded.kv_cache.tensor.dtype == torch.float8_e4m3fn
            assert tuple(sharded.kv_cache.scales.shape) == (2, 2, 2)     # rank 0's heads
            whole = scales_checksum(one_rank.engine.kv_cache.scales)      # [2, 2, 3]
            assert sharded.kv_connector.layout()["kv_scales_checksum"] == whole
            assert whole != scales_checksum(sharded.kv_cache.scales)
            other = {**single.kv_connector.layout(), "kv_scales_checksum": "0" * 16}
            with pytest.raises(KVLayoutMismatchError, match="kv_scales_checksum prefill="):
                sharded.kv_connector.connect("odd-decode", {"pairs": []}, other)
        else:
            assert sharded.kv_connector.layout()["dtype"] == "uint8"      # packed rows
        _wire(sharded, "tp2-prefill", single, "tp1-decode")
        _wire(single, "tp1-prefill", sharded, "tp2-decode")
        _wire(sharded, "self-prefill", sharded, "self-decode")
        prompts = [one_rank.tokenizer.encode(p) for p in PROMPTS]
        if kv_cache_dtype == "int4":
            # Whole blocks: a prompt ending inside a block arrives open and is
            # quantized again from its rows (docs/kv_cache_int4.md, "KV transfer").
            prompts = [(p * 3)[:32] for p in prompts]
        logprobs = dataclasses.replace(GREEDY, logprobs=2)
        colocated = [sharded.add_request(p, logprobs, f"{kv_cache_dtype}-colocated-{i}")[0]
                     for i, p in enumerate(prompts)]
        _step_both([sharded], lambda: all(r.is_finished for r in colocated))
        colocated = [(r.output_token_ids, r.output_logprobs) for r in colocated]
        one = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
               for o in one_rank.generate(prompts, logprobs)]
        same = {}
        for direction, ends in (("tp2->tp2", (sharded, "self-prefill", sharded, "self-decode")),
                                ("tp2->tp1", (sharded, "tp2-prefill", single, "tp1-decode")),
                                ("tp1->tp2", (single, "tp1-prefill", sharded, "tp2-decode"))):
            got = _transfer(*ends, f"{kv_cache_dtype} {direction}", prompts)
            # The prefill side's colocated run shares its KV; the decode side's shares
            # the decode steps' numerics. Each prompt follows one of them, parting at
            # most at a near tie.
            prefill_side = colocated if direction.startswith("tp2") else one
            decode_side = colocated if direction.endswith("tp2") else one
            same[direction] = _parts_only_at_near_ties(got, prefill_side, decode_side, direction)
        # The 2-rank worker's own KV, sent rank to rank: its colocated ids, but for the
        # batch around each request.
        assert same["tp2->tp2"] >= len(prompts) - 1, same
    finally:
        single.kv_connector.close()
        sharded.kv_connector.close()
        sharded.shutdown()
