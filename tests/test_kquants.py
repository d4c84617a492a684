"""Q4_K / Q6_K quantization (quantize/kquants.py): the packed bytes are
what gguf-py (the reader llama.cpp's Python tools use) reads back, field for field,
and the searched scales give less error than the plain per-block ranges."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from tandem.quantize.kquants import (Q4_K_BYTES, Q6_K_BYTES, pack_q4_k, pack_q6_k,
                                                quantize_q4_k, quantize_q6_k, search_scale_min,
                                                search_scale_symmetric)

RNG = np.random.default_rng(0)


def _fp16_values(n: int, lo: float, hi: float) -> np.ndarray:
    return RNG.uniform(lo, hi, n).astype(np.float16).astype(np.float32)


def test_pack_q4_k_is_what_gguf_reads():
    b = 5
    d, dmin = _fp16_values(b, 1e-4, 0.1), _fp16_values(b, 0, 0.1)
    sc = RNG.integers(0, 64, (b, 8))
    mn = RNG.integers(0, 64, (b, 8))
    sc[0] = 63                       # the 6-bit extremes, whose top bits move bytes
    mn[1] = 63
    q = RNG.integers(0, 16, (b, 256))
    packed = pack_q4_k(d, dmin, sc, mn, q)
    assert packed.shape == (b, Q4_K_BYTES) and packed.dtype == np.uint8
    got = dequantize(packed, QT.Q4_K).reshape(b, 8, 32)
    dsc = (d[:, None] * sc.astype(np.float32))[..., None]
    dmn = (dmin[:, None] * mn.astype(np.float32))[..., None]
    want = dsc * q.reshape(b, 8, 32).astype(np.float32) - dmn
    assert np.array_equal(got, want)


def test_pack_q6_k_is_what_gguf_reads():
    b = 4
    d = _fp16_values(b, 1e-4, 0.1)
    sc = RNG.integers(-128, 128, (b, 16))
    q = RNG.integers(0, 64, (b, 256))
    q[0, :4] = [0, 63, 31, 32]
    packed = pack_q6_k(d, sc, q)
    assert packed.shape == (b, Q6_K_BYTES) and packed.dtype == np.uint8
    got = dequantize(packed, QT.Q6_K).reshape(b, 16, 16)
    want = ((d[:, None] * sc.astype(np.float32))[..., None]
            * (q.reshape(b, 16, 16).astype(np.float32) - 32))
    assert np.array_equal(got, want)


def _weights(rows: int, k: int) -> np.ndarray:
    """Gaussian rows of different scales, plus heavy-tailed (Student t, 3 dof) rows
    and a few outliers, as trained projection matrices have."""
    w = RNG.standard_normal((rows, k)).astype(np.float32)
    w[rows // 2:] = RNG.standard_t(3, (rows - rows // 2, k))
    w *= RNG.uniform(0.005, 0.05, (rows, 1)).astype(np.float32)
    w[1, 7] = 0.5
    return w


def _rel_rmse(w: np.ndarray, blocks: np.ndarray, qtype: QT) -> float:
    back = np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(w.shape)
    return float(np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean()))


def test_q4_k_beats_q4_1_and_q6_k_beats_q5_0():
    """At fewer bits per weight: Q4_K (4.5) against Q4_1 (5.0), Q6_K (6.5625) against
    Q5_0 (5.5) and Q8_0 (8.5)."""
    w = _weights(64, 1536)
    q4k, q6k = quantize_q4_k(w), quantize_q6_k(w)
    assert q4k.shape == (64, 6 * Q4_K_BYTES) and q6k.shape == (64, 6 * Q6_K_BYTES)
    e = {"Q4_K": _rel_rmse(w, q4k, QT.Q4_K), "Q6_K": _rel_rmse(w, q6k, QT.Q6_K)}
    for t in (QT.Q4_1, QT.Q5_0, QT.Q8_0):
        e[t.name] = _rel_rmse(w, quantize(w, t), t)
    assert e["Q4_K"] < e["Q4_1"]
    assert e["Q6_K"] < 0.5 * e["Q5_0"]
    assert e["Q8_0"] < e["Q6_K"]


def test_the_scale_searches_beat_the_plain_range():
    x = _weights(512, 32)
    w = np.abs(x) + np.sqrt((x * x).mean(axis=1, keepdims=True))

    def weighted_error(scale, mn):
        q = np.clip(np.rint((x + mn[:, None]) / np.where(scale > 0, scale, 1)[:, None]), 0, 15)
        return (w * (scale[:, None] * q - mn[:, None] - x) ** 2).sum(axis=1)

    plain = weighted_error(*search_scale_min(x, w, 15, nstep=-1))     # min..max, no search
    searched = weighted_error(*search_scale_min(x, w, 15))
    assert np.all(searched <= plain * (1 + 1e-5))
    assert searched.mean() < 0.9 * plain.mean()

    def symmetric_error(scale):
        q = np.clip(np.rint(x / scale[:, None]), -32, 31)
        return ((x * x) * (scale[:, None] * q - x) ** 2).sum(axis=1)

    absmax = np.abs(x).max(axis=1) / 32
    sym = search_scale_symmetric(x, 32)
    assert np.all(np.abs(sym) > 0)
    assert symmetric_error(sym).mean() < symmetric_error(absmax).mean()


def test_zero_and_constant_blocks():
    x = np.zeros((3, 512), dtype=np.float32)
    x[1] = 0.25                                       # a constant row
    x[2, 256:] = -1.0                                 # one zero, one constant super-block
    for quant, qtype in ((quantize_q4_k, QT.Q4_K), (quantize_q6_k, QT.Q6_K)):
        back = np.asarray(dequantize(quant(x), qtype)).reshape(x.shape)
        assert np.array_equal(back[0], x[0]) and np.array_equal(back[2, :256], x[2, :256])
        np.testing.assert_allclose(back[1:], x[1:], rtol=2e-3)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="^w: .*multiple of the 256"):
        quantize_q4_k(np.zeros((2, 300), dtype=np.float32))
    bad = np.zeros((1, 256), dtype=np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="^w: .*NaN"):
        quantize_q6_k(bad)
