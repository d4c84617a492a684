"""The GPTQ checkpoint layout (AutoGPTQ's, read by vLLM and transformers): a
quantized weight, its packed tensors, and the exact conversions between them.

A linear layer ``y = x W^T`` with ``W`` ``[N, K]`` (``N`` = out_features, ``K`` =
in_features) quantized to ``bits`` bits in groups of ``group_size`` input columns
is stored as four tensors (``pf = 32 // bits`` values per int32, ``G`` groups):

============  ===========================  ==============================================
``qweight``   int32 ``[K / pf, N]``        the codes, packed along ``K``: value ``k`` of
                                           column ``n`` is bits ``bits*(k % pf)`` ..
                                           of ``qweight[k // pf, n]`` (low bits first)
``qzeros``    int32 ``[G, N / pf]``        the zero points, packed along ``N`` the same
                                           way, each stored as ``(zero - 1) mod 2**bits``
``scales``    float16 ``[G, N]``           the step of each group and output
``g_idx``     int32 ``[K]``                the group of each input column
============  ===========================  ==============================================

and ``W[n, k] = (code[n, k] - zero[g_idx[k], n]) * scale[g_idx[k], n]``.

**Zero points.** AutoGPTQ's (v1) format writes ``zero - 1``; its readers and vLLM's
add the 1 back. We write ``(zero - 1) mod 2**bits`` in each nibble and read
``(stored + 1) mod 2**bits``, which round-trips every zero in ``[0, 2**bits - 1]``
exactly. Readers that add 1 without the modulus agree for every zero except 0
(stored as ``2**bits - 1``, which they read as ``2**bits``); AutoGPTQ's own
writer cannot store a zero of 0 at all (its ``-1`` spills into the neighbouring
nibbles). Our quantizers put 0 inside every group's range (GPTQ's reference
quantizer does the same), so a zero of 0 means that no weight of the group is
below about ``-scale / 2``. ``checkpoint_format: "gptq_v2"`` checkpoints
(GPTQModel) store the zero itself; :func:`unpack_zeros` reads both.

With ``desc_act`` (act-order) ``g_idx`` is not monotonic: the groups were formed
over the columns in a permuted order, and ``g_idx`` maps each column back to its
group. ``group_size = -1`` is one group over all of ``K``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4, 8)
"""Bit widths that pack evenly into int32 (3-bit GPTQ packing is not implemented)."""


def pack_factor(bits: int) -> int:
    """Values per int32 (``32 // bits``).

    Raises:
        ValueError: ``bits`` not in :data:`SUPPORTED_BITS`.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits!r}")
    return 32 // bits


def num_groups(in_features: int, group_size: int) -> int:
    """``G``: ``ceil(K / group_size)``, or 1 for ``group_size = -1`` (the last group
    may be shorter, as in AutoGPTQ)."""
    return 1 if group_size == -1 else math.ceil(in_features / group_size)


def pack_last_dim(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers in ``[0, 2**bits)`` along the last dimension, low bits first.

    Args:
        values: ``[..., C]`` any integer dtype, ``C`` a multiple of ``32 // bits``.

    Returns:
        int32 ``[..., C / (32 // bits)]`` (the bit pattern of the uint32 word).

    Raises:
        ValueError: ``C`` not a multiple of the pack factor, or a value out of range.
    """
    pf = pack_factor(bits)
    if values.shape[-1] % pf:
        raise ValueError(f"cannot pack {values.shape[-1]} values in words of {pf}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values outside [0, {(1 << bits) - 1}] cannot be packed in {bits} bits")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)
    shifts = torch.arange(pf, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(-1)                       # disjoint bits: sum == or
    words = words - ((words >> 31) & 1) * (1 << 32)     # uint32 -> int32 bit pattern
    return words.to(torch.int32)


def unpack_last_dim(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_last_dim`: int32 ``[..., W]`` -> int32 ``[..., W * (32 // bits)]``."""
    pf = pack_factor(bits)
    shifts = torch.arange(pf, dtype=torch.int32, device=words.device) * bits
    # An arithmetic shift drags the sign bit along; the mask drops it again.
    v = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(*words.shape[:-1], words.shape[-1] * pf)


def pack_qweight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` -> ``qweight`` int32 ``[K / pf, N]`` (packed along ``K``)."""
    return pack_last_dim(codes, bits).t().contiguous()


def unpack_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``qweight`` int32 ``[K / pf, N]`` -> codes int32 ``[N, K]``."""
    return unpack_last_dim(qweight.t(), bits)


def pack_zeros(zeros: torch.Tensor, bits: int, zero_offset: int = 1) -> torch.Tensor:
    """Zero points ``[G, N]`` (in ``[0, 2**bits)``) -> ``qzeros`` int32 ``[G, N / pf]``,
    each stored as ``(zero - zero_offset) mod 2**bits`` (1: GPTQ v1, 0: v2)."""
    return pack_last_dim((zeros.to(torch.int64) - zero_offset) % (1 << bits), bits)


def unpack_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int = 1) -> torch.Tensor:
    """``qzeros`` int32 ``[G, N / pf]`` -> zero points int32 ``[G, N]``
    (``(stored + zero_offset) mod 2**bits``)."""
    return (unpack_last_dim(qzeros, bits) + zero_offset) & ((1 << bits) - 1)


def dequantize_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(codes - zeros) * scales`` in float32, elementwise (broadcasting).

    Codes and zeros are small integers, exact in float32, and so is their
    difference; with float16 scales (11 significant bits) and ``|code - zero| < 2**8``
    the product is exact too. The quantizers' own reconstruction and a checkpoint's
    dequantized weight are therefore bit-identical, however they are computed.
    """
    return (codes.to(torch.float32) - zeros.to(torch.float32)) * scales.to(torch.float32)


def dequantize_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor, bits: int, zero_offset: int = 1) -> torch.Tensor:
    """A checkpoint's packed tensors (shapes in the module docstring) -> the dense
    float32 weight ``[N, K]``."""
    codes = unpack_qweight(qweight, bits)                    # [N, K]
    zeros = unpack_zeros(qzeros, bits, zero_offset)          # [G, N]
    g = g_idx.to(torch.int64)
    z = zeros.to(torch.float32).index_select(0, g)           # [K, N]
    s = scales.to(torch.float32).index_select(0, g)
    return dequantize_codes(codes, z.t(), s.t())


@dataclass
class QuantizedWeight:
    """One linear layer's weight as a quantizer leaves it (unpacked).

    Attributes:
        codes: uint8 ``[N, K]``, in ``[0, 2**bits)``.
        zeros: uint8 ``[G, N]``, zero points in ``[0, 2**bits)``.
        scales: float16 ``[G, N]``.
        g_idx: int32 ``[K]``, the group of each input column.
        bits: bits per code.
        group_size: input columns per group (-1: one group).
        desc_act: whether the groups were formed in act-order (``g_idx`` permuted).
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    desc_act: bool = False

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight ``[N, K]`` the codes stand for."""
        g = self.g_idx.to(torch.int64)
        z = self.zeros.to(torch.float32).index_select(0, g)      # [K, N]
        s = self.scales.to(torch.float32).index_select(0, g)
        return dequantize_codes(self.codes, z.t(), s.t())

    def split_rows(self, sizes: list[int]) -> list["QuantizedWeight"]:
        """Split along ``N`` into weights of ``sizes`` rows (sharing ``g_idx``)."""
        parts = zip(self.codes.split(sizes, 0), self.zeros.split(sizes, 1),
                    self.scales.split(sizes, 1))
        return [QuantizedWeight(c.contiguous(), z.contiguous(), s.contiguous(), self.g_idx.clone(),
                                self.bits, self.group_size, self.desc_act) for c, z, s in parts]

    def pack(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors ``{"qweight", "qzeros", "scales", "g_idx"}`` (GPTQ v1)."""
        return {"qweight": pack_qweight(self.codes, self.bits),
                "qzeros": pack_zeros(self.zeros, self.bits),
                "scales": self.scales.to(torch.float16).contiguous(),
                "g_idx": self.g_idx.to(torch.int32).contiguous()}
