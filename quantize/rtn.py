"""Round-to-nearest (RTN) asymmetric integer quantization of a weight matrix, in
groups along the input dimension: GPTQ's format without its error feedback.

Per output row ``n`` and group of ``g`` input columns (the quantizer of Frantar et
al. 2022, Sec. 4 / the GPTQ reference code's ``Quantizer``), with ``maxq = 2**bits - 1``:

- ``lo = min(min(w), 0)``, ``hi = max(max(w), 0)`` (the range always holds 0, so
  that a zero weight is exact and the zero point lies in ``[0, maxq]``);
  a group of all zeros takes ``lo, hi = -1, 1``;
- ``scale = (hi - lo) / maxq``, rounded to float16 (the checkpoint's dtype, so the
  codes are chosen against the scale that will be served);
- ``zero = clamp(round(-lo / scale), 0, maxq)``;
- ``code = clamp(round(w / scale) + zero, 0, maxq)`` and
  ``w_hat = (code - zero) * scale``.
"""

from __future__ import annotations

import torch

from tandem.engine.quantization.packing import QuantizedWeight, dequantize_codes, num_groups, pack_factor

_MIN_SCALE = 2.0 ** -24     # the smallest float16 subnormal: a scale never rounds to 0


def find_params(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and zero point of each row of one group.

    Args:
        w: float32 ``[N, g]``, the group's (current) weights.
        bits: bits per code.

    Returns:
        ``(scale, zero)``: float16 ``[N]`` and int64 ``[N]`` (in ``[0, 2**bits)``).
    """
    maxq = (1 << bits) - 1
    lo = torch.clamp(w.min(dim=1).values, max=0.0)
    hi = torch.clamp(w.max(dim=1).values, min=0.0)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / maxq).clamp(min=_MIN_SCALE).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int64)
    return scale, zero


def quantize_columns(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``w`` ``[N]`` or ``[N, c]`` to codes under per-row ``scale``/``zero`` ``[N]``.

    Returns:
        ``(codes, w_hat)``: int64 codes and their float32 reconstruction, ``w``'s shape.
    """
    s, z = scale.float(), zero
    if w.dim() == 2:
        s, z = s[:, None], z[:, None]
    codes = torch.clamp(torch.round(w / s) + z, 0, (1 << bits) - 1).to(torch.int64)
    return codes, dequantize_codes(codes, z, s)


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128) -> QuantizedWeight:
    """Round-to-nearest quantization of a linear layer's weight.

    Args:
        weight: ``[N, K]`` (out_features, in_features), any float dtype (computed in float32).
        bits: 2, 4 or 8.
        group_size: input columns per group; -1 for one group over all of ``K``.
            The last group may be shorter when ``K`` is not a multiple.

    Returns:
        The :class:`QuantizedWeight` (``g_idx = k // group_size``).

    Raises:
        ValueError: unsupported ``bits``, ``group_size`` < 1 (other than -1), or ``K``
            not a multiple of ``32 // bits``.
    """
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    g = check_group_size(group_size, k, bits)
    codes = torch.empty(n, k, dtype=torch.uint8)
    groups = num_groups(k, group_size)
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.uint8)
    for gi in range(groups):
        cols = slice(gi * g, min((gi + 1) * g, k))
        scale, zero = find_params(w[:, cols], bits)
        codes[:, cols] = quantize_columns(w[:, cols], scale, zero, bits)[0].to(torch.uint8)
        scales[gi], zeros[gi] = scale, zero.to(torch.uint8)
    g_idx = (torch.arange(k) // g).to(torch.int32)
    return QuantizedWeight(codes, zeros, scales, g_idx, bits, group_size, desc_act=False)


def check_group_size(group_size: int, in_features: int, bits: int) -> int:
    """Validate ``group_size`` for a layer of ``in_features`` inputs; returns the
    effective group width (``in_features`` for -1).

    Raises:
        ValueError: ``group_size`` not -1 or >= 1, ``bits`` unsupported, or
            ``in_features`` not a multiple of ``32 // bits`` (``qweight`` packs along it).
    """
    pf = pack_factor(bits)
    if group_size != -1 and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size: expected -1 or an integer >= 1, got {group_size!r}")
    if in_features % pf:
        raise ValueError(f"in_features {in_features} is not a multiple of {pf}: qweight "
                         f"packs {pf} {bits}-bit codes per int32 along it")
    return in_features if group_size == -1 else group_size
