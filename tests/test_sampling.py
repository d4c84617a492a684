"""Sampling: parameter validation, the sampler's distributions and penalties on
synthetic logits, and seeded / n > 1 / logprobs behaviour on the real model."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine.scheduling.request import Request
from tandem.engine.sampling.sampler import Sampler
from tandem.engine.sampling.sampling_params import InvalidParameterError, SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.2}, "min_p"),
    ({"n": 0}, "n"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": 1.5}, "seed"),
    ({"n": True}, "n"), ({"logprobs": 2.5}, "logprobs"), ({"top_k": 4.0}, "top_k"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": float("nan")}, "min_p"), ({"stop_token_ids": ("2",)}, "stop_token_ids"),
    ({"stop_token_ids": (2.0,)}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": 5}, "stop"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")


def test_params_normalise_numpy_scalars_and_none():
    np = pytest.importorskip("numpy")
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.uint64(2**64 - 1),
                       stop_token_ids=np.array([3, 4]), stop=None)
    assert (p.n, p.temperature, p.seed, p.stop_token_ids, p.stop) == (2, 0.5, 2**64 - 1, (3, 4), ())
    assert all(type(v) is int for v in (p.n, p.seed, *p.stop_token_ids))
    assert type(p.temperature) is float
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_sample_seeds_wrap_modulo_2_64():
    assert [SamplingParams(seed=2**64 - 2).sample_seed(i) for i in range(4)] == [
        2**64 - 2, 2**64 - 1, 0, 1]
    assert SamplingParams(seed=7).sample_seed(0) == 7
    with pytest.raises(ValueError, match="no seed"):
        SamplingParams().sample_seed(0)
    with pytest.raises(ValueError, match="sample_index"):
        SamplingParams(seed=1).sample_seed(-1)


def _req(params: SamplingParams, prompt=(5, 6), output=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params, eos_token_id=2)
    r.output_token_ids.extend(output)
    return r


PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])


def _draw(params: SamplingParams, n: int, logits=None) -> torch.Tensor:
    logits = PROBS.log() if logits is None else logits
    sampler = Sampler(torch.Generator().manual_seed(1))
    r = _req(params)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[sampler(logits[None].clone(), [r])[0].token_id] += 1
    return counts / n


def check_within_5_sigma(freq: torch.Tensor, expect: torch.Tensor, n: int) -> None:
    # 5 standard deviations of a binomial proportion: fails by chance with p < 1e-6.
    sd = (expect * (1 - expect) / n).sqrt()
    assert torch.all((freq - expect).abs() <= 5 * sd + 1e-9), (freq, expect)


def test_temperature_one_matches_distribution():
    n = 4000
    check_within_5_sigma(_draw(SamplingParams(temperature=1.0), n), PROBS, n)


def test_temperature_sharpens():
    n = 4000
    p = PROBS.pow(1 / 0.5)
    check_within_5_sigma(_draw(SamplingParams(temperature=0.5), n), p / p.sum(), n)


def test_tiny_temperature_tends_to_greedy_instead_of_nan():
    # 30 / 1e-40 overflows float32: softmax of several +inf was NaN and the
    # draw (then an exponential race) returned token 0 whatever the logits.
    logits = torch.tensor([1.0, 30.0, 29.0, 30.0, -5.0])
    freq = _draw(SamplingParams(temperature=1e-40), 400, logits)
    assert freq[0] == freq[2] == freq[4] == 0
    assert 0.3 < freq[1] < 0.7 and freq[1] + freq[3] == 1        # the tied maxima


def test_tiny_repetition_penalty_keeps_logits_finite():
    # 1e-45 divides seen positive logits to +inf; they are clamped to the largest
    # float, so sampling picks among them instead of NaN's token 0.
    row = torch.tensor([[2.0, 1.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(repetition_penalty=1e-45)
    sampler = Sampler(torch.Generator().manual_seed(1))
    picks = {sampler(row.clone(), [_req(p, prompt=(1, 3))])[0].token_id for _ in range(200)}
    assert picks == {1, 3}
    greedy = SamplingParams(repetition_penalty=1e-45, temperature=0.0)
    assert Sampler()(row.clone(), [_req(greedy, prompt=(1, 3))])[0].token_id == 1


def test_top_k_top_p_min_p_truncate():
    n = 3000
    check_within_5_sigma(_draw(SamplingParams(top_k=2), n), torch.tensor([2 / 3, 1 / 3, 0, 0]), n)
    # top_p 0.7: 0.5 < 0.7 so token 1 is kept too (mass before it 0.5 < 0.7); token 2 is not.
    check_within_5_sigma(_draw(SamplingParams(top_p=0.7), n), torch.tensor([2 / 3, 1 / 3, 0, 0]), n)
    # min_p 0.4: keep p >= 0.2 -> tokens 0 and 1.
    check_within_5_sigma(_draw(SamplingParams(min_p=0.4), n), torch.tensor([2 / 3, 1 / 3, 0, 0]), n)


def test_greedy_and_ties_take_first_max():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 0.0]])
    out = sampler(logits, [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0))])
    assert [o.token_id for o in out] == [1, 0]


def test_penalties_exact():
    from tandem.engine.sampling.sampler import apply_penalties_and_masks

    row = torch.tensor([2.0, -2.0, 1.0, 4.0, 0.5])
    r = _req(SamplingParams(repetition_penalty=2.0), prompt=(0, 1), output=(3,))
    apply_penalties_and_masks(row, r)
    assert row.tolist() == [1.0, -4.0, 1.0, 2.0, 0.5]

    row = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    r = _req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(4,), output=(1, 1, 3))
    apply_penalties_and_masks(row, r)
    assert row.tolist() == [1.0, 0.0, 1.0, 0.25, 1.0]

    row = torch.zeros(5)
    r = _req(SamplingParams(min_tokens=2, stop_token_ids=(4,), max_tokens=5), output=(1,))
    apply_penalties_and_masks(row, r)
    assert row.tolist() == [0.0, 0.0, -math.inf, 0.0, -math.inf]


def test_logprobs_are_raw_log_softmax_and_sorted():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    res = Sampler()(logits, [_req(SamplingParams(temperature=0, logprobs=3))])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert res.token_id == 1
    assert res.logprobs.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in res.logprobs.top] == [1, 2, 0]
    assert all(math.isfinite(v) for _, v in res.logprobs.top)


def test_seeded_row_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, seed=42)
    alone = [Sampler()(logits[:1], [_req(p)])[0].token_id for _ in range(1)]
    with_others = Sampler()(logits, [_req(p), _req(SamplingParams(), rid="u"),
                                     _req(SamplingParams(seed=7), rid="s")])
    assert with_others[0].token_id == alone[0]


def test_sampler_holds_a_seeded_generator_from_first_draw_until_free():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5))
    seeded = _req(SamplingParams(temperature=0.8, seed=42), rid="a")
    unseeded = _req(SamplingParams(temperature=0.8), rid="b")
    greedy = _req(SamplingParams(temperature=0, seed=42), rid="c")
    sampler = Sampler()
    assert sampler.num_seeded_requests == 0
    first = sampler(logits, [seeded])[0].token_id
    sampler(logits, [unseeded])
    sampler(logits, [greedy])
    assert sampler.num_seeded_requests == 1          # only the seeded, sampled one
    assert sampler.free("a") is True and sampler.free("a") is False
    assert sampler.free("b") is False and sampler.num_seeded_requests == 0
    # Freed and seen again (a new request under the id): starts over from its seed.
    assert sampler(logits, [seeded])[0].token_id == first


def test_seeded_samples_of_one_prompt_are_seeded_by_sample_index():
    logits = torch.zeros(1, 1000)                    # uniform: the draw is the generator's
    p = SamplingParams(temperature=1.0, seed=11)
    a0, a1 = _req(p, rid="x"), _req(p, rid="x#1")
    a1.sample_index = 1
    b = _req(SamplingParams(temperature=1.0, seed=12), rid="y")
    sampler = Sampler()
    t0, t1, tb = (sampler(logits, [r])[0].token_id for r in (a0, a1, b))
    assert t1 == tb                                  # 11 + index 1 == seed 12
    assert t0 != t1


def test_samples_of_the_largest_seed_wrap_to_seed_zero():
    # seed + index overflowed torch.Generator.manual_seed before: sample 1 of
    # seed 2**64 - 1 now draws exactly as sample 0 of seed 0.
    logits = torch.zeros(1, 1000)
    top = _req(SamplingParams(temperature=1.0, seed=2**64 - 1), rid="t#1")
    top.sample_index = 1
    zero = _req(SamplingParams(temperature=1.0, seed=0), rid="z")
    sampler = Sampler()
    draws = [[sampler(logits, [r])[0].token_id for _ in range(5)] for r in (top, zero)]
    assert draws[0] == draws[1]


def test_skip_draws_continues_as_in_one_engine():
    gen = torch.Generator().manual_seed(9)
    steps = [torch.randn(1, 64, generator=gen) for _ in range(6)]
    p = SamplingParams(temperature=0.9, seed=3)
    one = Sampler()
    r = _req(p, rid="r")
    expected = [one(x, [r])[0].token_id for x in steps]
    # A decode worker: the first token came from the prefill worker's sampler.
    decode = Sampler()
    r2 = _req(p, rid="r")
    decode.skip_draws(r2, 64, 1)
    assert [decode(x, [r2])[0].token_id for x in steps[1:]] == expected[1:]
    # Greedy and unseeded requests hold no generator to advance.
    # A resumed request: three tokens were sampled by an earlier attempt.
    resumed = Sampler()
    r3 = _req(p, rid="r")
    resumed.skip_draws(r3, 64, 3)
    assert [resumed(x, [r3])[0].token_id for x in steps[3:]] == expected[3:]
    # Greedy and unseeded requests hold no generator to advance.
    decode.skip_draws(_req(SamplingParams(temperature=0, seed=3), rid="g"), 64, 1)
    decode.skip_draws(_req(SamplingParams(temperature=0.9), rid="u"), 64, 1)
    assert decode.num_seeded_requests == 1
    with pytest.raises(ValueError, match="num_draws"):
        decode.skip_draws(r2, 64, -1)


# -- on the real model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(f32_weights):
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=256, weights_from=f32_weights)


@pytest.mark.slow
def test_c06_seeded_request_beside_unseeded(llm, tokenizer):
    """Field case C06: R1 (seed 42) is identical in every run, whatever runs beside it."""
    r1 = tokenizer.encode("Tell me a story about a dragon.")
    r2 = tokenizer.encode("List some fruits:")
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=42)
    outs = []
    for r2_seed in (None, 7):
        p2 = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=r2_seed)
        for _ in range(2):
            res = llm.generate([r1, r2], [seeded, p2])
            outs.append(res[0].outputs[0].token_ids)
    outs.append(llm.generate([r1], seeded)[0].outputs[0].token_ids)   # alone
    assert all(o == outs[0] for o in outs), outs
    assert len(outs[0]) == 16
    # ...and the unseeded neighbour really varies (it is not secretly seeded).
    unseeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    draws = {tuple(llm.generate([r2], unseeded)[0].outputs[0].token_ids) for _ in range(4)}
    assert len(draws) > 1


@pytest.mark.slow
def test_n_samples_share_prompt_blocks(llm, tokenizer):
    prompt = tokenizer.encode("Write a list of ten animals and describe each one briefly:" * 4)
    bs = llm.engine.kv_cache.block_size
    greedy1 = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    peak = []
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
                       step_callback=lambda e: (e.kv_cache_manager.check_invariants(),
                                                peak.append(e.kv_cache_manager.num_blocks
                                                            - e.kv_cache_manager.num_free_blocks)))
    assert [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    for c in out[0].outputs:
        assert c.token_ids == greedy1[0].outputs[0].token_ids
    total = len(prompt) + 12
    unshared = 4 * math.ceil(total / bs)
    full_prompt_blocks = len(prompt) // bs
    # Four samples share the full prompt blocks; each owns only its tail blocks.
    assert max(peak) == full_prompt_blocks + 4 * (math.ceil(total / bs) - full_prompt_blocks)
    assert max(peak) < unshared
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.slow
def test_n_seeded_samples_differ_and_reproduce(llm, tokenizer):
    prompt = tokenizer.encode("My favourite word is")
    p = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    a = [c.token_ids for c in llm.generate([prompt], p)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompt], p)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) > 1
    assert llm.engine.runner.sampler.num_seeded_requests == 0     # freed as they finished


@pytest.mark.slow
def test_logprobs_on_model(llm, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 5
        assert lp.top[0][0] == tok                     # greedy picks the top-1
        assert all(math.isfinite(v) and v <= 0 for _, v in lp.top)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.slow
def test_stop_token_ids_and_stop_strings(llm, tokenizer):
    prompt = tokenizer.encode("A B C D E F G H I J K")
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=(stop_id,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    # A stop string spanning several tokens, taken from the greedy text itself.
    stop = base.text[12:19]
    assert len(tokenizer.encode(stop, add_special_tokens=False)) >= 2
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop=(stop,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    with_stop = llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,),
        include_stop_str_in_output=True))[0].outputs[0]
    assert with_stop.text == base.text[:base.text.index(stop) + len(stop)]
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("vocab", [49152, 5000, 4096, 4095, 100])
def test_greedy_token_ids_equal_torch_argmax(vocab):
    # Exactly torch's argmax: the first of equal maxima within and across blocks
    # (and across the tail past the last whole block), a row's first NaN, 0 for a
    # row of -inf; vocabularies under four blocks take torch's path itself.
    from tandem.engine.sampling.sampler import ARGMAX_BLOCK, greedy_token_ids

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g)
    hi = x.max() + 1
    x[1, [7, vocab - 1]] = hi                              # first and last column
    x[2, [(ARGMAX_BLOCK + 3) % vocab, (3 * ARGMAX_BLOCK + 5) % vocab]] = hi   # across blocks
    x[3, [vocab - 2, vocab - 1]] = hi                      # two in the tail
    x[4, [(2 * ARGMAX_BLOCK - 1) % vocab, (2 * ARGMAX_BLOCK) % vocab]] = hi   # a block edge
    x[5, vocab // 2] = float("nan")
    x[6, [vocab - 1, 9]] = float("nan")
    x[7] = float("-inf")
    x[8, :] = 0.0                                          # every column ties
    x[9] = x[9].round()                                    # many ties
    x[10] = x[10].to(torch.bfloat16).float()               # bfloat16 logits, cast
    x[11, vocab - 1] = hi                                  # only the very last
    expected = x.argmax(dim=-1)
    got = greedy_token_ids(x)
    assert got.dtype == torch.int64 and got.tolist() == expected.tolist()
    assert greedy_token_ids(x[[3, 5, 0]]).tolist() == expected[[3, 5, 0]].tolist()
    if vocab >= 4 * ARGMAX_BLOCK:      # the rows of a strided view too
        sub = x[:, :4 * ARGMAX_BLOCK]
        assert greedy_token_ids(sub).tolist() == sub.argmax(dim=-1).tolist()
    assert greedy_token_ids(x[:0]).tolist() == []
