"""Linear layers on GGUF quantized blocks, on the CPU (``csrc/gguf_linear.cpp``).

The weight stays in the GGUF file's bytes, ``qweight`` uint8 ``[N, row_bytes]``:
one row per output feature, each ``K / QB`` blocks of ``QB`` weights of one ggml
type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 with ``QB = 32``; the K-quants Q4_K, Q6_K with
super-blocks of ``QB = 256``; see the C++ source for the block layouts). A
decode-sized product dequantizes each 32-weight chunk in registers and multiplies
it into up to four activation rows at once; a prefill-sized one dequantizes the
matrix to float32 and runs torch's GEMM on it. Both give the values of
dequantize-then-matmul up to the order of float32 summation (the dequantized weights
are bit-identical to ``gguf.quants.dequantize``'s). With ``activations="int8"`` a
decode-sized product first quantizes the activations to int8 blocks of 32 values
(:func:`quantize_activations`) and multiplies in integers, as llama.cpp's CPU backend
does (AVX-512 VNNI ``vpdpbusd`` or AVX2 ``vpmaddubsw``: :func:`int8_dot_tier`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tandem.kernels.reference import (GGUF_BLOCK_SIZES, GGUF_TYPE_NAMES, INT4_ZP,
                                      PACKED_BLOCK_SIZES)

# type id -> (name, weights per block, bytes per block): the tables of
# kernels/reference.py (the ggml types, and INT4_ZP, 1001: Tandem's own block for
# GPTQ / AWQ int4 weights, fp16 scale ``s``, uint8 zero point ``z``, 16 bytes of
# codes as Q4_0's, ``w_j = (q_j - z) * s``; see
# :mod:`tandem.engine.quantization.int4_packed`).
#: The GGUF (ggml) types read natively.
GGUF_NATIVE_TYPES: dict[int, tuple[str, int, int]] = {
    t: (GGUF_TYPE_NAMES[t], *size) for t, size in GGUF_BLOCK_SIZES.items()}
#: Every block type the kernels read: the GGUF ones and :data:`INT4_ZP`.
PACKED_TYPES: dict[int, tuple[str, int, int]] = {
    t: (GGUF_TYPE_NAMES[t], *size) for t, size in PACKED_BLOCK_SIZES.items()}
# Above this many activation rows a product dequantizes the weight and runs a GEMM.
# The in-register path reads 0.6-1.1 bytes per weight against 4 for the GEMM but
# re-dequantizes each block once per 4 rows (``benchmarks/quantization.py --kernels``
# places the crossover).
MAX_FUSED_ROWS = 16
# With int8 activations the in-register kernel stays ahead of dequantize + GEMM for
# more rows (tiles of 8 rows; ``--kernels`` places the crossover at 32-64).
MAX_INT8_ROWS = 32


@functools.cache
def gguf_kernels_available() -> bool:
    """Whether the compiled CPU kernels load on this machine (probed once)."""
    from tandem.kernels.cpu.linear import invariant_linear_available

    return invariant_linear_available()


@functools.cache
def _lib():
    from tandem.kernels.cpu.build import load_library

    return load_library()


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` weights of ggml type ``qtype``.

    Raises:
        ValueError: a type not read natively, or ``in_features`` not a multiple of
            its block's weights (32, or 256 for the K-quants).
    """
    if qtype not in PACKED_TYPES:
        raise ValueError(f"qtype: type {qtype} has no native kernel "
                         f"(native: {', '.join(v[0] for v in PACKED_TYPES.values())})")
    _, block, nbytes = PACKED_TYPES[qtype]
    if in_features % block:
        raise ValueError(f"in_features: {in_features} is not a multiple of the "
                         f"{block}-weight block")
    return in_features // block * nbytes


def _check_qweight(qweight: torch.Tensor, qtype: int, in_features: int) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.device.type != "cpu":
        raise ValueError(f"qweight: expected a 2-D uint8 CPU tensor, got "
                         f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device}")
    if not qweight.is_contiguous():
        raise ValueError("qweight: must be contiguous")
    if qweight.shape[1] != row_bytes(qtype, in_features):
        raise ValueError(f"qweight: rows of {qweight.shape[1]} bytes do not hold "
                         f"{in_features} {PACKED_TYPES[qtype][0]} weights "
                         f"({row_bytes(qtype, in_features)} bytes)")


def gguf_dequantize(qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """The float32 weights ``[N, in_features]`` of ``qweight`` (uint8 ``[N, row_bytes]``).

    Raises:
        ValueError: wrong dtype, device, type or row width.
    """
    _check_qweight(qweight, qtype, in_features)
    out = torch.empty(qweight.shape[0], in_features, dtype=torch.float32)
    if out.numel():
        _lib().tandem_gguf_dequantize(out.data_ptr(), qweight.data_ptr(), qtype,
                                      qweight.shape[0], in_features, torch.get_num_threads())
    return out


def int8_dot_tier() -> int:
    """The integer dot product of the int8-activation kernels on this build: 2 AVX-512
    VNNI (or AVX-VNNI) ``vpdpbusd``, 1 AVX2 ``vpmaddubsw``, 0 portable loops."""
    return int(_lib().tandem_gguf_int8_dot_tier())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 activation blocks the ``activations="int8"`` product multiplies with.

    Each 32-value chunk of a row gets one scale ``d = max |x| / 127`` and codes
    ``a = round_half_even(x * (1 / d))`` in ``[-127, 127]`` (zero where ``d`` is 0):
    llama.cpp's Q8_0 activation blocks, the scale kept in float32.

    Args:
        x: float32 ``[M, K]`` on the CPU, ``K`` a multiple of 32.

    Returns:
        ``(codes int8 [M, K], d float32 [M, K / 32], d * sum(codes) float32 [M, K / 32])``.

    Raises:
        ValueError: dtype, device or shape.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] % 32:
        raise ValueError(f"x: expected a [M, K] float32 CPU tensor with K a multiple of 32, "
                         f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32)
    dsum = torch.empty(m, k // 32)
    if q.numel():
        _lib().tandem_gguf_quantize_activations_f32(x.data_ptr(), x.stride(0), m, k, q.data_ptr(),
                                                    d.data_ptr(), dsum.data_ptr(),
                                                    torch.get_num_threads())
    return q, d, dsum


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
                fused_only: bool = False, activations: str = "float") -> torch.Tensor:
    """``x W^T`` for ``W`` in GGUF blocks: ``[M, K]`` -> ``[M, N]`` in ``x``'s dtype.

    Args:
        x: ``[M, K]`` float32 or bfloat16 on the CPU, the last dim contiguous.
        qweight: uint8 ``[N, row_bytes(qtype, K)]``, contiguous.
        qtype: a key of :data:`PACKED_TYPES` (a ggml type id, or :data:`INT4_ZP`).
        in_features: ``K``.
        fused_only: always the in-register kernel, whatever ``M``. Its row ``m`` of the
            result does not depend on ``M`` or the other rows (each element one float32
            sum in a fixed order), so this is the batch-invariant path.
        activations: ``"float"``: the activations as given (the products of
            dequantize-then-matmul, up to float32 summation order); ``"int8"``: where
            it is faster (``M <= MAX_INT8_ROWS``, or ``fused_only``),
            each 32-value chunk of ``x`` is quantized to int8 first
            (:func:`quantize_activations`) and multiplied in integers
            (:func:`int8_dot_tier`), llama.cpp's CPU numerics; prefill-sized
            products keep the float GEMM, which is faster there. Each row's result
            is independent of the others either way.

    Raises:
        ValueError: dtype, device or shape mismatch.
    """
    _check_qweight(qweight, qtype, in_features)
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) \
            or x.shape[1] != in_features:
        raise ValueError(f"x: expected a [M, {in_features}] float32/bfloat16 CPU tensor, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    if activations not in ("float", "int8"):
        raise ValueError(f"activations: expected 'float' or 'int8', got {activations!r}")
    m, n = x.shape[0], qweight.shape[0]
    int8 = activations == "int8" and (m <= MAX_INT8_ROWS or fused_only)
    if not int8 and m > MAX_FUSED_ROWS and not fused_only:
        w = gguf_dequantize(qweight, qtype, in_features)
        return F.linear(x.float(), w).to(x.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = x.new_empty(m, n)
    if m and n:
        kernel = "gguf_linear_q8" if int8 else "gguf_linear"
        suffix = "f32" if x.dtype == torch.float32 else "bf16"
        getattr(_lib(), f"tandem_{kernel}_{suffix}")(
            out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), qweight.data_ptr(), qtype,
            m, n, in_features, torch.get_num_threads())
    return out
