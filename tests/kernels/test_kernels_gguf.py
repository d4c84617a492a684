"""GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K weights: torch reference
against the gguf package, and the Triton dequant-GEMM against the reference.

Tolerances are per output element and scale with ``mag = |x| @ |W|.T``, the
sum of the magnitudes of the products it adds up (float32):

* float32: ``2e-5 * mag``, well above the rounding of a float32 sum of K <= 160
  products (``K * 2**-24``) and at the worst case for the K-quants' K <= 1280
  (reached only if every rounding went one way); the kernel and torch differ only
  in order.
* float16: ``1e-3 * mag``: the kernel rounds each dequantized weight to float16
  (``2**-11`` relative) and the result once more (``2**-11 * |out| <= 2**-11 * mag``).
* bfloat16 (CUDA): ``8e-3 * mag``, the same two roundings at ``2**-8``.
"""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k
from tandem.kernels.gguf_linear import gguf_block_config, gguf_linear
from tandem.kernels.reference import (GGUF_BLOCK_SIZES, dequantize_gguf_reference,
                                      gguf_linear_reference)

QT = gguf.GGMLQuantizationType
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1), int(QT.Q8_0)
Q4_K, Q6_K = int(QT.Q4_K), int(QT.Q6_K)
QTYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K]
QTYPE_IDS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"]
KQUANTS = (Q4_K, Q6_K)
# Byte ranges of each type's fp16 fields in a block (the rest are codes and scales).
FP16_FIELDS = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2],
               Q6_K: [208]}


def _k(qtype: int, k: int) -> int:
    """A test's row length for ``qtype``: K-quant rows are 8x longer (super-blocks
    of 256 weights, against blocks of 32)."""
    return 8 * k if qtype in KQUANTS else k

TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _quantized(n: int, k: int, qtype: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """``(qweight, gguf's float32 dequantization)`` of random ``[n, k]`` weights."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    # Rows of different scale, one all-zero block (d = 0).
    w *= rng.uniform(0.01, 2.0, size=(n, 1)).astype(np.float32)
    w[0, :32] = 0.0
    if qtype == Q4_K:
        packed = quantize_q4_k(w)
    elif qtype == Q6_K:
        packed = quantize_q6_k(w)
    else:
        packed = quantize(w, QT(qtype))
    return torch.from_numpy(packed), dequantize(packed, QT(qtype))


def _assert_close(got: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                  dtype: torch.dtype) -> None:
    k = x.shape[1]
    want = gguf_linear_reference(x, qweight, qtype, k)
    w = dequantize_gguf_reference(qweight, qtype, k)
    mag = x.float().abs() @ w.abs().T
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs()
    assert torch.all(err <= TOL[dtype] * mag), (err / mag).max().item()


def test_block_sizes_match_gguf():
    assert sorted(GGUF_BLOCK_SIZES) == sorted(QTYPES)
    for qtype in QTYPES:
        assert GGUF_BLOCK_SIZES[qtype] == gguf.GGML_QUANT_SIZES[QT(qtype)]


@pytest.mark.parametrize("qtype", QTYPES, ids=QTYPE_IDS)
@pytest.mark.parametrize("n,k", [(5, 32), (40, 96), (67, 160)])
def test_reference_dequant_equals_gguf(qtype, n, k):
    k = _k(qtype, k)
    qweight, want = _quantized(n, k, qtype)
    got = dequantize_gguf_reference(qweight, qtype, k)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(want))
    half = dequantize_gguf_reference(qweight, qtype, k, dtype=torch.float16)
    assert torch.equal(half, got.half())


def _fp16_bytes(v: float) -> list[int]:
    return list(np.array([v], dtype=np.float16).view(np.uint8))


def _handmade(qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of two blocks with known bytes, and their exact weights ``[2, 64]``."""
    scales = [[0.5, -0.25], [2.0, 1.5]]
    rows, weights = [], []
    for r in range(2):
        row_bytes, row_w = [], []
        for b in range(2):
            d = scales[r][b]
            if qtype == Q8_0:
                qs = [(8 * j + 40 * r + 3 * b) % 256 - 128 for j in range(32)]
                row_bytes += _fp16_bytes(d) + [v & 0xFF for v in qs]
                row_w += [v * d for v in qs]
                continue
            lo = [(i + r + b) % 16 for i in range(16)]
            hi = [(15 - i + 3 * b) % 16 for i in range(16)]
            qs = [lo[i] | (hi[i] << 4) for i in range(16)]
            if qtype == Q4_0:
                row_bytes += _fp16_bytes(d) + qs
                row_w += [(q - 8) * d for q in lo + hi]
            else:
                m = -1.0 - r
                row_bytes += _fp16_bytes(d) + _fp16_bytes(m) + qs
                row_w += [q * d + m for q in lo + hi]
        rows.append(row_bytes)
        weights.append(row_w)
    return torch.tensor(rows, dtype=torch.uint8), torch.tensor(weights, dtype=torch.float32)


def _random_blocks(n: int, k: int, qtype: int, seed: int) -> torch.Tensor:
    """Rows of random bytes of ``qtype`` blocks, each fp16 field set to a finite value
    (so every code, scale and bit pattern occurs)."""
    weights, nbytes = GGUF_BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        vals = rng.uniform(-0.1, 0.1, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(n, -1))


@pytest.mark.parametrize("qtype", QTYPES, ids=QTYPE_IDS)
def test_random_bytes_decode_as_gguf_reads_them(device, qtype):
    """Every byte of a block random: the reference decodes what gguf-py decodes, bit
    for bit, and the kernel multiplies exactly those weights (x = I: each output is
    one product w * 1)."""
    k = _k(qtype, 64)
    qweight = _random_blocks(3, k, qtype, seed=qtype)
    want = torch.from_numpy(np.asarray(dequantize(qweight.numpy(), QT(qtype))).reshape(3, k))
    assert torch.equal(dequantize_gguf_reference(qweight, qtype, k), want)
    got = gguf_linear(torch.eye(k, device=device), qweight.to(device), qtype, k)
    assert torch.equal(got.cpu(), want.T)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0], ids=["q4_0", "q4_1", "q8_0"])
def test_handmade_blocks_decode_exactly(device, qtype):
    """Byte layout pinned by hand: scale bytes, nibble order, block and row order."""
    qweight, want = _handmade(qtype)
    assert torch.equal(dequantize_gguf_reference(qweight, qtype, 64), want)
    from_gguf = dequantize(qweight.numpy(), gguf.GGMLQuantizationType(qtype))
    assert torch.equal(torch.from_numpy(from_gguf), want)
    # x = I: every output is one product w * 1, exact in float32.
    eye = torch.eye(64, device=device)
    got = gguf_linear(eye, qweight.to(device), qtype, 64)
    assert torch.equal(got.cpu(), want.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("qtype", QTYPES, ids=QTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 67, 160), (17, 5, 32)])
def test_gguf_linear_matches_reference(device, qtype, dtype, m, n, k):
    k = _k(qtype, k)
    qweight, _ = _quantized(n, k, qtype, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = gguf_linear(x.to(device), qweight.to(device), qtype, k)
    _assert_close(got.cpu(), x, qweight, qtype, dtype)


@pytest.mark.parametrize("qtype", QTYPES, ids=QTYPE_IDS)
def test_gguf_linear_strided_views_and_tiles(device, qtype):
    """Row-strided x / qweight / out views; K steps that do not divide K (5 blocks)."""
    m, n, k = 18, 33, _k(qtype, 160)
    big, _ = _quantized(2 * n, k, qtype, seed=7)
    qweight = big[::2]                                   # row stride 2 * row_bytes
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k + 24, generator=gen)[:, 8:8 + k]
    for block_k in (32, 128) + ((512,) if qtype in KQUANTS else ()):
        out_big = torch.full((m, n + 5), float("nan"), device=device)
        out = out_big[:, 2:2 + n]
        got = gguf_linear(x.to(device), qweight.to(device), qtype, k, out=out,
                          block_m=16, block_n=16, block_k=block_k)
        assert got.data_ptr() == out.data_ptr()
        _assert_close(got.cpu(), x, qweight, qtype, torch.float32)
        assert torch.isnan(out_big[:, :2]).all() and torch.isnan(out_big[:, 2 + n:]).all()


def test_gguf_linear_empty_batch(device):
    qweight, _ = _quantized(4, 32, Q8_0)
    got = gguf_linear(torch.empty(0, 32, device=device), qweight.to(device), Q8_0, 32)
    assert got.shape == (0, 4)


def test_block_config_is_valid(device):
    for m in (1, 16, 17, 64, 65, 4096):
        cfg = gguf_block_config(m, 4096, device)
        assert cfg["block_m"] >= 16 and cfg["block_n"] >= 16
        assert cfg["block_k"] % 32 == 0


def _bad_cases():
    q8, _ = _quantized(4, 64, Q8_0)
    x = torch.zeros(2, 64)
    return [
        # (kwargs overriding the good call, field named in the error)
        (dict(qtype=13), "qtype"),                               # Q5_K: not supported
        (dict(qtype=Q4_K), "in_features"),                       # 64: not whole super-blocks
        (dict(qtype="Q8_0"), "qtype"),
        (dict(in_features=48), "in_features"),
        (dict(in_features=0), "in_features"),
        (dict(qweight=q8.float()), "qweight"),
        (dict(qweight=q8[:, :-1]), "qweight"),                   # row_bytes mismatch
        (dict(qweight=q8.flatten()), "qweight"),
        (dict(qtype=Q4_0), "qweight"),                           # Q8_0 bytes as Q4_0
        (dict(x=torch.zeros(2, 32)), "x"),
        (dict(x=torch.zeros(64)), "x"),
    ], q8, x


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_bad_arguments_name_the_field(device, case):
    cases, q8, x = _bad_cases()
    override, field = cases[case]
    args = dict(x=x, qweight=q8, qtype=Q8_0, in_features=64) | override
    with pytest.raises(ValueError, match=f"^{field}:"):
        gguf_linear_reference(**args)
    with pytest.raises(ValueError, match=f"^{field}:"):
        gguf_linear(**{key: v.to(device) if isinstance(v, torch.Tensor) else v
                       for key, v in args.items()})
    if field != "x":
        with pytest.raises(ValueError, match=f"^{field}:"):
            dequantize_gguf_reference(args["qweight"], args["qtype"], args["in_features"])


def test_kernel_only_bad_arguments(device):
    q8, _ = _quantized(4, 64, Q8_0)
    q8 = q8.to(device)
    x = torch.zeros(2, 64, device=device)
    for kwargs, field in [
        (dict(x=x.to(torch.int32)), "x"),
        (dict(x=torch.zeros(64, 2, device=device).T), "x"),       # innermost stride 2
        (dict(out=torch.zeros(2, 5, device=device)), "out"),
        (dict(out=torch.zeros(2, 4, dtype=torch.float16, device=device)), "out"),
        (dict(block_k=48), "block_k"),
        (dict(block_n=8), "block_n"),
        (dict(block_m=24), "block_m"),
    ]:
        args = dict(x=x, qweight=q8, qtype=Q8_0, in_features=64) | kwargs
        with pytest.raises(ValueError, match=f"^{field}:"):
            gguf_linear(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", QTYPES, ids=QTYPE_IDS)
@pytest.mark.parametrize("m", [1, 16, 17, 200])
def test_gguf_linear_cuda_bfloat16(qtype, m):
    n, k = 1000, 4096
    qweight, _ = _quantized(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    cuda = torch.device("cuda")
    got = gguf_linear(x.to(cuda), qweight.to(cuda), qtype, k)
    # The reference is pure torch: on the GPU it dequantizes bit for bit as on CPU.
    assert torch.equal(dequantize_gguf_reference(qweight.to(cuda), qtype, k).cpu(),
                       dequantize_gguf_reference(qweight, qtype, k))
    _assert_close(got.cpu(), x, qweight, qtype, torch.bfloat16)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_int4_zp_rows_through_the_kernel(device, act_order, dtype):
    """GPTQ / AWQ int4 as INT4_ZP rows (engine/quantization/int4_packed.py): the
    reference decodes exactly the dense dequantization's weights, and the kernel (and
    int4_zp_linear, which gathers act-order columns) multiplies them."""
    from tandem.engine.quantization.int4_packed import dequantize_int4_zp, int4_zp_linear
    from tandem.kernels.reference import INT4_ZP
    from tests.test_gguf_native import int4_zp_weight

    n, k = 40, 160
    blocks, perm, dense = int4_zp_weight(n, k, 32, act_order, seed=5)
    g = torch.Generator().manual_seed(5)
    sorted_dense = dense if perm is None else dense[:, perm]
    assert torch.equal(dequantize_gguf_reference(blocks, INT4_ZP, k), sorted_dense)
    assert torch.equal(dequantize_int4_zp(blocks.to(device), perm, k).cpu(), dense)
    x = torch.randn(3, k, generator=g).to(dtype)
    xs = x if perm is None else x[:, perm]
    got = gguf_linear(xs.to(device), blocks.to(device), INT4_ZP, k)
    _assert_close(got.cpu(), xs, blocks, INT4_ZP, dtype)
    if device.type == "cuda":
        y = int4_zp_linear(x.to(device), blocks.to(device),
                           None if perm is None else perm.to(device), k)
        _assert_close(y.cpu(), xs, blocks, INT4_ZP, dtype)
