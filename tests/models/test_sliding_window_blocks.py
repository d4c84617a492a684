"""Sliding-window KV on a tiny Mistral (window 16, every layer) in float32: blocks
that every layer's window has passed are released, and the greedy tokens stay
transformers' for prompts shorter (7 tokens) and much longer (100 and 60) than the
window, with prefix caching, chunked prefill, swap and recompute preemption,
n-gram speculative decoding and a disaggregated (Gloo) transfer. A Gemma 2 with a
global layer keeps every block.

Block size 4: after a decode step a request with ``n`` computed tokens holds
``cdiv(n, 4) - max(0, n - 16) // 4`` blocks (4 or 5) where a full-attention model
holds ``cdiv(n, 4)`` (28 at the 100-token prompt's last step).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tandem.engine.kv.kv_connector import KVTransferParams
from tandem.engine.llm import LLM, LLMEngine
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import RequestStatus
from tandem.kvtransfer.layout import KVLayout
from tests.models.conftest import VOCAB, hf_greedy, save_tiny_checkpoint
from tests.test_disagg_engine import _run

BS, WINDOW, NUM_TOKENS = 4, 16, 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 100, 60)]


def _windowed_blocks(n: int) -> int:
    """Blocks a request holds after a decode step that left ``n`` tokens computed."""
    return _cdiv(n, BS) - max(0, n - WINDOW) // BS


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window16")
    hf = save_tiny_checkpoint(path, "MistralConfig", sliding_window=WINDOW)
    return str(path), [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]


class BlockWatch:
    """``step_callback``: invariants every step, and per running request (keyed by
    its prompt length) the blocks it holds after each step, checked with ``exact``
    after a plain decode step; a swapped request's host table holds only the
    blocks it held (null slots take no host block)."""

    def __init__(self, exact=_windowed_blocks):
        self.exact = exact
        self.computed: dict[int, int] = {}
        self.held: dict[int, list[int]] = {}
        self.num_decode_checks = 0
        self.num_swapped_checks = 0

    def __call__(self, engine: LLMEngine) -> None:
        engine.check_invariants()
        kv = engine.kv_cache_manager
        for req in engine.scheduler.running:
            key, n = req.num_prompt_tokens, req.num_computed_tokens
            held = kv.num_held_blocks(req.request_id)
            self.held.setdefault(key, []).append(held)
            if self.computed.get(key) == n - 1 and self.exact is not None:
                assert held == self.exact(n), (key, n, kv.get_block_ids(req.request_id))
                self.num_decode_checks += 1
            self.computed[key] = n
        for req in engine.scheduler.swapped:
            rid = req.request_id
            assert (len(kv.get_host_block_ids(rid)) + kv.num_skipped_blocks(rid)
                    == _cdiv(req.num_computed_tokens, BS))
            self.num_swapped_checks += 1


def _check(llm: LLM, watch: BlockWatch, reference) -> None:
    outs = llm.generate(_prompts(), GREEDY, step_callback=watch)
    assert [o.outputs[0].token_ids for o in outs] == reference
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks == kv.num_blocks - 1
    # The 100-token prompt's last step: 110 tokens computed, 5 blocks (28 unwindowed).
    assert watch.held[100][-1] == _windowed_blocks(110) == 5
    assert watch.num_decode_checks > 0


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prompt", "chunked"])
def test_blocks_outside_the_window_are_released(mistral, budget):
    path, reference = mistral
    llm = LLM(path, dtype="float32", block_size=BS, num_blocks=128,
              max_num_batched_tokens=budget)
    watch = BlockWatch()
    _check(llm, watch, reference)
    if budget == 24:
        # A chunk holds its 24 tokens and the window before them: at most 11 blocks.
        assert max(watch.held[100]) <= llm.engine.kv_cache_manager.max_blocks_per_step(24) == 11
    else:
        assert watch.held[100][0] == 25                 # the whole prompt in one step


def test_prefix_cache_hits_of_released_blocks(mistral):
    """The blocks a finished request released stay cached: the same prompts again
    hit every full block but the last one's (4 + 96 + 56 tokens) and take only the
    hits inside the window."""
    path, reference = mistral
    llm = LLM(path, dtype="float32", block_size=BS, num_blocks=128)
    llm.generate(_prompts(), GREEDY)
    hits_before = llm.engine.kv_cache_manager.prefix_cache_hits
    watch = BlockWatch()
    outs = llm.generate(_prompts(), GREEDY, step_callback=watch)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.kv_cache_manager.prefix_cache_hits - hits_before == 4 + 96 + 56
    # 100-token prompt: 24 hits, the first query at 96 reads from 81: blocks 20..24.
    assert watch.held[100][0] == 5


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_released_blocks(mistral, mode):
    """14 blocks (13 usable) hold each request's window but not all three at once;
    the 100-token prompt alone would need 28 blocks without the window."""
    path, reference = mistral
    llm = LLM(path, dtype="float32", block_size=BS, num_blocks=14, num_host_blocks=64,
              preemption_mode=mode, max_num_batched_tokens=24)
    assert llm.engine.max_model_len == 256            # not capped at 13 blocks' 52 tokens
    watch = BlockWatch()
    _check(llm, watch, reference)
    assert max(max(h) for h in watch.held.values()) <= 11       # max_blocks_per_step(24)
    stats = llm.engine.stats("offline", "colocated")
    preempted = stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions
    assert preempted > 0 and stats.num_preemptions == preempted, stats
    assert stats.num_blocks == 13 and stats.num_free_blocks == 13
    if mode == "swap":
        assert watch.num_swapped_checks > 0


def test_ngram_speculation_with_released_blocks(mistral):
    path, reference = mistral
    llm = LLM(path, dtype="float32", block_size=BS, num_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    watch = BlockWatch(exact=None)      # drafts extend the table past the decode token
    outs = llm.generate(_prompts(), GREEDY, step_callback=watch)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.stats("offline", "colocated")
    assert stats.spec_decode_num_draft_tokens > 0, stats
    kv = llm.engine.kv_cache_manager
    assert max(watch.held[100][1:]) <= kv.max_blocks_per_step(1 + 3) == 6
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_speculation_chunks_and_preemption_together(mistral, mode):
    path, reference = mistral
    llm = LLM(path, dtype="float32", block_size=BS, num_blocks=14, num_host_blocks=64,
              preemption_mode=mode, max_num_batched_tokens=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1})
    watch = BlockWatch(exact=None)
    outs = llm.generate(_prompts(), GREEDY, step_callback=watch)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.stats("offline", "colocated")
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0, stats
    assert max(max(h) for h in watch.held.values()) <= 11       # max_blocks_per_step(24)
    assert stats.num_free_blocks == stats.num_blocks == 13


def test_disaggregated_transfer_sends_only_the_window(mistral):
    """The decode side reserves the blocks its first decode reads (prompt of 100:
    the query at 100 reads 85..100, blocks 21..24) and receives only those."""
    path, reference = mistral
    prompt = _prompts()[1]
    base = LLM(path, dtype="float32", block_size=BS, num_blocks=64)
    producer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    consumer = LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                         transfer_timeout_s=10.0)
    try:
        rdv = consumer.kv_connector.open_channel("prefill-0", "127.0.0.1")
        producer.kv_connector.connect("decode-0", rdv, consumer.kv_connector.layout())
        req = consumer.add_request(prompt, GREEDY, "r",
                                   kv_transfer_params=KVTransferParams("prefill-0"))[0]
        _run(consumer, lambda: req.kv_load_ticket is not None)
        ticket = req.kv_load_ticket
        kv = consumer.kv_cache_manager
        assert kv.num_held_blocks("r") == 4 and kv.num_skipped_blocks("r") == 21
        assert ticket["dst_block_ids"][:21] == [0] * 21 and ticket["num_cached_tokens"] == 84
        first = dataclasses.replace(GREEDY, max_tokens=1)
        done = producer.add_request(prompt, first, "r",
                                    kv_transfer_params=KVTransferParams("decode-0", ticket))[0]
        _run(producer, lambda: done.is_finished)
        layout = KVLayout.from_dict(consumer.kv_connector.layout())
        assert producer.kv_connector.kv_transfer_bytes == (
            4 * layout.bytes_per_block_per_layer * layout.num_layers)
        consumer.start_decode("r", done.output_token_ids[0])
        _run(consumer, lambda: req.is_finished)
        assert req.status is RequestStatus.FINISHED_LENGTH
        assert req.output_token_ids == reference[1]
        for engine in (producer, consumer):
            _run(engine, lambda: not engine.has_unfinished_requests())
            assert engine.kv_cache_manager.num_free_blocks == 63
    finally:
        producer.kv_connector.close()
        consumer.kv_connector.close()




def test_a_model_with_a_global_layer_keeps_every_block(tmp_path):
    """Gemma 2: layer 0 slides (window 16), layer 1 attends to everything."""
    hf = save_tiny_checkpoint(tmp_path, "Gemma2Config", sliding_window=WINDOW,
                              query_pre_attn_scalar=32)
    prompts = _prompts()[:2]
    reference = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", block_size=BS, num_blocks=64,
              max_num_batched_tokens=24)
    kv = llm.engine.kv_cache_manager
    assert kv.sliding_window is None and kv.block_pool.null_block is None
    watch = BlockWatch(exact=lambda n: _cdiv(n, BS))
    outs = llm.generate(prompts, GREEDY, step_callback=watch)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert watch.held[100][-1] == 28 and watch.num_decode_checks > 0
    assert kv.num_free_blocks == kv.num_blocks == 64
