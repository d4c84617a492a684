"""Linear layer over GGUF quantized weights kept packed: ``x @ dequant(qweight).T``.

Layout: ``qweight`` holds GGUF's own bytes, uint8 ``[N, row_bytes]``, one row per
output feature (row-major ``[out, in]``), each row ``K / QB`` blocks of ``QB``
weights (see :data:`tandem.kernels.reference.GGUF_BLOCK_SIZES` and the GGUF section
of :mod:`tandem.kernels.reference`):

    Q4_0 (type 2)   18 bytes  fp16 d, 16 bytes qs            w_j = (q_j - 8) * d
    Q4_1 (type 3)   20 bytes  fp16 d, fp16 m, 16 qs          w_j = q_j * d + m
    Q5_0 (type 6)   22 bytes  fp16 d, u32 qh, 16 qs          w_j = (q_j + 16 h_j - 16) * d
    Q5_1 (type 7)   24 bytes  fp16 d, fp16 m, u32 qh, 16 qs  w_j = (q_j + 16 h_j) * d + m
    Q8_0 (type 8)   34 bytes  fp16 d, 32 int8 qs             w_j = qs[j] * d
    Q4_K (type 12) 144 bytes per 256 weights (8 sub-blocks of 32, 6-bit scales and mins)
    Q6_K (type 14) 210 bytes per 256 weights (16 sub-blocks of 16, int8 scales)
    INT4_ZP (1001)  19 bytes  fp16 s, u8 zero z, 16 qs       w_j = (q_j - z) * s
                              (Tandem's block for GPTQ / AWQ int4, not a ggml type)

with ``q_j`` the low nibble of ``qs[j]`` for ``j < 16`` and the high nibble of
``qs[j - 16]`` for ``j >= 16``, ``h_j`` bit ``j`` of ``qh``.

Algorithm (32-weight types): one program computes an output tile ``[BLOCK_M, BLOCK_N]``. It walks K
in steps of ``BLOCK_K`` weights (``BLOCK_K / 32`` quant blocks): it loads the
step's quant bytes of its ``BLOCK_N`` rows, and each block's fp16 scale (two
bytes combined into a uint16 and bitcast), dequantizes in registers and
accumulates ``tl.dot(x_tile, w_tile)`` in float32. Each quant byte is loaded
once: for the 4-bit types the low nibbles of a block's 16 bytes are weights
0..15 and the high nibbles 16..31, so the weight tile is kept as two
``[BLOCK_K / 2, BLOCK_N]`` halves (low, high) and multiplied by the two matching
column sets of x, ``x[:, 32b + i]`` and ``x[:, 32b + 16 + i]``, instead of
interleaving the nibbles. The weights never exist dequantized in memory.

Algorithm (K-quants, :func:`_gguf_kquant_linear_kernel`): the same output tiles
and K steps; a step of ``BLOCK_K`` weights is ``BLOCK_K / 32`` chunks of 32 weights
(a Q4_K sub-block, or two Q6_K sub-blocks), each inside one super-block. Each
chunk's scale (and Q4_K's min: the 6-bit codes unpacked from the 12 scale bytes) is
computed once per ``[chunk, row]`` and broadcast over its 32 tile rows; each weight's
code is gathered from its byte (and, for Q6_K, its two high bits from ``qh``), so
the weight tile is ``[BLOCK_K, BLOCK_N]`` in K order and one ``tl.dot`` per step.

Precision: float32 inputs multiply in IEEE float32 (no TF32). For float16 and
bfloat16 inputs the dequantized weights are rounded to that dtype for the
tensor-core dot, so results differ from :func:`gguf_linear_reference` (float32
weights) by that rounding (one ulp of the dtype per weight) and the final one.

Tensors:
    x        [M, K]          float32 / float16 / bfloat16, innermost stride 1
    qweight  [N, row_bytes]  uint8, row_bytes = K / 32 * bytes_per_block,
                             innermost stride 1
    out      [M, N]          x's dtype, innermost stride 1

No split-K: with ``M <= 16`` (decode) the grid is ``ceil(N / BLOCK_N)`` programs,
which narrow layers may leave short of the device's SM count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._common import (FLOAT_DTYPES, check_device, check_dtype,
                                    check_last_dim_contiguous, check_shape, dot_options,
                                    load_fp16)
from tandem.kernels.reference import (GGUF_BLOCK_SIZES, INT4_ZP, PACKED_BLOCK_SIZES,
                                      check_gguf_weight, dequantize_gguf_reference,
                                      gguf_linear_reference)

__all__ = ["gguf_linear", "gguf_linear_reference", "dequantize_gguf_reference",
           "gguf_block_config", "GGUF_BLOCK_SIZES"]

_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q6_K = 2, 3, 6, 7, 8, 12, 14
_WEIGHTS_PER_BLOCK = 32      # and per chunk of a K-quant super-block
_KQUANTS = (_Q4_K, _Q6_K)


@triton.jit
def _gguf_linear_kernel(
    out_ptr, x_ptr, w_ptr,
    M, N, num_blocks,
    x_stride_m, w_stride_n, o_stride_m,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, QS_OFFSET: tl.constexpr,
    QH_OFFSET: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # GROUP: weights whose bytes are loaded as one tile row set per block -- 32
    # int8 for Q8_0, 16 bytes (= low half and high half of the block) for Q4_*.
    NBLK: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64: row * stride exceeds 2**31 bytes for large embedding / output layers.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride_m          # [BM, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride_n          # [1, BN]

    offs_g = tl.arange(0, NBLK * GROUP)      # tile row -> (block of the step, position)
    blk_of_row = offs_g // GROUP
    pos = offs_g % GROUP
    offs_b = tl.arange(0, NBLK)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, num_blocks, NBLK):
        blk = kb + blk_of_row
        mask_k = blk < num_blocks
        w_mask = mask_k[:, None] & mask_n[None, :]
        x_mask = mask_m[:, None] & mask_k[None, :]
        q = tl.load(w_rows + (blk.to(tl.int64) * BLOCK_BYTES + QS_OFFSET + pos)[:, None],
                    mask=w_mask, other=0)                               # uint8 [NBLK*G, BN]
        # One scale per (block, row), broadcast over the block's tile rows.
        s_blk = kb + offs_b
        s_ptr = w_rows + (s_blk.to(tl.int64) * BLOCK_BYTES)[:, None]    # [NBLK, BN]
        s_mask = (s_blk < num_blocks)[:, None] & mask_n[None, :]
        d = load_fp16(s_ptr, s_mask)
        d = tl.reshape(tl.broadcast_to(d[:, None, :], (NBLK, GROUP, BLOCK_N)),
                       (NBLK * GROUP, BLOCK_N))
        x_cols = blk * 32 + pos
        if QTYPE == 8:
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
            xt = tl.load(x_rows + x_cols[None, :], mask=x_mask, other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
            acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=DOT_PRECISION)
        else:
            lo = (q & 0xF).to(tl.int32)
            hi = (q >> 4).to(tl.int32)
            if QTYPE == 6 or QTYPE == 7:
                # 5-bit: bit j of the block's u32 qh is weight j's fifth bit.
                h_ptr = w_rows + (blk.to(tl.int64) * BLOCK_BYTES + QH_OFFSET)[:, None]
                qh = (tl.load(h_ptr, mask=w_mask, other=0).to(tl.uint32)
                      | (tl.load(h_ptr + 1, mask=w_mask, other=0).to(tl.uint32) << 8)
                      | (tl.load(h_ptr + 2, mask=w_mask, other=0).to(tl.uint32) << 16)
                      | (tl.load(h_ptr + 3, mask=w_mask, other=0).to(tl.uint32) << 24))
                shift = pos.to(tl.uint32)[:, None]
                lo = lo | (((qh >> shift) & 1) << 4).to(tl.int32)
                hi = hi | (((qh >> (shift + 16)) & 1) << 4).to(tl.int32)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
            if QTYPE == 2:
                w_lo = (lo - 8.0) * d
                w_hi = (hi - 8.0) * d
            elif QTYPE == 1001:
                # INT4_ZP: the block's zero point, byte 2, broadcast like its scale.
                z = tl.load(s_ptr + 2, mask=s_mask, other=0).to(tl.float32)
                z = tl.reshape(tl.broadcast_to(z[:, None, :], (NBLK, GROUP, BLOCK_N)),
                               (NBLK * GROUP, BLOCK_N))
                w_lo = (lo - z) * d
                w_hi = (hi - z) * d
            elif QTYPE == 6:
                w_lo = (lo - 16.0) * d
                w_hi = (hi - 16.0) * d
            else:
                mn = load_fp16(s_ptr + 2, s_mask)
                mn = tl.reshape(tl.broadcast_to(mn[:, None, :], (NBLK, GROUP, BLOCK_N)),
                                (NBLK * GROUP, BLOCK_N))
                w_lo = lo * d + mn
                w_hi = hi * d + mn
            x_lo = tl.load(x_rows + x_cols[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (x_cols + 16)[None, :], mask=x_mask, other=0.0)
            if UPCAST:
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
            acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc, input_precision=DOT_PRECISION)

    o = out_ptr + offs_m.to(tl.int64)[:, None] * o_stride_m + offs_n[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gguf_kquant_linear_kernel(
    out_ptr, x_ptr, w_ptr,
    M, N, K,
    x_stride_m, w_stride_n, o_stride_m,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    NCH: tl.constexpr = BLOCK_K // 32          # 32-weight chunks per K step
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride_m          # [BM, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride_n          # [1, BN]
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, NCH)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k                               # weight index in the row
        mask_k = k < K
        w_mask = mask_k[:, None] & mask_n[None, :]
        sb = (k // 256).to(tl.int64) * BLOCK_BYTES    # super-block's first byte
        wi = k % 256                                  # weight within the super-block
        # Per chunk: its super-block and position (chunk c of 8).
        kc = k0 + offs_c * 32
        c_mask = (kc < K)[:, None] & mask_n[None, :]
        c_base = w_rows + ((kc // 256).to(tl.int64) * BLOCK_BYTES)[:, None]   # [NCH, BN]
        ci = (kc % 256) // 32
        if QTYPE == 12:
            # Q4_K: sub-block s = ci; code = nibble (s % 2) of qs[32 (s // 2) + l].
            q = tl.load(w_rows + (sb + 16 + (wi // 64) * 32 + wi % 32)[:, None],
                        mask=w_mask, other=0)
            q = ((q >> (((wi // 32) % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
            s4 = (ci % 4)[:, None]
            x0 = tl.load(c_base + 4 + s4, mask=c_mask, other=0).to(tl.int32)
            x1 = tl.load(c_base + 8 + s4, mask=c_mask, other=0).to(tl.int32)
            x2 = tl.load(c_base + 12 + s4, mask=c_mask, other=0).to(tl.int32)
            big = (ci >= 4)[:, None]
            sc = tl.where(big, (x2 & 0xF) | ((x0 >> 6) << 4), x0 & 63).to(tl.float32)
            mn = tl.where(big, (x2 >> 4) | ((x1 >> 6) << 4), x1 & 63).to(tl.float32)
            dsc = load_fp16(c_base, c_mask) * sc                       # [NCH, BN]
            dmn = load_fp16(c_base + 2, c_mask) * mn
            dsc = tl.reshape(tl.broadcast_to(dsc[:, None, :], (NCH, 32, BLOCK_N)),
                             (BLOCK_K, BLOCK_N))
            dmn = tl.reshape(tl.broadcast_to(dmn[:, None, :], (NCH, 32, BLOCK_N)),
                             (BLOCK_K, BLOCK_N))
            w = q * dsc - dmn
        else:
            # Q6_K: weight 128 h + 32 p + l; low nibble of ql[64 h + 32 (p % 2) + l]
            # (high nibble for p >= 2), high bits 2p of qh[32 h + l]; scale per 16.
            h = wi // 128
            p = (wi % 128) // 32
            l = wi % 32
            ql = tl.load(w_rows + (sb + 64 * h + 32 * (p % 2) + l)[:, None], mask=w_mask, other=0)
            qh = tl.load(w_rows + (sb + 128 + 32 * h + l)[:, None], mask=w_mask, other=0)
            lo = (ql >> ((p // 2) * 4).to(tl.uint8)[:, None]) & 0xF
            hi = (qh >> (2 * p).to(tl.uint8)[:, None]) & 3
            q = (lo | (hi << 4)).to(tl.float32) - 32.0
            sc = tl.load(w_rows + (sb + 192 + wi // 16)[:, None], mask=w_mask, other=0)
            sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
            d = load_fp16(c_base + 208, c_mask)
            d = tl.reshape(tl.broadcast_to(d[:, None, :], (NCH, 32, BLOCK_N)),
                           (BLOCK_K, BLOCK_N))
            w = (d * sc) * q
        xt = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
        acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=DOT_PRECISION)

    o = out_ptr + offs_m.to(tl.int64)[:, None] * o_stride_m + offs_n[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gguf_block_config(m: int, n: int, device: torch.device) -> dict[str, int]:
    """Tile sizes and launch options of :func:`gguf_linear` for ``M = m``, ``N = n``.

    Decode (``m <= 16``) is bound by reading the packed weights: one 16-row
    M tile, long K steps (128 weights = 4 quant blocks per load), and the widest
    N tile (64, 32 or 16) that still gives one program per SM. Larger ``m``
    (prefill) uses square-ish tensor-core tiles, 64 or 128 rows. On CPU (the
    interpreter) small tiles keep the numpy work per program low. These are
    starting points, not an autotuned table.

    Returns:
        ``dict(block_m, block_n, block_k, num_warps, num_stages)``.
    """
    if device.type != "cuda":
        return dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)
    if m <= 16:
        sms = _sm_count(device)
        block_n = next((bn for bn in (64, 32) if triton.cdiv(n, bn) >= sms), 16)
        return dict(block_m=16, block_n=block_n, block_k=128, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _check_pow2(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= {minimum}, got {value}")


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
                out: torch.Tensor | None = None, *, block_m: int | None = None,
                block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """``x @ W.T`` for a GGUF weight ``W`` kept packed (Triton): Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, Q4_K or Q6_K.

    Same contract as :func:`tandem.kernels.reference.gguf_linear_reference`,
    float16 / bfloat16 up to the rounding of the weights (module docstring).

    Args:
        x: ``[M, K]`` float32 / float16 / bfloat16; any row stride, innermost stride 1.
        qweight: ``[N, K / QB * bytes_per_block]`` uint8 GGUF blocks, on x's device;
            any row stride, innermost stride 1.
        qtype: ggml type id (``gguf.GGMLQuantizationType``): 2 (Q4_0), 3 (Q4_1),
            6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 14 (Q6_K), or 1001 (INT4_ZP).
        in_features: ``K``, a multiple of the block's ``QB`` weights (32; 256 for
            the K-quants).
        out: optional ``[M, N]`` output in x's dtype (may be a view of a larger tensor).
        block_m, block_n: output tile (powers of two >= 16); None picks with
            :func:`gguf_block_config`.
        block_k: weights per K step, a power of two >= 32 (whole 32-weight blocks,
            or chunks of a K-quant super-block).

    Returns:
        ``[M, N]`` in x's dtype, accumulated in float32.

    Raises:
        ValueError: unsupported ``qtype``, ``in_features`` not a multiple of 32, a
            ``qweight`` / ``x`` / ``out`` of the wrong shape, dtype, device or
            stride, or bad tile sizes; the message names the argument.
    """
    n, _ = check_gguf_weight(qweight, qtype, in_features)
    qtype = int(qtype)
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [M, {in_features}], got {tuple(x.shape)}")
    m = x.shape[0]
    check_shape("x", x, (m, in_features))
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("qweight", qweight)
    check_device(x, qweight, *(() if out is None else (out,)))
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        check_shape("out", out, (m, n))
        check_dtype("out", out, (x.dtype,))
        check_last_dim_contiguous("out", out)
    cfg = gguf_block_config(m, n, x.device)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    block_k = cfg["block_k"] if block_k is None else block_k
    _check_pow2("block_m", block_m, 16)
    _check_pow2("block_n", block_n, 16)
    _check_pow2("block_k", block_k, _WEIGHTS_PER_BLOCK)
    if m == 0 or n == 0:
        return out

    block_bytes = PACKED_BLOCK_SIZES[qtype][1]
    precision, upcast = dot_options(x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if qtype in _KQUANTS:
        _gguf_kquant_linear_kernel[grid](
            out, x, qweight, m, n, in_features,
            x.stride(0), qweight.stride(0), out.stride(0),
            QTYPE=qtype, BLOCK_BYTES=block_bytes,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=precision, UPCAST=upcast,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out
    has_min = qtype in (_Q4_1, _Q5_1)
    five = qtype in (_Q5_0, _Q5_1)
    qs_offset = 3 if qtype == INT4_ZP else 2 + 2 * has_min + 4 * five
    _gguf_linear_kernel[grid](
        out, x, qweight, m, n, in_features // _WEIGHTS_PER_BLOCK,
        x.stride(0), qweight.stride(0), out.stride(0),
        QTYPE=qtype, BLOCK_BYTES=block_bytes,
        QS_OFFSET=qs_offset, QH_OFFSET=2 + 2 * has_min,
        GROUP=32 if qtype == _Q8_0 else 16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
