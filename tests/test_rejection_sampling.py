"""Speculative verification (``Sampler.verify``): the emitted tokens are distributed
as the target's own samples (Leviathan et al. 2023, Alg. 1), checked with a
chi-square goodness-of-fit test against the exact processed target distribution.

The logits are the real model's, at two positions of a real prompt, cut to their
48 most likely tokens (the algorithm does not depend on the vocabulary's size, and
a small one keeps 8,000 trials fast). Each test's false-alarm rate is stated:
the chi-square p-value must exceed 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampling.sampler import DraftHistory, Sampler, apply_penalties_and_masks, processed_probs
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.engine.scheduling.request import Request

V = 48
TRIALS = 8_000
P_VALUE_FLOOR = 1e-4
SAMPLED = SamplingParams(temperature=1.0, top_k=30, top_p=0.95, min_p=0.01, seed=11, max_tokens=64)


@pytest.fixture(scope="module")
def model_logits(f32_weights):
    """``[3, V]`` float32: the model's logits after the prompt and after each of two
    further tokens, cut to the 48 tokens most likely at the first position."""
    engine = f32_weights.engine
    prompt = f32_weights.tokenizer.encode("The weather in spring is usually")
    hf_like = f32_weights.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                            logprobs=0))[0].outputs[0].token_ids
    seq = prompt + hf_like
    from tandem.engine.runtime.model_runner import pack_chunks

    kv = engine.kv_cache_manager
    rid = "rejection-sampling-logits"
    assert kv.allocate_slots(rid, 0, len(seq))
    try:
        ids, pos, meta = pack_chunks([(seq, 0, kv.get_block_ids(rid))], kv.block_size, engine.device)
        with torch.inference_mode():
            hidden = engine.model(ids, pos, engine.kv_cache.tensor, meta, engine.backend, None)
            logits = engine.model.compute_logits(hidden[-3:]).float()
    finally:
        kv.free(rid)
    keep = logits[0].topk(V).indices
    return logits[:, keep].contiguous()


def _request(params=SAMPLED, output=()) -> Request:
    return Request("r", [1, 2, 3], params, eos_token_id=None, output_token_ids=list(output))


def _target(row: torch.Tensor, req, drafts=()) -> torch.Tensor:
    """The exact processed target distribution of one row, normalised."""
    row = row.clone()
    apply_penalties_and_masks(row, DraftHistory(req, drafts))
    p = processed_probs(row, req.sampling_params)
    return p / p.sum()


def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) for ``counts`` against ``probs`` (categories with
    expected count < 5 are pooled into one, as the test's approximation needs)."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _run(logits, drafts_fn, params=SAMPLED, output=(), trials=TRIALS):
    """``trials`` verifications; returns the emitted token lists."""
    sampler = Sampler()
    req = _request(params, output)
    out = []
    for _ in range(trials):
        drafts, q = drafts_fn(sampler)
        out.append([r.token_id for r in sampler.verify(logits, req, drafts, q)])
    return out, req


def _check_marginals(emitted, logits, req, drafts):
    """Token 1 ~ p_0; given token 1 == drafts[0] (accepted), token 2 ~ p_1."""
    p0 = _target(logits[0], req)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V)
    assert _chi2_p_value(first, p0) > P_VALUE_FLOOR
    seconds = [e[1] for e in emitted if len(e) > 1 and e[0] == drafts[0]]
    assert len(seconds) > 500         # enough for the chi-square approximation
    p1 = _target(logits[1], req, drafts[:1])
    assert _chi2_p_value(torch.bincount(torch.tensor(seconds), minlength=V), p1) > P_VALUE_FLOOR


def test_point_mass_drafts_keep_the_target_distribution(model_logits):
    """n-gram drafts (q one-hot): a likely first draft, an unlikely second one."""
    p0 = _target(model_logits[0], _request())
    p1 = _target(model_logits[1], _request())
    drafts = [int(p0.argmax()), int(p1.argsort()[-6])]
    emitted, req = _run(model_logits, lambda s: (drafts, None))
    _check_marginals(emitted, model_logits, req, drafts)
    # Acceptance of the first draft happens with probability p_0(d_0) exactly.
    rate = sum(1 for e in emitted if len(e) > 1) / len(emitted)
    assert abs(rate - float(p0[drafts[0]])) < 4.5 * (float(p0[drafts[0]]) * (1 - float(p0[drafts[0]])) / TRIALS) ** 0.5


def test_draft_model_drafts_keep_the_target_distribution(model_logits):
    """Drafts drawn from another distribution q (the model at temperature 0.6 with a
    wider top-k): accepted with min(1, p/q), rejections resampled from max(0, p - q)."""
    q_params = SamplingParams(temperature=0.6, top_k=40, seed=5)
    req_q = _request(q_params)
    q = torch.stack([_target(model_logits[j], req_q) for j in range(2)])
    gen = torch.Generator().manual_seed(3)

    def drafts_fn(_sampler):
        return [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)], q

    emitted, req = _run(model_logits, drafts_fn)
    p0 = _target(model_logits[0], req)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V)
    assert _chi2_p_value(first, p0) > P_VALUE_FLOOR
    # The token after an accepted first draft (every row-1 target is the same here).
    seconds = [e[1] for e in emitted if len(e) > 1]
    p1 = _target(model_logits[1], req)
    assert _chi2_p_value(torch.bincount(torch.tensor(seconds), minlength=V), p1) > P_VALUE_FLOOR
    # Expected acceptance of draft 1: sum_x min(p0(x), q0(x)).
    rate = len(seconds) / len(emitted)
    want = float(torch.minimum(p0, q[0]).sum())
    assert abs(rate - want) < 4.5 * (want * (1 - want) / TRIALS) ** 0.5


def test_penalties_see_the_earlier_drafts(model_logits):
    """With a frequency penalty the second row's target counts the first draft as output."""
    params = SamplingParams(temperature=1.0, top_k=30, frequency_penalty=1.5, seed=2)
    p0 = _target(model_logits[0], _request(params))
    drafts = [int(p0.argmax()), int(p0.argmax())]         # the same token twice
    emitted, req = _run(model_logits, lambda s: (drafts, None), params=params, trials=6_000)
    p1 = _target(model_logits[1], req, drafts[:1])
    assert p1[drafts[1]] < _target(model_logits[1], req)[drafts[1]]   # the penalty bites
    seconds = [e[1] for e in emitted if len(e) > 1 and e[0] == drafts[0]]
    assert _chi2_p_value(torch.bincount(torch.tensor(seconds), minlength=V), p1) > P_VALUE_FLOOR


def test_greedy_verification_accepts_while_argmax_matches(model_logits):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    best = model_logits.argmax(dim=-1).tolist()
    sampler = Sampler()
    req = _request(greedy)
    assert [r.token_id for r in sampler.verify(model_logits, req, best[:2])] == best
    assert [r.token_id for r in sampler.verify(model_logits, req, [best[0], (best[1] + 1) % V])
            ] == best[:2]
    assert [r.token_id for r in sampler.verify(model_logits, req, [(best[0] + 1) % V, best[1]])
            ] == best[:1]


def test_no_drafts_draw_exactly_what_plain_sampling_draws(model_logits):
    """A request without drafts consumes the same randomness as without speculation."""
    a, b = Sampler(), Sampler()
    ra, rb = _request(), _request()
    for row in model_logits:
        assert a.verify(row[None], ra, [])[0].token_id == b(row[None], [rb])[0].token_id
    ga, gb = a.generator_for(ra), b.generator_for(rb)
    assert torch.equal(ga.get_state(), gb.get_state())


def test_seeded_verification_reproduces(model_logits):
    drafts = model_logits.argmax(dim=-1).tolist()[:2]
    runs = [_run(model_logits, lambda s: (drafts, None), trials=200)[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_point_mass_drafts_give_plain_samplings_tokens_and_uniforms(model_logits):
    """n-gram drafts change how many tokens one forward pass yields, never which: a
    seeded request's verified tokens are the ones plain sampling of the same rows
    draws with the same seed (the first one that is not a draft ends the step), and
    the generator has taken one uniform per token, as plain sampling would. So a
    seeded request gives the same text with speculation on or off, and a resumed
    one skips one uniform per emitted token (LLMEngine.add_request)."""
    p0 = _target(model_logits[0], _request())
    p1 = _target(model_logits[1], _request())
    drafts = [int(p0.argmax()), int(p1.argmax())]
    accepted = 0
    for seed in range(300):
        params = SamplingParams(temperature=1.0, top_k=30, top_p=0.95, min_p=0.01, seed=seed)
        spec, plain = Sampler(), Sampler()
        rs, rp = _request(params), _request(params)
        got = [r.token_id for r in spec.verify(model_logits, rs, drafts)]
        want = [plain(model_logits[j][None], [rp])[0].token_id for j in range(len(got))]
        assert got == want, seed
        assert got[:-1] == drafts[:len(got) - 1] and (len(got) == 3 or got[-1] != drafts[len(got) - 1])
        assert torch.equal(spec.generator_for(rs).get_state(), plain.generator_for(rp).get_state())
        accepted += len(got) - 1
    assert accepted >= 10                     # some drafts were accepted (38 of 300 here)
