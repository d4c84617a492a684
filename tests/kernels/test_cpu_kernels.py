"""The compiled CPU kernels (tandem.kernels.cpu) against their torch references.

Caches are poisoned with NaN outside every sequence's tokens (see conftest), so a
kernel that reads past a context shows it. float32 must match to rounding; in
bfloat16 the reference runs in float32 on the same bf16 inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.kernels import reference as ref
from tandem.kernels.cpu import build, ops
from tandem.kernels.cpu.linear import (amx_linear, amx_linear_usable, avx512_f32_linear,
                                       avx512_f32_linear_usable, dpbf16_linear,
                                       dpbf16_linear_usable, invariant_linear,
                                       pack_invariant_weight, packed_linear)

try:
    build.load_library()
except build.CpuKernelsUnavailable as exc:   # pragma: no cover - no compiler
    pytest.skip(f"CPU kernels unavailable: {exc}", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [
    (9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16),   # bf16: the BF16 dot-product kernel
    (6, 2, 48, 16),                                   # AVX-512 float32-math kernel
    (6, 2, 40, 4), (16, 1, 32, 16),                   # portable kernel (d % 16, G > 8)
])
def test_decode_attention(paged_kv, dtype, hq, hkv, d, bs):
    lens = [1, 5, 16, 17, 100, 33]
    kc, vc, kclean, vclean, tables = paged_kv(lens, hkv, d, bs, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(d)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = ref.paged_decode_attention_ref(q.float(), kclean.float(), vclean.float(), tables,
                                          seq_lens, d ** -0.5)
    got = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, d ** -0.5)
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_per_sequence_tasks_equal_single_calls(paged_kv, dtype, fp8):
    """A batch of many sequences runs one task per sequence (its KV heads in turn), a
    lone sequence one per (sequence, head): every sequence's output is bit for bit
    the one it gets alone, with one thread or two, and matches the reference."""
    lens = [300, 1, 17, 250, 64, 129, 5, 280, 33, 16, 200, 90, 271, 3, 150, 240]
    hq, hkv, d, bs = 9, 3, 64, 16
    kc, vc, kclean, vclean, tables = paged_kv(lens, hkv, d, bs, dtype, torch.device("cpu"))
    extra = {}
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        kclean, vclean = kclean.to(torch.float8_e4m3fn), vclean.to(torch.float8_e4m3fn)
        extra = {"k_scale": torch.full((hkv,), 0.5), "v_scale": torch.full((hkv,), 2.0)}
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batch = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, d ** -0.5, **extra)
            for i in range(len(lens)):
                alone = ops.paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1],
                                                   seq_lens[i:i + 1], d ** -0.5, **extra)
                assert torch.equal(batch[i:i + 1], alone), (threads, i)
    finally:
        torch.set_num_threads(before)
    kf, vf = kclean.float(), vclean.float()
    if fp8:
        kf, vf = kf * 0.5, vf * 2.0
    want = ref.paged_decode_attention_ref(q.float(), kf, vf, tables, seq_lens, d ** -0.5)
    assert_matches(batch, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (6, 2, 48, 16), (6, 2, 40, 4)])
@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (17, None), (200, None),
                                            (None, 3.0), (7, 2.0)])
def test_decode_attention_window_and_softcap(paged_kv, dtype, hq, hkv, d, bs, window, softcap):
    """Windows shorter than, across and past the contexts (starting inside a block),
    and soft-capped scores, in every tier, against the torch decode path."""
    from tandem.kernels.attention_backend import decode_attention_cpu

    lens = [1, 5, 16, 17, 100, 33]
    kc, vc, kclean, vclean, tables = paged_kv(lens, hkv, d, bs, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(d + bs)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = decode_attention_cpu(q.float(), kclean.float(), vclean.float(), tables, seq_lens,
                                d ** -0.5, max(lens), window=window, softcap=softcap)
    got = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, d ** -0.5, window=window,
                                     softcap=softcap)
    assert_matches(got, want, dtype)


def test_decode_attention_window_needs_a_plain_cache(paged_kv):
    kc, vc, _, _, tables = paged_kv([3], 2, 32, 16, torch.float32, torch.device("cpu"))
    q, lens = torch.randn(1, 4, 32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="window: must be at least 1"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, 0.2, window=0)
    with pytest.raises(ValueError, match="softcap: must be positive"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, 0.2, softcap=-1.0)
    with pytest.raises(ValueError, match="query's dtype only"):
        ops.paged_decode_attention(q.bfloat16(), kc, vc, tables, lens, 0.2, window=2)


def test_decode_attention_strided_query_and_out(paged_kv):
    """Rows of a fused QKV output and of a larger output buffer are strided views."""
    lens = [3, 40]
    kc, vc, kclean, vclean, tables = paged_kv(lens, 2, 32, 16, torch.float32, torch.device("cpu"))
    qkv = torch.randn(2, (4 + 2 * 2) * 32)
    q = qkv[:, :128].view(2, 4, 32)
    out = torch.full((2, 6, 32), 7.0)
    ops.paged_decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.2,
                               out=out[:, :4])
    want = ref.paged_decode_attention_ref(q, kclean, vclean, tables,
                                          torch.tensor(lens, dtype=torch.int32), 0.2)
    assert_matches(out[:, :4], want, torch.float32)
    assert torch.all(out[:, 4:] == 7.0)        # nothing written outside the view


PREFILL_DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(
    not ops.has_prefill_attention(dt, 64),
    reason=f"{dt} prefill attention needs a CPU with AVX-512 (BF16 for bfloat16)"))
    for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 32),
                                         (3, 1, 48, 16), (16, 2, 64, 16)])
@pytest.mark.parametrize("use_amx", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ops.amx_prefill_usable(64), reason="the AMX prefill kernel needs a CPU with AMX-BF16"))],
    ids=["avx512", "amx"])
def test_prefill_attention(paged_kv, dtype, hq, hkv, d, bs, use_amx):
    # (query length, context length): whole prompts, a chunk after earlier chunks,
    # a chunk after a cached prefix, one-token chunks, tile and block edges.
    cases = [(37, 37), (5, 21), (16, 16), (1, 33), (64, 300), (17, 17), (1, 1), (33, 80)]
    lens = [s for _, s in cases]
    kc, vc, kclean, vclean, tables = paged_kv(lens, hkv, d, bs, dtype, torch.device("cpu"))
    qsl = [0]
    for q_len, _ in cases:
        qsl.append(qsl[-1] + q_len)
    g = torch.Generator().manual_seed(hq + d)
    q = torch.randn(qsl[-1], hq, d, generator=g).to(dtype)
    want = ref.paged_prefill_attention_ref(q.float(), kclean.float(), vclean.float(), tables,
                                           qsl, lens, d ** -0.5)
    if use_amx and (dtype != torch.bfloat16 or not ops.amx_prefill_usable(d)):
        pytest.skip("the AMX kernel: bfloat16, head_dim % 32 == 0")
    got = ops.paged_prefill_attention(q, kc, vc, tables, qsl, lens, d ** -0.5, use_amx=use_amx)
    assert got.dtype == dtype
    assert_matches(got, want, dtype)


def test_prefill_attention_refuses_what_it_cannot_run(paged_kv):
    kc, vc, *_, tables = paged_kv([4], 1, 64, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="head_dim % 16"):
        ops.paged_prefill_attention(torch.zeros(4, 1, 64, dtype=torch.float16), kc, vc, tables,
                                    [0, 4], [4], 1.0)
    if ops.has_prefill_attention(torch.bfloat16, 64):
        with pytest.raises(ValueError, match="key_cache/value_cache: must be torch.bfloat16"):
            ops.paged_prefill_attention(torch.zeros(4, 1, 64, dtype=torch.bfloat16), kc, vc,
                                        tables, [0, 4], [4], 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_is_exact(dtype):
    g = torch.Generator().manual_seed(1)
    kc = torch.zeros(6, 4, 2, 8, dtype=dtype)
    vc = torch.zeros_like(kc)
    kv = torch.randn(5, 3, 2, 8, generator=g).to(dtype)       # strided rows: [T, K|V|x, Hkv, D]
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 23, 5, 11, 4])
    ops.reshape_and_cache(key, value, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    ref.reshape_and_cache_ref(key.contiguous(), value.contiguous(), kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_float_to_fp16_rounds_like_torch():
    """Every fp16 value, every midpoint between neighbours (ties to even) and the
    float32 just either side of it, the subnormal range, overflow and specials."""
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    v = h.float()
    v = v[torch.isfinite(v)]
    up = torch.nextafter(v.to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)).float()
    mid = (v + up) / 2                                      # exact in float32
    mid = mid[torch.isfinite(mid)]
    near = torch.cat([torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.99, 65520.0,
                            1e6, -1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26, 1e-30])
    x = torch.cat([v, mid, near, special, torch.randn(10000) * 100])
    got = ops.float_to_fp16(x).view(torch.int16)
    assert torch.equal(got, x.to(torch.float16).view(torch.int16))
    nan = ops.float_to_fp16(torch.tensor([float("nan")]))
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,d,bs", [(3, 64, 16), (2, 40, 8), (1, 128, 32)])
def test_int4_row_write_equals_the_torch_rows(dtype, hkv, d, bs):
    """The compiled per-token int4 write stores exactly the rows of
    ``int4_kv.quantize_int4_tokens``, at the slots, leaving other slots alone."""
    from tandem.kernels import int4_kv

    row = int4_kv.int4_kv_row_bytes(d, bs)
    g = torch.Generator().manual_seed(d)
    kv = (torch.randn(7, 3, hkv, d, generator=g) * 3).to(dtype)    # strided [T, K|V|x, Hkv, D]
    kv[2, 0, 0] = 1.5                                        # a constant group: step 0
    kv[3, 1, -1, : d // 2] = 0.0
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 5, 9, -1, 17, 4, 30])
    kc = torch.full((30 // bs + 1, bs, hkv, row), 0xAB, dtype=torch.uint8)
    vc = kc.clone()
    ops.reshape_and_cache_int4_rows(key, value, kc, vc, slots)
    keep = slots >= 0
    want_k, want_v = (int4_kv.quantize_int4_tokens(x[keep], row) for x in (key, value))
    flat_k, flat_v = kc.view(-1, hkv, row), vc.view(-1, hkv, row)
    assert torch.equal(flat_k[slots[keep]], want_k) and torch.equal(flat_v[slots[keep]], want_v)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slots[keep]] = False
    assert (flat_k[others] == 0xAB).all() and (flat_v[others] == 0xAB).all()
    with pytest.raises(ValueError, match="cannot hold"):
        small = torch.zeros(*kc.shape[:3], 8, dtype=torch.uint8)
        ops.reshape_and_cache_int4_rows(key, value, small, small.clone(), slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype) if with_residual else None
    got = ops.rms_norm(x, w, 1e-5, res)
    want = ref.rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        assert_matches(got[0], want[0], dtype)
        assert torch.equal(got[1], want[1])      # x + residual, rounded once like torch
    else:
        assert_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place(dtype):
    g = torch.Generator().manual_seed(3)
    cache = ref.rope_cos_sin_cache(64, 512, 100000.0)
    qkv = torch.randn(9, (9 + 2 * 3) * 64, generator=g).to(dtype)
    q, k = qkv[:, :576].view(9, 9, 64), qkv[:, 576:768].view(9, 3, 64)
    pos = torch.tensor([0, 1, 2, 7, 100, 511, 3, 3, 300])
    q_ref, k_ref = q.clone(), k.clone()
    ref.rotary_embedding_ref(pos, q_ref, k_ref, cache)
    v_before = qkv[:, 768:].clone()
    ops.rotary_embedding(pos, q, k, cache)
    assert_matches(q, q_ref, dtype)
    assert_matches(k, k_ref, dtype)
    assert torch.equal(qkv[:, 768:], v_before)   # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 2 * 300, generator=g) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])    # exp's clamped range
    assert_matches(ops.silu_and_mul(x), ref.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (5, 2.0)])
def test_decode_from_qkv_equals_the_three_kernels(paged_kv, dtype, window, softcap):
    """One all-decode layer through ``decode_from_qkv`` (the step's pointers prepared
    once in a ``DecodeStep``) gives bit for bit what rotary_embedding,
    reshape_and_cache and paged_decode_attention give: the output, the rotated QKV
    and every byte of both caches."""
    lens = [1, 5, 16, 17, 100, 33]                 # contexts with this step's token
    hq, hkv, d, bs = 9, 3, 64, 16
    kc, vc, _, _, tables = paged_kv(lens, hkv, d, bs, dtype, torch.device("cpu"))
    kc, vc = kc.nan_to_num(0.5), vc.nan_to_num(-0.5)   # compared bytewise below
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cos_sin = ref.rope_cos_sin_cache(d, 512, 10000.0)
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g).to(dtype)
    scale = d ** -0.5

    qkv_a, kc_a, vc_a = qkv.clone(), kc.clone(), vc.clone()
    q, k, v = qkv_a.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    ops.rotary_embedding(positions, q, k, cos_sin)
    ops.reshape_and_cache(k, v, kc_a, vc_a, slots)
    want = ops.paged_decode_attention(q, kc_a, vc_a, tables, seq_lens, scale, window=window,
                                      softcap=softcap)

    qkv_b, kc_b, vc_b = qkv.clone(), kc.clone(), vc.clone()
    step = ops.DecodeStep(slots, tables, seq_lens)
    got = ops.decode_from_qkv(qkv_b, hq, hkv, d, positions, cos_sin, kc_b, vc_b, step, scale,
                              window=window, softcap=softcap)
    assert got.shape == (len(lens), hq * d) and got.dtype == dtype
    assert torch.equal(got, want.reshape(len(lens), hq * d))
    assert torch.equal(qkv_b, qkv_a)
    assert torch.equal(kc_b, kc_a) and torch.equal(vc_b, vc_a)
    assert not torch.equal(kc_b, kc)               # the step's K was written


def test_decode_step_wants_int32_tables_and_lengths():
    with pytest.raises(ValueError, match="block_tables/seq_lens: must be int32"):
        ops.DecodeStep(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64),
                       torch.ones(2, dtype=torch.int32))


def test_cpu_backend_takes_its_decode_path_only_for_all_decode_steps_in_the_model_dtype():
    """The backend's fast path answers for a step of decodes with a cache in the
    model's dtype and declines (None: the general path runs) a step with a prompt
    chunk, an fp8 cache, a float16 model, or a window or cap the general path refuses."""
    from tandem.kernels.attention_backend import AttentionMetadata
    from tandem.kernels.cpu.backend import CpuAttentionBackend

    backend = CpuAttentionBackend()
    hq, hkv, d, bs = 4, 2, 32, 16
    cache = torch.zeros(4, bs, hkv, d)
    cos_sin = ref.rope_cos_sin_cache(d, 64, 10000.0)

    def meta(query_lens):
        n = len(query_lens)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.arange(qsl[-1]), block_tables=torch.arange(n, dtype=torch.int32
                                                                          ).view(n, 1),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32), query_start_loc_cpu=qsl,
            seq_lens_cpu=list(query_lens), num_decodes=sum(q == 1 for q in query_lens),
            max_seq_len=max(query_lens))

    def call(m, qkv, key_cache):
        positions = torch.zeros(qkv.shape[0], dtype=torch.int64)
        return backend.decode_from_qkv(qkv, hq, hkv, d, positions, cos_sin, key_cache,
                                       key_cache.clone(), m, d ** -0.5)

    qkv = torch.randn(2, (hq + 2 * hkv) * d)
    assert call(meta([1, 1]), qkv, cache).shape == (2, hq * d)
    assert call(meta([1, 3]), torch.randn(4, (hq + 2 * hkv) * d), cache) is None
    assert call(meta([1, 1]), qkv, cache.to(torch.float8_e4m3fn)) is None
    assert call(meta([1, 1]), qkv.half(), cache.half()) is None
    for bad in ({"window": 0}, {"softcap": 0.0}):    # the general path names them
        assert backend.decode_from_qkv(qkv, hq, hkv, d, torch.zeros(2, dtype=torch.int64),
                                       cos_sin, cache, cache.clone(), meta([1, 1]), 0.1,
                                       **bad) is None


def test_engine_tokens_equal_with_and_without_the_decode_path(f32_weights):
    """The real model, bfloat16 and float32, the CPU backend: greedy tokens and their
    logprobs are the same whether decode steps take the backend's decode path or the
    general one (the path switched off on the engine's backend instance)."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    prompts = [[1, 4093, 198, 19556, 905], [504, 3575, 282, 4649, 314, 7042, 30, 216, 33]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    for dtype in ("float32", "bfloat16"):
        llm = (LLM(dtype=dtype, num_blocks=32, weights_from=f32_weights) if dtype == "float32"
               else LLM(dtype=dtype, num_blocks=32))
        backend = llm.engine.backend
        assert backend.name == "cpu"
        fast = [o.outputs[0] for o in llm.generate(prompts, params)]
        backend.decode_from_qkv = lambda *args, **kwargs: None
        general = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in fast] == [o.token_ids for o in general]
        assert [o.logprobs for o in fast] == [o.logprobs for o in general]
        if _panel_kernel(dtype) is not None:
            _check_small_batch_linear(llm, prompts, params, fast, dtype)


def _panel_kernel(dtype: str) -> str | None:
    """The small-batch kernel the engine gives a dense ``dtype`` layer on this CPU."""
    if dtype == "float32":
        return "avx512_f32" if avx512_f32_linear_usable(576) else None
    return ("amx" if amx_linear_usable(576) else "dpbf16" if dpbf16_linear_usable(576)
            else None)


def _check_small_batch_linear(llm, prompts, params, with_panels, dtype):
    """small_batch_linear left to its default: every dense layer holds a panel copy
    for this CPU's small-batch kernel (bfloat16: amx_linear on an AMX host,
    dpbf16_linear on an AVX-512 BF16 one without AMX; float32: avx512_f32_linear on
    AVX-512F); an input of up to the kernel's row bound takes it, a longer one
    oneDNN; with the copies hidden (oneDNN throughout) the greedy tokens are the
    same, logprobs within what the dtype's roundings add up to."""
    from tandem.engine.model.linear import Linear
    from tandem.kernels.cpu.linear import (AMX_LINEAR_MAX_ROWS, AVX512_F32_LINEAR_MAX_ROWS,
                                           DPBF16_LINEAR_MAX_ROWS)

    import tandem.engine.model.linear as linear_module

    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.panel_weight is not None for m in layers)
    kernel = _panel_kernel(dtype)
    assert all(m.panel_kernel == kernel for m in layers)
    small, bound = {"amx": (amx_linear, AMX_LINEAR_MAX_ROWS),
                    "dpbf16": (dpbf16_linear, DPBF16_LINEAR_MAX_ROWS),
                    "avx512_f32": (avx512_f32_linear, AVX512_F32_LINEAR_MAX_ROWS)}[kernel]
    layer = layers[0]
    calls = []
    name = f"{kernel}_linear_unchecked"
    real = {name: getattr(linear_module, name), "packed_linear": linear_module.packed_linear}

    def counted(name):
        def call(*args):
            calls.append(name)
            return real[name](*args)
        return call
    for rows in (1, bound, bound + 1):
        x = torch.randn(rows, layer.in_features).to(getattr(torch, dtype))
        want = (small(x, layer.panel_weight, layer.out_features)
                if rows <= bound else packed_linear(x, layer.packed_weight))
        for fn_name in real:
            setattr(linear_module, fn_name, counted(fn_name))
        try:
            got = layer.quant_method.apply(layer, x)
        finally:
            for fn_name, fn in real.items():
                setattr(linear_module, fn_name, fn)
        assert torch.equal(got, want)
    assert calls == [name, name, "packed_linear"]
    saved = [m.panel_weight for m in layers]
    for m in layers:
        m.panel_weight = None
    try:
        onednn = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        for m, w in zip(layers, saved):
            m.panel_weight = w
    assert [o.token_ids for o in with_panels] == [o.token_ids for o in onednn]
    # bfloat16: the LM head's logits are bfloat16 (one ulp is 0.0625-0.125 for
    # logits of 8-32), and either path is up to ~0.12 from the float32 model's
    # logprobs on these prompts: two ulps apart at most. float32: two summation
    # orders of the same float32 products.
    tol = 0.25 if dtype == "bfloat16" else 1e-3
    for a, b in zip(with_panels, onednn):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < tol


amx_only = pytest.mark.skipif(
    not __import__("tandem.kernels.cpu.linear", fromlist=["x"]).amx_linear_usable(64),
    reason="no AMX-BF16 on this CPU (or the OS refused tile state)")


@amx_only
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (17, 96, 576), (33, 960, 576), (5, 576, 1536),
                                   (1037, 40, 96)])
def test_amx_linear_matches_the_float32_product(m, n, k):
    """Every output within one bfloat16 rounding of the float32 product of the same
    bfloat16 inputs: partial row tiles (17, 33 rows), an odd panel count and a last
    panel of 8 columns (40), several k tiles, rows beyond one 512-row pass (1037: two
    whole passes and a last one of 13 rows); strided rows of x give the same bits,
    and so does any slice of the rows on its own (a row's result is its own)."""
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    big = torch.randn(m, k + 64, generator=g).bfloat16()
    x = big[:, :k]                                     # rows strided
    out = amx_linear(x, pack_invariant_weight(w), n)
    want = x.float() @ w.float().t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-6)
    assert torch.equal(amx_linear(x.contiguous(), pack_invariant_weight(w), n), out)
    slices = [(lo, hi) for lo, hi in ((1, m), (3, m), (m - 520, m - 1), (m // 3, m))
              if 0 <= lo < hi]              # shifted across 16- and 512-row boundaries
    assert slices
    for lo, hi in slices:
        assert torch.equal(amx_linear(x[lo:hi], pack_invariant_weight(w), n), out[lo:hi])


dpbf16_only = pytest.mark.skipif(
    not __import__("tandem.kernels.cpu.linear", fromlist=["x"]).dpbf16_linear_usable(64),
    reason="no AVX-512 BF16 on this CPU")


@dpbf16_only
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (7, 96, 576), (16, 960, 576), (37, 576, 1536),
                                   (13, 200, 2)])
def test_dpbf16_linear_matches_the_float32_product(m, n, k):
    """Every output within one bfloat16 rounding of the float32 product of the same
    bfloat16 inputs: row blocks of 6 and their remainders (7, 13, 37 rows), a last
    panel of 8 columns (40, 200), a panel group of 1-3 panels per thread (40, 96, 200),
    one k pair (k = 2); strided rows of x give the same bits, and so does any slice of
    the rows on its own (a row's result is its own)."""
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    big = torch.randn(m, k + 64, generator=g).bfloat16()
    x = big[:, :k]                                     # rows strided
    out = dpbf16_linear(x, pack_invariant_weight(w), n)
    want = x.float() @ w.float().t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-6)
    assert torch.equal(dpbf16_linear(x.contiguous(), pack_invariant_weight(w), n), out)
    for lo, hi in ((1, m), (m // 3, m), (m - 1, m)):
        if lo < hi:
            assert torch.equal(dpbf16_linear(x[lo:hi], pack_invariant_weight(w), n), out[lo:hi])


@dpbf16_only
def test_dpbf16_linear_refusals():
    w = pack_invariant_weight(torch.randn(32, 64).bfloat16())
    assert not dpbf16_linear_usable(63) and dpbf16_linear_usable(64)
    with pytest.raises(ValueError, match="x: expected a 2-D bfloat16"):
        dpbf16_linear(torch.randn(2, 64), w, 32)
    with pytest.raises(ValueError, match="x: in_features 96"):
        dpbf16_linear(torch.randn(2, 96).bfloat16(), w, 32)


avx512_f32_only = pytest.mark.skipif(
    not __import__("tandem.kernels.cpu.linear", fromlist=["x"]).avx512_f32_linear_usable(64),
    reason="no AVX-512F on this CPU")


@avx512_f32_only
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (7, 96, 576), (16, 960, 576), (37, 576, 1536),
                                   (13, 200, 1), (64, 3072, 576)])
def test_avx512_f32_linear_equals_the_batch_invariant_kernel(m, n, k):
    """Bit for bit the batch-invariant kernel's results (the same FMA chain over k in
    order), and within float32 rounding of torch's product: row blocks of 6 and
    their remainders (7, 13, 37 rows), a last panel of 8 columns (40, 200), panel
    groups of 1-4 per thread, k = 1; strided rows of x give the same bits, and so
    does any slice of the rows on its own."""
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    big = torch.randn(m, k + 64, generator=g)
    x = big[:, :k]                                     # rows strided
    panels = pack_invariant_weight(w)
    out = avx512_f32_linear(x, panels, n)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert torch.equal(out, invariant_linear(x, panels, n))
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(avx512_f32_linear(x.contiguous(), panels, n), out)
    for lo, hi in ((1, m), (m // 3, m), (m - 1, m)):
        if lo < hi:
            assert torch.equal(avx512_f32_linear(x[lo:hi], panels, n), out[lo:hi])


@avx512_f32_only
def test_avx512_f32_linear_refusals():
    w = pack_invariant_weight(torch.randn(32, 64))
    assert not avx512_f32_linear_usable(0) and avx512_f32_linear_usable(64)
    with pytest.raises(ValueError, match="x: expected a 2-D float32"):
        avx512_f32_linear(torch.randn(2, 64).bfloat16(), w, 32)
    with pytest.raises(ValueError, match="x: in_features 96"):
        avx512_f32_linear(torch.randn(2, 96), w, 32)


def test_amx_linear_row_bound_from_the_environment(monkeypatch):
    """TANDEM_AMX_LINEAR_MAX_ROWS (TANDEM_DPBF16_LINEAR_MAX_ROWS) sets the bound (0
    included: oneDNN for every step);
    unset or empty, the default; anything but a count >= 0 is refused, naming it."""
    from tandem.kernels.cpu.linear import _max_rows_from_env

    for var in ("TANDEM_AMX_LINEAR_MAX_ROWS", "TANDEM_DPBF16_LINEAR_MAX_ROWS",
                "TANDEM_AVX512_F32_LINEAR_MAX_ROWS"):
        monkeypatch.delenv(var, raising=False)
        assert _max_rows_from_env(1280, var) == 1280
        for value, rows in (("", 1280), ("0", 0), ("128", 128)):
            monkeypatch.setenv(var, value)
            assert _max_rows_from_env(1280, var) == rows
        for bad in ("-1", "many", "1.5"):
            monkeypatch.setenv(var, bad)
            with pytest.raises(ValueError, match=var):
                _max_rows_from_env(1280, var)
    # ...and the engine's linear layers see them (read once, at import: a new process).
    env = {**os.environ, "TANDEM_AMX_LINEAR_MAX_ROWS": "7", "TANDEM_DPBF16_LINEAR_MAX_ROWS": "9",
           "TANDEM_AVX512_F32_LINEAR_MAX_ROWS": "11"}
    out = subprocess.run([sys.executable, "-c", "import tandem.engine.model.linear as m; "
                          "print(m.AMX_LINEAR_MAX_ROWS, m.DPBF16_LINEAR_MAX_ROWS, "
                          "m.AVX512_F32_LINEAR_MAX_ROWS)"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["7", "9", "11"]


@amx_only
def test_amx_linear_refusals():
    w = pack_invariant_weight(torch.randn(32, 64).bfloat16())
    assert not amx_linear_usable(48) and amx_linear_usable(64)
    with pytest.raises(ValueError, match="x: expected a 2-D bfloat16"):
        amx_linear(torch.randn(2, 64), w, 32)
    with pytest.raises(ValueError, match="x: in_features 96"):
        amx_linear(torch.randn(2, 96).bfloat16(), w, 32)
    with pytest.raises(ValueError, match="small_batch_linear"):
        EngineConfig(small_batch_linear="yes")


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ValueError, match="float16"):
        ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))


def test_library_name_tracks_source_and_flags(monkeypatch, tmp_path):
    """The cached build is keyed by source, flags and CPU: an edit rebuilds. A
    one-function source stands in for the kernels (the caching is under test, not
    the kernels; building them all takes ~15 s on 2 cores)."""
    import ctypes

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    src = tmp_path / "probe.cpp"
    src.write_text('extern "C" int tandem_probe() { return 1; }\n')
    monkeypatch.setattr(build, "SOURCES", [src])
    monkeypatch.setattr(build, "HEADERS", [])
    cxx = build.find_compiler()
    a = build.library_path(cxx)
    src.write_text('extern "C" int tandem_probe() { return 2; }\n')
    b = build.library_path(cxx)
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-DTANDEM_TEST"])
    c = build.library_path(cxx)
    assert len({a, b, c}) == 3 and a.parent == c.parent == tmp_path / "cpu_kernels"
    path = build.build()
    assert path == c and path.exists()
    assert ctypes.CDLL(str(path)).tandem_probe() == 2
    built_at = path.stat().st_mtime_ns
    assert build.build() == path and path.stat().st_mtime_ns == built_at   # cached: no rebuild


def test_auto_backend_falls_back_to_torch_when_the_build_fails(monkeypatch, tmp_path, caplog):
    from tandem.kernels.registry import get_attention_backend

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")            # a "compiler" that always fails
    build.load_library.cache_clear()
    try:
        with pytest.raises(build.CpuKernelsUnavailable, match="failed"):
            build.build()
        assert get_attention_backend("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
        assert "compiled CPU kernels unavailable" in caplog.text
        with pytest.raises(build.CpuKernelsUnavailable):
            get_attention_backend("cpu", torch.device("cpu"))   # asked for by name: an error
    finally:
        build.load_library.cache_clear()          # the next user loads the real build


def test_unwritable_cache_dir_is_a_clear_build_error(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    with pytest.raises(build.CpuKernelsUnavailable, match="TANDEM_CACHE_DIR"):
        build.build()


def test_auto_backend_is_cpu_for_float32_and_bfloat16():
    from tandem.kernels.registry import get_attention_backend

    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu, torch.float32).name == "cpu"
    assert get_attention_backend("auto", cpu, torch.bfloat16).name == "cpu"
    assert get_attention_backend("auto", cpu, torch.float16).name == "torch"


@pytest.mark.skipif(not __import__("tandem.kernels.cpu.linear", fromlist=["x"]).packing_available(),
                    reason="no oneDNN packed-linear ops, or no bfloat16 path for them on this CPU")
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(tokens):
    from torch import nn

    from tandem.kernels.cpu.linear import PackedLinear, pack_linear_weights, packing_available

    if not packing_available():
        pytest.skip("oneDNN's bfloat16 packed linear needs AVX-512 or AVX-NE-CONVERT")

    g = torch.Generator().manual_seed(tokens)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=True),
                          nn.Linear(32, 16, bias=False).float()).to(torch.bfloat16)
    model[2].float()                                  # float32: left alone
    plain = [m.weight.detach().clone() for m in model]
    assert pack_linear_weights(model) == 1            # only the bias-free bfloat16 layer
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear
    assert pack_linear_weights(model) == 0            # idempotent
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(model[0](x), torch.nn.functional.linear(x, plain[0]))


def test_kv_cache_tensor_in_huge_pages_is_zeroed_and_aligned():
    from tandem.engine.runtime.huge_pages import zeros_in_huge_pages

    t = zeros_in_huge_pages((3, 2, 100, 16, 3, 64), torch.bfloat16)   # 3.5 MiB
    assert t.is_contiguous() and t.data_ptr() % (2 << 20) == 0
    assert t.shape == (3, 2, 100, 16, 3, 64) and not t.any()
    t[2, 1, 99] = 1.5
    assert t.view(-1)[-1] == 1.5 and t.sum() == 1.5 * 16 * 3 * 64
    small = zeros_in_huge_pages((4, 4), torch.float32)                 # below 2 MiB: torch.zeros
    assert not small.any()
