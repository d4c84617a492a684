"""Int8 activation blocks (``activation_quantization="int8"``): the CPU kernel that
multiplies GGUF / INT4_ZP weight blocks by int8-quantized activations, against its
torch reference, and the engine serving the real model with it."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tandem.engine.model.linear import Linear
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.kernels.cpu.gguf_linear import (INT4_ZP, MAX_FUSED_ROWS, MAX_INT8_ROWS,
                                            gguf_kernels_available, gguf_linear, int8_dot_tier,
                                            quantize_activations)
from tandem.kernels.reference import (dequantize_gguf_reference, gguf_linear_int8_reference,
                                      quantize_activations_reference)
from tests.test_gguf_native import TYPES, _k, int4_zp_weight, quantized
# The module-scoped fixtures of the GGUF tests, shared by name.
from tests.test_gguf_native import gguf_llm, portable_lib  # noqa: F401

pytestmark = pytest.mark.skipif(not gguf_kernels_available(),
                                reason="compiled CPU kernels unavailable")


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with an all-zero chunk (scale 0), a chunk with an outlier and
    values on rounding ties (x / d = n + 1/2 exactly)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 32:64] = 0.0
    if k >= 128:
        x[:, 64] = 50.0
        x[:, 96:128] = torch.arange(32) - 15.5      # with 127 as the max: d = 1, and
        x[:, 127] = 127.0                            # -15.5 .. 14.5 round to even
    return x


@pytest.mark.parametrize("m,k", [(1, 64), (3, 160), (9, 1024)])
def test_activation_blocks_are_the_reference_exactly(m, k):
    x = _activations(m, k, seed=m)
    got = quantize_activations(x)
    want = quantize_activations_reference(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    codes, d, _ = got
    assert codes.abs().max() <= 127 and (d[:, 1] == 0).all() and (codes[:, 32:64] == 0).all()
    if k >= 128:
        assert (d[:, 3] == 1).all()
        assert codes[0, 96:100].tolist() == [-16, -14, -14, -12]   # -15.5, -14.5, -13.5, -12.5
    # each chunk's largest value maps to +-127, and the codes are within half a step
    assert (codes.reshape(m, -1, 32).abs().amax(-1)[d > 0] == 127).all()
    err = (codes.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k) - x.double()
    assert (err.abs().reshape(m, -1, 32) <= 0.5 * d.double()[..., None] * (1 + 1e-6)).all()


def _case(qtype, n: int, k: int, seed: int):
    if qtype == INT4_ZP:
        blocks, _, dense = int4_zp_weight(n, k, 64, act_order=False, seed=seed)
        return blocks, dense
    return quantized(n, k, qtype, seed=seed)


ALL_TYPES = [*TYPES, INT4_ZP]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: getattr(t, "name", "INT4_ZP"))
@pytest.mark.parametrize("m", [1, 4, 7, MAX_FUSED_ROWS + 1, MAX_INT8_ROWS])
def test_int8_product_matches_its_reference(qtype, m):
    n, k = 37, _k(qtype, 256) if qtype != INT4_ZP else 256
    qweight, dense = _case(qtype, n, k, seed=m)
    x = _activations(m, k, seed=m)
    y = gguf_linear(x, qweight, int(qtype), k, activations="int8")
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = gguf_linear_int8_reference(x, qweight, int(qtype), k).double()
    codes, d, _ = quantize_activations_reference(x)
    xq = (codes.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k)
    scale = xq.abs() @ dense.abs().double().T
    # float32 rounding of the per-chunk scale products and the sums: a few ulps of the
    # row's magnitude
    assert ((y.double() - ref).abs() <= 4e-6 * k / 256 * scale + 1e-30).all()
    # and the activation rounding moves the product by less than half a code step
    # per value: |x~ - x| <= d / 2
    full = x.double() @ dense.double().T
    step = (d.double().repeat_interleave(32, dim=1) / 2) @ dense.abs().double().T
    assert ((y.double() - full).abs() <= step * (1 + 1e-4) + 4e-6 * scale).all()
    yb = gguf_linear(x.bfloat16(), qweight, int(qtype), k, activations="int8")
    refb = gguf_linear_int8_reference(x.bfloat16(), qweight, int(qtype), k).double()
    assert yb.dtype == torch.bfloat16
    scale_b = (quantize_activations_reference(x.bfloat16())[0].double().abs().reshape(m, -1, 32)
               * quantize_activations_reference(x.bfloat16())[1].double()[..., None]
               ).reshape(m, k) @ dense.abs().double().T
    assert ((yb.double() - refb).abs() <= 2 ** -8 * refb.abs() + 4e-6 * scale_b).all()


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q6_K, INT4_ZP],
                         ids=lambda t: getattr(t, "name", "INT4_ZP"))
def test_int8_rows_do_not_depend_on_the_batch(qtype):
    """Each row is quantized and summed alone: the same bits for a row whatever the
    batch (the batch-invariant path with ``fused_only``, any ``M``)."""
    n, k = 24, _k(qtype, 128) if qtype != INT4_ZP else 128
    qweight, _ = _case(qtype, n, k, seed=5)
    x = torch.randn(2 * MAX_INT8_ROWS + 5, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([gguf_linear(x[i:i + 1], qweight, int(qtype), k, activations="int8")
                       for i in range(len(x))])
    for rows in (3, 9, len(x)):
        batched = gguf_linear(x[:rows], qweight, int(qtype), k, fused_only=True,
                              activations="int8")
        assert torch.equal(batched, alone[:rows])


def test_prefill_sized_products_keep_the_float_gemm():
    qweight, _ = quantized(40, 128, QT.Q4_1)
    x = torch.randn(MAX_INT8_ROWS + 1, 128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gguf_linear(x, qweight, int(QT.Q4_1), 128, activations="int8"),
                       gguf_linear(x, qweight, int(QT.Q4_1), 128))
    with pytest.raises(ValueError, match="activations"):
        gguf_linear(x, qweight, int(QT.Q4_1), 128, activations="fp8")
    with pytest.raises(ValueError, match="x"):
        quantize_activations(torch.randn(2, 48))


def test_the_dot_product_tier_is_the_cpus():
    """The build's integer dot product follows the CPU: vpdpbusd where it has
    AVX-512 VNNI (or AVX-VNNI), maddubs on AVX2."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    if "avx512_vnni" in flags and "avx512vl" in flags or "avx_vnni" in flags:
        assert int8_dot_tier() == 2
    elif "avx2" in flags and "fma" in flags:
        assert int8_dot_tier() == 1


def test_portable_tier_int8_product(portable_lib):
    """The portable loops (a CPU without AVX2) compute the same int8 product."""
    import ctypes

    lib = portable_lib
    assert lib.tandem_gguf_int8_dot_tier() == 0
    for qtype in ALL_TYPES:
        n, k = 9, _k(qtype, 128) if qtype != INT4_ZP else 128
        qweight, dense = _case(qtype, n, k, seed=int(qtype))
        x = _activations(3, k, seed=1)
        y = torch.empty(3, n)
        lib.tandem_gguf_linear_q8_f32(ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(n),
                                      ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k),
                                      ctypes.c_void_p(qweight.data_ptr()), int(qtype),
                                      ctypes.c_int64(3), ctypes.c_int64(n), ctypes.c_int64(k), 1)
        ref = gguf_linear_int8_reference(x, qweight, int(qtype), k).double()
        codes, d, _ = quantize_activations_reference(x)
        xq = (codes.double().reshape(3, -1, 32) * d.double()[..., None]).reshape(3, k)
        scale = xq.abs() @ dense.abs().double().T
        assert ((y.double() - ref).abs() <= 4e-6 * scale + 1e-30).all(), qtype


# -- the engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8_llm(f32_weights):
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=64, quantization="gguf",
               activation_quantization="int8")


def test_engine_multiplies_int8_activations_in_decode(int8_llm, gguf_llm, monkeypatch):
    """Every packed layer (the tied output projection too) is flagged, and each
    product of a decode-sized step is the int8 one: checked call by call against
    :func:`gguf_linear_int8_reference` on the very activations the engine passes.

    (The whole model is not compared with a reference engine: an int8 code that
    rounds the other way after a float32 rounding difference of one ulp moves that
    value by a quantization step, and 30 layers carry it to ~0.05 nats, which is
    the size of the int8 activations' own effect; ``benchmarks/perplexity.py``
    ``gguf-q4_1-int8act`` measures that effect on held-out text.)"""
    from tandem.engine.quantization import gguf_linear as method

    layers = [m for m in int8_llm.engine.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * int8_llm.engine.model_config.num_layers + 1
    assert all(m.int8_activations for m in layers)
    assert not any(m.int8_activations for m in gguf_llm.engine.model.modules()
                   if isinstance(m, Linear))
    kernel = method.gguf_linear
    seen = {"int8": 0, "float": 0}

    def checked(x, qweight, qtype, in_features, fused_only=False, activations="float"):
        y = kernel(x, qweight, qtype, in_features, fused_only, activations)
        if activations == "int8" and x.shape[0] <= MAX_INT8_ROWS:
            seen["int8"] += 1
            ref = gguf_linear_int8_reference(x, qweight, qtype, in_features).double()
            codes, d, _ = quantize_activations_reference(x)
            xq = (codes.double().reshape(len(x), -1, 32) * d.double()[..., None])
            w = dequantize_gguf_reference(qweight, qtype, in_features).double()
            scale = xq.reshape(len(x), in_features).abs() @ w.abs().T
            assert ((y.double() - ref).abs() <= 4e-6 * in_features / 256 * scale + 1e-30).all()
        else:
            seen["float"] += 1
        return y

    monkeypatch.setattr(method, "gguf_linear", checked)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [int8_llm.tokenizer.encode(p) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = int8_llm.generate(ids, greedy)
    # the prompts' steps (5-6 tokens) and 7 decode steps of both, every layer
    assert seen["int8"] >= 8 * (4 * 30 + 1) and seen["float"] == 0
    monkeypatch.undo()
    floats = gguf_llm.generate(ids, greedy)
    assert got[0].outputs[0].token_ids[0] == floats[0].outputs[0].token_ids[0]   # " Paris"


def test_activation_quantization_needs_quantized_blocks_on_the_cpu(f32_weights):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm import LLM

    with pytest.raises(ValueError, match="activation_quantization"):
        LLM(dtype="float32", num_blocks=8, activation_quantization="int8")   # dense layers
    with pytest.raises(ValueError, match="activation_quantization"):
        EngineConfig(activation_quantization="fp8")
    with pytest.raises(ValueError, match="activation_quantization"):
        EngineConfig(device="cuda", activation_quantization="int8")


def test_cli_flag(capsys):
    from tandem.router.cli import main

    assert main(["generate", "--quantization", "gguf", "--activation-quantization", "int8",
                 "--dtype", "float32", "--max-tokens", "3", "--num-blocks", "16",
                 "The capital of France is"]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["generate", "--activation-quantization", "int8", "--max-tokens", "1",
                 "--num-blocks", "16", "Hi"]) != 0
    err = capsys.readouterr().err
    assert "--activation-quantization: 'int8' needs linear layers kept in quantized blocks" in err
    assert "--quantization gguf" in err and "Traceback" not in err


def test_serve_reports_a_workers_config_error_in_one_line():
    """``tandem serve``: a worker whose engine refuses the configuration dies in its
    creation task; the launcher turns the driver's ``ActorDiedError`` back into that
    ``ValueError``'s message (printed by ``main`` as one ``error:`` line)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from tandem.router.launcher import worker_config_error as _worker_config_error

    msg = "activation_quantization: 'int8' needs linear layers kept in quantized blocks"
    died = ActorDiedError(cause=RayTaskError(
        "DecodeWorker.__init__", f"Traceback (most recent call last):\n  ...\nValueError: {msg}",
        ValueError(msg)))
    assert _worker_config_error(died) == msg
    assert _worker_config_error(ActorDiedError()) is None          # died for another reason
    assert _worker_config_error(RuntimeError(msg)) is None
