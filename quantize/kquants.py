"""Quantization to GGUF's K-quant blocks Q4_K and Q6_K (gguf-py reads them but
cannot write them).

Both types group a row into super-blocks of 256 weights (``QK_K``), little-endian:

    Q4_K  144 bytes  fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins,
                     128 bytes qs: 8 sub-blocks of 32 weights,
                     w = d * sc_j * q - dmin * m_j,  q in 0..15
    Q6_K  210 bytes  128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits),
                     16 int8 scales, fp16 d: 16 sub-blocks of 16 weights,
                     w = d * sc_j * (q - 32),  q in 0..63

(the byte order of the codes inside a super-block is documented at
:func:`pack_q4_k` and :func:`pack_q6_k`, and is the one ``gguf.quants`` and
llama.cpp's ``ggml-quants.c`` read).

The quantizers follow the published reference quantizers of llama.cpp
(``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref``, PR #1684, "k-quants"):

- Q4_K: each 32-weight sub-block gets an asymmetric scale and min from a grid
  search (:func:`search_scale_min`: 21 candidate scales around ``15 / (max -
  min)``, each refined by weighted least squares over its codes, weights ``rms(x)
  + |x|``); the 8 scales and 8 mins are then quantized to 6 bits against the
  super-block's largest, and the codes recomputed against the rounded values.
- Q6_K: each 16-weight sub-block gets a symmetric scale from a grid search
  (:func:`search_scale_symmetric`: 19 candidates around ``-32 / x_absmax``, weights
  ``x^2``), quantized to int8 against the super-block's largest; codes recomputed.

All arithmetic is numpy float32 (round half to even, as llama.cpp's
``nearest_int``), vectorized over sub-blocks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256                      # weights per super-block
Q4_K_BYTES, Q6_K_BYTES = 144, 210
_EPS = 1e-15                    # llama.cpp's GROUP_MAX_EPS: a sub-block this small is zero

__all__ = ["QK_K", "Q4_K_BYTES", "Q6_K_BYTES", "quantize_q4_k", "quantize_q6_k",
           "search_scale_min", "search_scale_symmetric", "pack_q4_k", "pack_q6_k"]


def _rows(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % QK_K:
        raise ValueError(f"w: the last dimension ({w.shape[-1] if w.ndim else None}) is not a "
                         f"multiple of the {QK_K}-weight super-block")
    if not np.isfinite(w).all():
        raise ValueError("w: holds NaN or infinite values")
    return w.reshape(-1, QK_K)


def _f16(x: np.ndarray) -> np.ndarray:
    """The fp16 rounding of ``x``, as float32."""
    return x.astype(np.float16).astype(np.float32)


def search_scale_min(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float = -1.0,
                     rdelta: float = 0.1, nstep: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric scale and min per row of ``x`` minimizing the weighted error.

    For each row, ``x ~ scale * q - min`` with integer codes ``q`` in ``0..nmax``:
    the starting point is ``scale = (max - min) / nmax`` over the row's range (min
    clamped to <= 0); then for each of ``nstep + 1`` candidates ``iscale = (nmax +
    rmin + rdelta * i) / (max - min)`` the codes are rounded, and scale and min are
    refit to them by weighted least squares; the candidate with the least weighted
    squared error is kept (llama.cpp's ``make_qkx2_quants``).

    Args:
        x, weights: float32 ``[S, n]``.

    Returns:
        ``(scale, min)``, float32 ``[S]`` each, ``min >= 0`` (subtracted).
    """
    x = x.astype(np.float32)
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = x.max(axis=1)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, 1.0, span).astype(np.float32)
    sum_w = weights.sum(axis=1)
    sum_x = (weights * x).sum(axis=1)

    def codes(iscale):
        return np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)

    scale = span / np.float32(nmax)
    best_min = lo.copy()
    q = codes(np.float32(nmax) / span)
    best_err = (weights * (scale[:, None] * q + lo[:, None] - x) ** 2).sum(axis=1)
    for i in range(nstep + 1):
        q = codes((np.float32(rmin + rdelta * i + nmax)) / span)
        sl = (weights * q).sum(axis=1)
        sl2 = (weights * q * q).sum(axis=1)
        sxl = (weights * q * x).sum(axis=1)
        det = sum_w * sl2 - sl * sl
        ok = det > 0
        det = np.where(ok, det, 1.0)
        s = (sum_w * sxl - sum_x * sl) / det
        m = (sl2 * sum_x - sl * sxl) / det
        pos = m > 0                  # a positive offset: refit the scale alone
        s = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1.0), s)
        m = np.where(pos, 0.0, m)
        err = (weights * (s[:, None] * q + m[:, None] - x) ** 2).sum(axis=1)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        scale = np.where(better, s, scale)
        best_min = np.where(better, m, best_min)
    scale = np.where(flat, 0.0, scale).astype(np.float32)
    return scale, (-best_min).astype(np.float32)


def search_scale_symmetric(x: np.ndarray, nmax: int, nstep: int = 9) -> np.ndarray:
    """Symmetric scale per row of ``x`` (codes ``-nmax..nmax-1``), weights ``x^2``.

    Starts from ``iscale = -nmax / x_m`` with ``x_m`` the entry of largest magnitude
    (sign kept, so that entry maps to ``-nmax``, the code with no positive twin);
    tries ``iscale = -(nmax + 0.1 i) / x_m`` for ``i`` in ``-nstep..nstep``; each
    candidate's scale is the weighted least-squares fit to its codes, and the one
    with the largest ``(sum w x q)^2 / sum w q^2`` (least error) is kept (llama.cpp's
    ``make_qx_quants``, ``rmse_type = 1``).

    Args:
        x: float32 ``[S, n]``.

    Returns:
        float32 ``[S]`` scales (0 for an all-zero row).
    """
    x = x.astype(np.float32)
    idx = np.abs(x).argmax(axis=1)
    xm = x[np.arange(x.shape[0]), idx]
    zero = np.abs(xm) < _EPS
    xm = np.where(zero, 1.0, xm).astype(np.float32)
    w = x * x

    def fit(iscale):
        q = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        return (w * x * q).sum(axis=1), (w * q * q).sum(axis=1)

    sumlx, suml2 = fit(np.float32(-nmax) / xm)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1.0), 0.0)
    best = scale * sumlx
    for i in range(-nstep, nstep + 1):
        if i == 0:
            continue
        sumlx, suml2 = fit(np.float32(-(nmax + 0.1 * i)) / xm)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        s = sumlx / np.where(suml2 > 0, suml2, 1.0)
        scale = np.where(better, s, scale)
        best = np.where(better, s * sumlx, best)
    return np.where(zero, 0.0, scale).astype(np.float32)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray,
              q: np.ndarray) -> np.ndarray:
    """Q4_K blocks from their fields.

    Args:
        d, dmin: ``[B]`` (stored as fp16).
        sc, mn: ``[B, 8]`` integers in ``0..63``: sub-block ``j``'s scale and min
            codes. Bytes 0-3 hold ``sc[0..3]`` and bytes 4-7 ``mn[0..3]`` in their low 6
            bits; byte ``8 + i`` holds ``sc[4 + i]`` (low nibble) and ``mn[4 + i]``
            (high nibble), whose top 2 bits go to the top bits of bytes ``i`` and
            ``4 + i``.
        q: ``[B, 256]`` codes in ``0..15``; sub-blocks ``2i`` and ``2i + 1`` share the 32
            bytes ``qs[32 i : 32 i + 32]``, as their low and high nibbles.

    Returns:
        uint8 ``[B, 144]``.
    """
    b = d.shape[0]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.zeros((b, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    q = q.astype(np.uint8).reshape(b, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(b, 128)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(b, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(b, 2),
                           scales, qs], axis=1)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks from their fields.

    Args:
        d: ``[B]`` (stored as fp16).
        sc: ``[B, 16]`` int8 sub-block scales (sub-block ``j`` = weights ``16 j ..``).
        q: ``[B, 256]`` codes in ``0..63``. In each half ``h`` (weights ``128 h ..``),
            weight ``128 h + 32 p + l`` (``p`` in 0..3, ``l`` in 0..31) keeps its low 4
            bits in ``ql[64 h + 32 (p % 2) + l]`` (low nibble for ``p < 2``, high
            otherwise) and its high 2 bits in bits ``2p, 2p + 1`` of ``qh[32 h + l]``.

    Returns:
        uint8 ``[B, 210]``.
    """
    b = d.shape[0]
    q = q.astype(np.uint8).reshape(b, 2, 4, 32)                   # [B, half, p, l]
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)],
                        axis=2).reshape(b, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(b, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(b, 2)], axis=1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` (float32 ``[..., K]``, ``K`` a multiple of 256) to Q4_K bytes.

    Returns:
        uint8 ``[..., K / 256 * 144]``.

    Raises:
        ValueError: ``K`` not a multiple of 256, or non-finite values.
    """
    shape = np.shape(w)
    x = _rows(w)                                                   # [B, 256]
    b = x.shape[0]
    av = np.sqrt((x * x).sum(axis=1) / QK_K)
    sub = x.reshape(b * 8, 32)
    weights = (av[:, None, None] + np.abs(x.reshape(b, 8, 32))).reshape(b * 8, 32)
    scale, mins = search_scale_min(sub, weights, 15)
    scale = np.maximum(scale, 0.0).reshape(b, 8)
    mins = mins.reshape(b, 8)
    max_scale, max_min = scale.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, 63.0 / np.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_m = np.where(max_min > 0, 63.0 / np.where(max_min > 0, max_min, 1.0), 0.0)
    ls = np.clip(np.rint(inv_s[:, None] * scale), 0, 63)
    lm = np.clip(np.rint(inv_m[:, None] * mins), 0, 63)
    d = _f16((max_scale / 63.0).astype(np.float32))
    dmin = _f16((max_min / 63.0).astype(np.float32))
    dd = (d[:, None] * ls).astype(np.float32)[..., None]           # [B, 8, 1]
    dm = (dmin[:, None] * lm).astype(np.float32)[..., None]
    xs = x.reshape(b, 8, 32)
    q = np.where(dd > 0, np.clip(np.rint((xs + dm) / np.where(dd > 0, dd, 1.0)), 0, 15), 0)
    out = pack_q4_k(d, dmin, ls, lm, q.reshape(b, QK_K))
    return out.reshape(*shape[:-1], shape[-1] // QK_K * Q4_K_BYTES)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``w`` (float32 ``[..., K]``, ``K`` a multiple of 256) to Q6_K bytes.

    Returns:
        uint8 ``[..., K / 256 * 210]``.

    Raises:
        ValueError: ``K`` not a multiple of 256, or non-finite values.
    """
    shape = np.shape(w)
    x = _rows(w)
    b = x.shape[0]
    scale = search_scale_symmetric(x.reshape(b * 16, 16), 32).reshape(b, 16)
    idx = np.abs(scale).argmax(axis=1)
    max_scale = scale[np.arange(b), idx]                           # signed
    zero = np.abs(max_scale) < _EPS
    iscale = np.where(zero, 0.0, -128.0 / np.where(zero, 1.0, max_scale)).astype(np.float32)
    d = np.where(zero, 0.0, _f16(np.where(zero, 1.0, 1.0 / np.where(zero, 1.0, iscale))
                                 .astype(np.float32)))
    sc = np.clip(np.rint(iscale[:, None] * scale), -128, 127)
    dd = (d[:, None] * sc).astype(np.float32)[..., None]           # [B, 16, 1]
    xs = x.reshape(b, 16, 16)
    q = np.where(dd != 0, np.clip(np.rint(xs / np.where(dd != 0, dd, 1.0)), -32, 31), 0) + 32
    out = pack_q6_k(d.astype(np.float32), sc, q.reshape(b, QK_K))
    return out.reshape(*shape[:-1], shape[-1] // QK_K * Q6_K_BYTES)
