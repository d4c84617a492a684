"""The ``gguf`` linear method: GGUF blocks kept packed, multiplied by the compiled CPU
kernel, against dequantize-then-matmul (``gguf.quants``) and the dense model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from tandem.engine.model.linear import Linear
from tandem.engine.model.weights import WeightLoadError
from tandem.engine.quantization.gguf_linear import GGUFLinearMethod
from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.kernels.cpu.gguf_linear import (GGUF_NATIVE_TYPES, MAX_FUSED_ROWS, gguf_dequantize,
                                            gguf_kernels_available, gguf_linear, row_bytes)

pytestmark = pytest.mark.skipif(not gguf_kernels_available(),
                                reason="compiled CPU kernels unavailable")
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q6_K]
KQUANTS = (QT.Q4_K, QT.Q6_K)


def _k(qtype: QT, k: int) -> int:
    """A test's row length for ``qtype``: 8x for the K-quants' 256-weight super-blocks."""
    return 8 * k if qtype in KQUANTS else k


def quantized(n: int, k: int, qtype: QT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight uint8 [n, row_bytes], its float32 weights [n, k])``: quantized by
    gguf-py (the K-quants by Tandem's quantizer), dequantized by gguf-py."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = ({QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}[qtype](w) if qtype in KQUANTS
              else quantize(w, qtype))
    dense = np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(n, k)
    return torch.from_numpy(blocks), torch.from_numpy(dense.copy())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(5, 32), (67, 160), (200, 576)])
def test_dequantize_is_gguf_exactly(qtype, n, k):
    k = _k(qtype, k)
    qweight, dense = quantized(n, k, qtype)
    assert qweight.shape == (n, row_bytes(int(qtype), k))
    assert torch.equal(gguf_dequantize(qweight, int(qtype), k), dense)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 7, MAX_FUSED_ROWS + 1, 40])
def test_linear_matches_dequantize_then_matmul(qtype, m):
    n, k = 67, _k(qtype, 160)
    qweight, dense = quantized(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = (x.double() @ dense.double().T)
    y = gguf_linear(x, qweight, int(qtype), k)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # float32 sums of k products in another order: a few ulps of the row's scale
    # (1e-6 for 160 products; the bound grows with k).
    scale = (x.abs().double() @ dense.abs().double().T)
    assert ((y.double() - ref).abs() <= 1e-6 * k / 160 * scale + 1e-30).all()
    xb = x.bfloat16()
    yb = gguf_linear(xb, qweight, int(qtype), k)
    refb = xb.double() @ dense.double().T
    assert yb.dtype == torch.bfloat16
    # one bfloat16 rounding of the result (relative 2^-8) on top of float32 sums
    assert ((yb.double() - refb).abs() <= 2 ** -8 * refb.abs() + 1e-6 * scale).all()


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K])
def test_fused_kernel_rows_do_not_depend_on_the_batch(qtype):
    n, k = 40, _k(qtype, 96)
    qweight, _ = quantized(n, k, qtype)
    x = torch.randn(2 * MAX_FUSED_ROWS + 3, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([gguf_linear(x[i:i + 1], qweight, int(qtype), k) for i in range(len(x))])
    for rows in (2, 5, len(x)):
        batched = gguf_linear(x[:rows], qweight, int(qtype), k, fused_only=True)
        assert torch.equal(batched, alone[:rows])


def test_bad_arguments_are_named():
    qweight, _ = quantized(8, 64, QT.Q4_1)
    with pytest.raises(ValueError, match="qtype"):
        gguf_linear(torch.randn(1, 64), qweight, int(QT.Q5_K), 64)
    with pytest.raises(ValueError, match="in_features"):
        row_bytes(int(QT.Q8_0), 48)
    with pytest.raises(ValueError, match="in_features.*256"):
        row_bytes(int(QT.Q4_K), 576)
    with pytest.raises(ValueError, match="qweight"):
        gguf_linear(torch.randn(1, 64), qweight[:, :20].contiguous(), int(QT.Q4_1), 64)
    with pytest.raises(ValueError, match="qweight"):
        gguf_linear(torch.randn(1, 64), qweight.to(torch.int8), int(QT.Q4_1), 64)
    with pytest.raises(ValueError, match="x"):
        gguf_linear(torch.randn(1, 32), qweight, int(QT.Q4_1), 64)
    with pytest.raises(ValueError, match="x"):
        gguf_linear(torch.randn(1, 64, dtype=torch.float64), qweight, int(QT.Q4_1), 64)


def _fused_layer(shards: list[tuple[torch.Tensor, int]], k: int) -> Linear:
    layer = Linear(k, [q.shape[0] for q, _ in shards], GGUFLinearMethod(), torch.float32)
    for i, (q, t) in enumerate(shards):
        layer.load_weight("qweight", q, i)
        layer.load_weight("qweight_type", torch.tensor(t), i)
    layer.process_weights_after_loading()
    return layer


def test_fused_layer_of_mixed_native_types_keeps_each_shards_blocks():
    """q/k/v as llama.cpp's _M mixes store them: Q5_0, Q5_0 and a Q8_0 attn_v."""
    k = 96
    shards = [quantized(24, k, QT.Q5_0, 1), quantized(8, k, QT.Q5_0, 2),
              quantized(8, k, QT.Q8_0, 3)]
    types = [int(QT.Q5_0), int(QT.Q5_0), int(QT.Q8_0)]
    layer = _fused_layer([(q, t) for (q, _), t in zip(shards, types)], k)
    assert layer.dense_weight is None and layer.qtype is None
    assert layer.qweight.dim() == 1
    assert torch.equal(layer.qweight, torch.cat([q.reshape(-1) for q, _ in shards]))
    assert layer.qweight_type.tolist() == types
    assert [t for _, t in layer.shard_weights] == types
    for (view, _), (q, _) in zip(layer.shard_weights, shards):
        assert torch.equal(view, q)
        assert view.untyped_storage().data_ptr() == layer.qweight.untyped_storage().data_ptr()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    want = x.double() @ torch.cat([d for _, d in shards]).double().T
    assert ((layer(x).double() - want).abs() <= 1e-5).all()
    one = layer(x[:1])                     # the decode path, one row
    assert ((one.double() - want[:1]).abs() <= 1e-5).all()


def test_fused_layer_keeps_blocks_and_mixed_types_fall_back_to_dense():
    k = 96
    (q1, d1), (q2, d2) = quantized(24, k, QT.Q4_1, 1), quantized(16, k, QT.Q4_1, 2)
    x = torch.randn(3, k)
    layer = _fused_layer([(q1, int(QT.Q4_1)), (q2, int(QT.Q4_1))], k)
    assert layer.qtype == int(QT.Q4_1) and layer.dense_weight is None
    assert torch.equal(layer.qweight, torch.cat([q1, q2]))
    torch.testing.assert_close(layer(x), x @ torch.cat([d1, d2]).T, rtol=1e-5, atol=1e-5)
    # A Q8_0 shard beside an F16 one: no single kernel, so one dense weight.
    q3, d3 = quantized(16, k, QT.Q8_0, 3)
    f16 = torch.from_numpy(d2.numpy().astype(np.float16).view(np.uint8).copy())
    mixed = _fused_layer([(q3, int(QT.Q8_0)), (f16, int(QT.F16))], k)
    assert mixed.qtype is None and not hasattr(mixed, "qweight")
    expected = torch.cat([d3, d2.half().float()])
    assert torch.equal(mixed.dense_weight, expected)
    with pytest.raises(WeightLoadError, match="qweight"):
        _fused_layer([(q1[:, :-2].contiguous(), int(QT.Q4_1)), (q2, int(QT.Q4_1))], k)
    with pytest.raises(WeightLoadError, match="qweight"):
        Linear(k, 24, GGUFLinearMethod(), torch.float32).load_weight("qweight", q2, None)


@pytest.fixture(scope="module")
def gguf_llm(f32_weights):
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=64, quantization="gguf")


def test_real_model_keeps_q4_1_blocks(gguf_llm, model_files):
    cfg = gguf_llm.engine.model_config
    model = gguf_llm.engine.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert len(layers) == 4 * cfg.num_layers
    assert {m.qtype for m in layers} == {int(QT.Q4_1)}     # the file's projections are Q4_1
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    held = sum(m.qweight.numel() for m in layers)
    assert held == cfg.num_layers * per_layer // 32 * 20      # 20 bytes per 32 weights
    assert not any(hasattr(m, "weight") for m in layers)
    # The tied output projection multiplies by the embedding's own Q8_0 blocks.
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.qtype == head.qtype == int(QT.Q8_0)
    assert head.qweight.data_ptr() == embed.qweight.data_ptr()
    assert embed.qweight.shape == (cfg.vocab_size, cfg.hidden_size // 32 * 34)


def test_real_model_matches_dense_and_transformers(gguf_llm, f32_weights, hf_greedy):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [f32_weights.tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    native = gguf_llm.generate(ids, greedy)
    dense = f32_weights.generate(ids, greedy)
    for p, a, b in zip(ids, native, dense):
        assert a.outputs[0].token_ids == hf_greedy(p, 16)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert lp_a.token_id == lp_b.token_id
            assert math.isclose(lp_a.logprob, lp_b.logprob, abs_tol=2e-4)


def test_bfloat16_activations_over_the_packed_blocks(gguf_llm):
    """bfloat16 activations: the embedding's rows, the layers' outputs and a dense
    fallback all take the model dtype (packed layers have no float parameter that
    ``.to(dtype)`` would convert)."""
    from tandem.engine.llm import LLM

    bf16 = LLM(dtype="bfloat16", num_blocks=16, quantization="gguf")
    model = bf16.engine.model
    ids = torch.tensor(bf16.tokenizer.encode("The capital of France is"))
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    got = bf16.generate([ids.tolist()], greedy)[0].outputs[0].token_ids
    want = gguf_llm.generate([ids.tolist()], greedy)[0].outputs[0].token_ids
    assert got[0] == want[0]           # " Paris": far from any near-tie


@pytest.fixture(scope="module")
def q4_k_m_file(gguf_source, tmp_path_factory):
    """The default model rewritten as llama.cpp's Q4_K_M mix (Q4_K / Q6_K rows where
    the rows are whole super-blocks, Q5_0 / Q8_0 where the 576-wide rows are not)."""
    from tandem.quantize.gguf_writer import requantize_gguf

    path = str(tmp_path_factory.mktemp("q4_k_m") / "model-Q4_K_M.gguf")
    requantize_gguf(gguf_source, path, "Q4_K_M")
    return path


@pytest.mark.slow
def test_q4_k_m_file_served_from_its_blocks_as_dequantized(q4_k_m_file, monkeypatch):
    """Every layer of a Q4_K_M file stays in its blocks, with the mix's types layer by
    layer; greedy tokens and prompt logprobs equal dequantize-then-matmul's (the same
    file loaded with every layer dequantized by gguf-py: the fallback of a machine
    without the compiled kernels)."""
    from tandem.engine.llm import LLM
    from tandem.engine.quantization import gguf_linear as method
    from tandem.quantize.gguf_writer import q4_k_m_type

    native = LLM(q4_k_m_file, dtype="float32", num_blocks=64, quantization="gguf")
    model, n = native.engine.model, native.engine.model_config.num_layers
    for i, layer in enumerate(model.model.layers):
        v_bits = q4_k_m_type(f"blk.{i}.attn_v.weight", n, False) == "Q6_K"
        qkv = layer.self_attn.qkv_proj
        if v_bits:      # attn_v in Q8_0 (Q6_K's fallback) beside Q5_0 q and k
            assert qkv.qweight_type.tolist() == [int(QT.Q5_0)] * 2 + [int(QT.Q8_0)]
        else:
            assert qkv.qtype == int(QT.Q5_0)
        down = layer.mlp.down_proj.qtype
        assert down == int(QT.Q6_K if q4_k_m_type(f"blk.{i}.ffn_down.weight", n, False)
                           == "Q6_K" else QT.Q4_K)
        assert layer.mlp.gate_up_proj.qtype == layer.self_attn.o_proj.qtype == int(QT.Q5_0)
        assert all(m.dense_weight is None for m in (qkv, layer.mlp.down_proj))
    assert model.model.embed_tokens.qtype == int(QT.Q8_0)
    assert sum(layer.mlp.down_proj.qtype == int(QT.Q6_K) for layer in model.model.layers) == 14

    monkeypatch.setattr(method, "gguf_kernels_available", lambda: False)
    dense = LLM(q4_k_m_file, dtype="float32", num_blocks=64, quantization="gguf")
    layers = [m for m in dense.engine.model.modules() if isinstance(m, Linear)]
    assert all(m.dense_weight is not None for m in layers)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [dense.tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    for a, b in zip(native.generate(ids, greedy), dense.generate(ids, greedy)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert lp_a.token_id == lp_b.token_id
            assert math.isclose(lp_a.logprob, lp_b.logprob, abs_tol=2e-4)


def test_the_kernels_block_sizes_are_the_tables():
    """The compiled kernels and the Python tables agree on every native type's block
    (and read no other type)."""
    from tandem.kernels.cpu.gguf_linear import _lib
    from tandem.kernels.reference import GGUF_BLOCK_SIZES

    for qtype, (_, weights, nbytes) in GGUF_NATIVE_TYPES.items():
        assert (_lib().tandem_gguf_block_weights(qtype), _lib().tandem_gguf_block_bytes(qtype)) \
            == (weights, nbytes) == GGUF_BLOCK_SIZES[qtype]
    assert sorted(GGUF_NATIVE_TYPES) == sorted(GGUF_BLOCK_SIZES)
    for other in (QT.F16, QT.Q5_K, QT.Q2_K):
        assert _lib().tandem_gguf_block_bytes(int(other)) == 0


def int4_zp_weight(n: int, k: int, group: int, act_order: bool, seed: int = 0):
    """``(blocks, perm, dense float32 [n, k])``: random GPTQ-style codes, zero points,
    float16 scales and groups (permuted under act-order), packed as INT4_ZP rows."""
    from tandem.engine.quantization.int4_packed import pack_int4_zp
    from tandem.engine.quantization.packing import dequantize_codes

    g = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (groups, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.05 + 1e-3).half()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    dense = dequantize_codes(codes, zeros.float().index_select(0, g_idx).t(),
                             scales.float().index_select(0, g_idx).t())
    blocks, perm = pack_int4_zp(codes, zeros, scales, g_idx)
    return blocks, perm, dense


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    """gguf_linear.cpp built for plain x86-64 (no AVX2, no F16C): the loops a CPU
    without AVX2 runs."""
    import ctypes
    import platform
    import subprocess

    from tandem.kernels.cpu.build import CSRC, find_compiler

    if platform.machine() != "x86_64":
        pytest.skip("the portable build is checked on x86-64")
    lib_path = tmp_path_factory.mktemp("portable") / "gguf_portable.so"
    subprocess.run([find_compiler(), "-O2", "-march=x86-64", "-fopenmp", "-std=c++17",
                    "-shared", "-fPIC", str(CSRC / "gguf_linear.cpp"), "-o", str(lib_path)],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(lib_path))


def test_portable_tier_decodes_every_type_as_gguf(portable_lib):
    """The portable loops: dequantization bit for bit gguf-py's (INT4_ZP: the dense
    dequantization's), and the product the dequantize-then-matmul one."""
    import ctypes

    from tandem.kernels.cpu.gguf_linear import INT4_ZP

    lib = portable_lib
    cases = [(t, *quantized(9, _k(t, 96), t, seed=int(t))) for t in TYPES]
    blocks, perm, dense = int4_zp_weight(9, 96, 32, act_order=False)
    cases.append((INT4_ZP, blocks, dense))
    for qtype, qweight, dense in cases:
        n, k = dense.shape
        out = torch.empty(n, k)
        lib.tandem_gguf_dequantize(ctypes.c_void_p(out.data_ptr()),
                                   ctypes.c_void_p(qweight.data_ptr()), int(qtype),
                                   ctypes.c_int64(n), ctypes.c_int64(k), 1)
        assert torch.equal(out, dense), qtype
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
        y = torch.empty(3, n)
        lib.tandem_gguf_linear_f32(ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(n),
                                   ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k),
                                   ctypes.c_void_p(qweight.data_ptr()), int(qtype),
                                   ctypes.c_int64(3), ctypes.c_int64(n), ctypes.c_int64(k), 1)
        ref = x.double() @ dense.double().T
        scale = x.abs().double() @ dense.abs().double().T
        assert ((y.double() - ref).abs() <= 1e-6 * k / 160 * scale).all(), qtype


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("m", [1, 5, MAX_FUSED_ROWS + 3])
def test_int4_zp_rows_are_the_dense_weight(act_order, m):
    """GPTQ / AWQ int4 rewritten as INT4_ZP blocks: dequantized back exactly (columns
    in the checkpoint's order), and multiplied like the dense weight, float32 and
    bfloat16, decode-sized and prefill-sized."""
    from tandem.engine.quantization.int4_packed import dequantize_int4_zp, int4_zp_linear

    n, k = 40, 256
    blocks, perm, dense = int4_zp_weight(n, k, 64, act_order, seed=m)
    assert blocks.shape == (n, k // 32 * 19) and blocks.dtype == torch.uint8
    assert (perm is not None) == act_order
    assert torch.equal(dequantize_int4_zp(blocks, perm, k), dense)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ dense.double().T
    scale = x.abs().double() @ dense.abs().double().T
    y = int4_zp_linear(x, blocks, perm, k)
    assert y.shape == (m, n) and ((y.double() - ref).abs() <= 2e-6 * scale).all()
    yb = int4_zp_linear(x.bfloat16(), blocks, perm, k)
    refb = x.bfloat16().double() @ dense.double().T
    assert yb.dtype == torch.bfloat16
    assert ((yb.double() - refb).abs() <= 2 ** -8 * refb.abs() + 2e-6 * scale).all()
    alone = torch.cat([int4_zp_linear(x[i:i + 1], blocks, perm, k) for i in range(m)])
    assert torch.equal(int4_zp_linear(x, blocks, perm, k, batch_invariant=True), alone)


def test_int4_zp_packing_refuses_what_it_cannot_hold():
    from tandem.engine.quantization.int4_packed import pack_int4_zp

    codes = torch.zeros(4, 64, dtype=torch.int32)
    zeros = torch.zeros(2, 4, dtype=torch.int32)
    scales = torch.full((2, 4), 0.5, dtype=torch.float16)
    g_idx = torch.arange(64) // 32
    pack_int4_zp(codes, zeros, scales, g_idx)                      # fine
    _, perm = pack_int4_zp(codes, zeros, scales, torch.arange(64) % 4 // 2)   # interleaved
    assert torch.equal(perm[:32] % 4 // 2, torch.zeros(32, dtype=torch.int64))
    for kwargs, field in [
        (dict(codes=torch.zeros(4, 48, dtype=torch.int32), g_idx=torch.arange(48) // 24),
         "codes"),                                                 # not whole blocks
        (dict(codes=codes + 16), "codes"),
        (dict(zeros=zeros - 1), "zeros"),
        (dict(scales=torch.full((2, 4), 0.1, dtype=torch.float32)), "scales"),   # not fp16
        (dict(g_idx=torch.arange(64) // 16, zeros=torch.zeros(4, 4, dtype=torch.int32),
              scales=torch.full((4, 4), 0.5, dtype=torch.float16)), "g_idx"),   # groups of 16
        (dict(zeros=zeros[:1]), "codes"),                          # shapes do not fit
    ]:
        args = dict(codes=codes, zeros=zeros, scales=scales, g_idx=g_idx) | kwargs
        with pytest.raises(ValueError, match=f"^{field}"):
            pack_int4_zp(**args)
