"""Serving AWQ int4 checkpoints in the AutoAWQ "gemm" layout.

Layout of one linear layer ``y = x W^T`` with ``W`` ``[N, K]`` (``N`` outputs,
``K`` inputs), 4-bit weights, groups of ``g`` consecutive input channels:

- ``qweight`` int32 ``[K, N / 8]``: row ``k`` holds the 4-bit codes ``q[k, n]``
  (``0..15``) of its ``N`` outputs, eight per int32;
- ``qzeros`` int32 ``[K / g, N / 8]``: the zero point ``z[k // g, n]`` (``0..15``),
  packed the same way;
- ``scales`` float16 ``[K / g, N]``: the step ``s[k // g, n]``;

and ``W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (asymmetric, Lin et al.
2023, Section 3 / Appendix; the checkpoint stores ``W`` transposed, inputs first).

**Packing order.** The eight columns ``8c .. 8c + 7`` of one int32 word are not
stored in order: nibble ``i`` (bits ``4i .. 4i + 3``) holds column
``8c + AWQ_PACK_ORDER[i]`` with ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` -- the
even columns in the low half-word, the odd ones in the high half-word, the order
AutoAWQ's GEMM kernel unpacks with one shift per pair. Reading back, column ``j``
of a word is nibble ``AWQ_UNPACK_ORDER[j]`` (``(0, 4, 1, 5, 2, 6, 3, 7)``).

The int32 words are two's complement: a word whose top nibble is ``>= 8`` is
negative, and every bit still means what the layout says.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from torch import nn

from tandem.engine.model.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from tandem.engine.model.weights import WeightLoadError, copy_checked
from tandem.engine.quantization.int4_packed import (dequantize_int4_zp, int4_zp_linear,
                                                    pack_int4_zp, packed_int4_supported)

logger = logging.getLogger(__name__)

PACK_FACTOR = 8                                  # 4-bit values per int32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble i <- column AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)      # column j <- nibble AWQ_UNPACK_ORDER[j]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim in AWQ's interleaved order.

    Args:
        values: ``[..., N]`` integer tensor with entries in ``0..15``; ``N % 8 == 0``.

    Returns:
        ``[..., N / 8]`` int32: word ``c`` holds columns ``8c .. 8c + 7``, column
        ``8c + AWQ_PACK_ORDER[i]`` in bits ``4i .. 4i + 3``.

    Raises:
        ValueError: ``N`` not a multiple of 8, or a value outside ``0..15``.
    """
    n = values.shape[-1]
    if n % PACK_FACTOR:
        raise ValueError(f"pack_int4: last dim {n} is not a multiple of {PACK_FACTOR}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    v = v.reshape(*v.shape[:-1], n // PACK_FACTOR, PACK_FACTOR)[..., list(AWQ_PACK_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    word = (v << shifts).sum(dim=-1)               # disjoint bit fields: the sum is the OR
    # 0 .. 2**32 - 1 -> the int32 with the same bits.
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., N / 8]`` int32 -> ``[..., N]`` int32 in ``0..15``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4: expected int32 words, got {packed.dtype}")
    shifts = torch.tensor([4 * i for i in AWQ_UNPACK_ORDER], dtype=torch.int32,
                          device=packed.device)
    # An arithmetic shift fills with sign bits; the mask drops them.
    cols = (packed[..., None] >> shifts) & 0xF
    return cols.reshape(*packed.shape[:-1], packed.shape[-1] * PACK_FACTOR)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight of one AWQ gemm-layout layer.

    Args:
        qweight: int32 ``[K, N / 8]``.
        qzeros: int32 ``[K / g, N / 8]``.
        scales: float ``[K / g, N]`` (float16 in checkpoints).
        dtype: dtype of the result.

    Returns:
        ``W`` ``[N, K]`` (the ``nn.Linear`` orientation), computed in float32 as
        ``(q - z) * s`` and cast to ``dtype``.

    Raises:
        ValueError: the three shapes do not describe one layer.
    """
    k, n = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    groups = scales.shape[0]
    if groups == 0 or k % groups or tuple(scales.shape) != (groups, n) \
            or tuple(qzeros.shape) != (groups, n // PACK_FACTOR):
        raise ValueError(f"dequantize_awq: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not fit")
    q = unpack_int4(qweight).float().view(groups, k // groups, n)       # [K / g, g, N]
    z = unpack_int4(qzeros).float()[:, None, :]                          # [K / g, 1, N]
    w = q.sub_(z).mul_(scales.float()[:, None, :]).view(k, n)
    return w.t().contiguous().to(dtype)


class AWQLinearMethod(LinearMethodBase):
    """Int4 AWQ weights (AutoAWQ "gemm" layout, see the module docstring).

    :meth:`create_weights` registers, under the checkpoint's leaf names,
    ``qweight`` int32 ``[K, N / 8]``, ``qzeros`` int32 ``[K / g, N / 8]`` and
    ``scales`` ``[K / g, N]`` (created in the params dtype, so that it follows the
    model's ``.to(dtype)``; held in float32 from the first loaded tensor on, so the
    checkpoint's float16 steps stay exact).
    A fused layer (``[q, kv, kv]``, ``[F, F]``) concatenates its sub-matrices along
    ``N``: shard ``i`` fills columns ``offset_i .. offset_i + n_i`` of ``scales`` and
    the packed columns ``offset_i / 8 ..`` of ``qweight`` and ``qzeros``, so every
    sub-matrix width must be a multiple of 8.

    :meth:`process_weights_after_loading` rewrites the layer into INT4_ZP blocks
    (``layer.int4_blocks`` uint8 ``[N, K / 32 * 19]``, read by the GGUF kernels:
    :mod:`~tandem.engine.quantization.int4_packed`) on the CPU and CUDA; elsewhere,
    or for groups that are not a multiple of 32 columns, it dequantizes to a dense
    ``weight`` ``[N, K]`` in the model's dtype (``scales``' dtype before loading; the
    product ``(q - z) * s`` is formed in float32), and from there on the layer is the
    dense method's (:class:`UnquantizedLinearMethod`: ``F.linear``, or its packed CPU
    kernels for bfloat16 and batch invariance). It drops the checkpoint's tensors
    either way.

    Args:
        group_size: ``g``, the input channels sharing one scale and zero point.
            None (what ``quantization="awq"`` builds): taken from the checkpoint,
            ``g = K / rows`` of the first ``scales`` or ``qzeros`` tensor a layer
            receives; every later tensor of the layer must agree.

    Tensor parallelism: a column-parallel layer keeps whole int32 words of 8
    outputs (``qweight`` and ``qzeros`` words, ``scales`` columns); a row-parallel
    one whole groups of inputs (``qweight`` rows, ``scales`` / ``qzeros`` rows of its
    groups).

    Raises:
        WeightLoadError: (constructor of a layer) a sub-matrix width or ``N`` that is
            not a multiple of 8, or ``K`` not a multiple of ``group_size``.
    """

    name = "awq"

    def __init__(self, group_size: int | None = None):
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        self.group_size = group_size
        self._dense = UnquantizedLinearMethod()
        # Whole words and groups per rank (group size unknown: AWQ's usual ones).
        self.shard_units = ((math.lcm(32, PACK_FACTOR, group_size),
                             math.lcm(PACK_FACTOR, group_size)) if group_size
                            else (128, 64, 32))

    # -- tensor parallelism ------------------------------------------------------------------
    def narrow_output(self, layer, param_name, loaded, full, start, size):
        from tandem.engine.model.linear import narrow_checked

        if param_name == "scales":                                    # [K / g, N]
            return narrow_checked(loaded, 1, full, start, size)
        if start % PACK_FACTOR or size % PACK_FACTOR:
            raise WeightLoadError(f"tensor_parallel_size: output rows [{start}, {start + size})"
                                  f" cut the {PACK_FACTOR}-output words of {param_name}")
        return narrow_checked(loaded, 1, full // PACK_FACTOR, start // PACK_FACTOR,
                              size // PACK_FACTOR)                    # qweight, qzeros

    def narrow_input(self, layer, param_name, loaded, full, start, size):
        from tandem.engine.model.linear import narrow_checked

        if param_name == "qweight":                                   # [K, N / 8]
            return narrow_checked(loaded, 0, full, start, size)
        rows = loaded.shape[0] if loaded.dim() == 2 else 0
        g = full // rows if rows and full % rows == 0 else 0
        if not g or start % g or size % g:
            raise WeightLoadError(f"tensor_parallel_size: input columns [{start}, "
                                  f"{start + size}) of {full} do not fall on whole groups "
                                  f"({rows} group rows in {param_name})")
        return narrow_checked(loaded, 0, rows, start // g, size // g)  # scales, qzeros

    @classmethod
    def from_config(cls, quantization_config: dict[str, Any]) -> "AWQLinearMethod":
        """From a checkpoint's ``quantization_config`` (config.json).

        Raises:
            ValueError: not ``quant_method: awq`` with 4 bits, zero points and the
                ``gemm`` version (the field is named).
        """
        qc = {k.lower(): v for k, v in quantization_config.items()}
        checks = {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}
        for key, want in checks.items():
            got = qc.get(key, qc.get("w_bit") if key == "bits" else None)
            if isinstance(got, str):
                got = got.lower()
            if got != want:
                raise ValueError(f"quantization_config.{key}: expected {want!r}, got {got!r}")
        return cls(int(qc.get("group_size", qc.get("q_group_size", 128))))

    # -- creation ----------------------------------------------------------------------------
    def create_weights(self, layer: Linear, in_features: int, output_sizes: Sequence[int],
                       params_dtype: torch.dtype) -> None:
        for i, n in enumerate(output_sizes):
            if n % PACK_FACTOR:
                raise WeightLoadError(f"awq: output width {n} of sub-matrix {i} is not a "
                                      f"multiple of {PACK_FACTOR} (8 outputs per int32)")
        n = sum(output_sizes)
        groups = 0
        if self.group_size is not None:
            if in_features % self.group_size:
                raise WeightLoadError(f"awq: input width {in_features} is not a multiple of "
                                      f"group_size {self.group_size}")
            groups = in_features // self.group_size
        layer.awq_group_size = self.group_size
        layer.awq_dtype = None      # the dense weight's dtype, fixed by the first load
        layer.register_parameter("qweight", nn.Parameter(
            torch.zeros(in_features, n // PACK_FACTOR, dtype=torch.int32), requires_grad=False))
        layer.register_parameter("qzeros", nn.Parameter(
            torch.zeros(groups, n // PACK_FACTOR, dtype=torch.int32), requires_grad=False))
        # In params_dtype until loading starts, so that it follows the model's .to(dtype):
        # its dtype then is the dtype to dequantize to (see _begin_loading).
        layer.register_parameter("scales", nn.Parameter(
            torch.zeros(groups, n, dtype=params_dtype), requires_grad=False))
        layer.packed_weight = None
        layer.invariant_weight = None
        layer.panel_weight = None

    # -- loading -----------------------------------------------------------------------------
    def load_weight(self, layer: Linear, param_name: str, loaded: torch.Tensor,
                    shard_id: int | None) -> None:
        if param_name not in ("qweight", "qzeros", "scales"):
            raise WeightLoadError(f"an AWQ linear layer stores no {param_name!r}")
        if not hasattr(layer, "qweight"):
            raise WeightLoadError("awq: this layer's weights were already processed")
        packed = param_name != "scales"
        if packed and loaded.dtype != torch.int32:
            raise WeightLoadError(f"awq: {param_name} must be int32, got {loaded.dtype}")
        if not packed and not loaded.is_floating_point():
            raise WeightLoadError(f"awq: scales must be floating point, got {loaded.dtype}")
        self._begin_loading(layer, None if param_name == "qweight" else loaded)
        target = getattr(layer, param_name).data
        if shard_id is not None:
            offset, width = layer.shard_offset(shard_id), layer.output_sizes[shard_id]
            if packed:
                offset, width = offset // PACK_FACTOR, width // PACK_FACTOR
            target = target.narrow(1, offset, width)
        copy_checked(target, loaded)

    @staticmethod
    def _begin_loading(layer: Linear, group_tensor: torch.Tensor | None) -> None:
        """Before a layer's tensors land: remember the dense dtype (the dtype the model
        gave ``scales``) and keep the steps in float32 (float16 values stay exact); with
        the group size from the checkpoint, let the first ``scales``/``qzeros`` tensor
        fix ``K / g`` (later ones must then have as many rows)."""
        device = layer.qweight.device
        if layer.awq_dtype is None:
            layer.awq_dtype = layer.scales.dtype
            layer.scales = nn.Parameter(torch.zeros(layer.scales.shape, dtype=torch.float32,
                                                    device=device), requires_grad=False)
        if layer.awq_group_size is not None or group_tensor is None:
            return
        rows = group_tensor.shape[0] if group_tensor.dim() == 2 else 0
        if rows == 0 or layer.in_features % rows:
            raise WeightLoadError(f"awq: {rows} group rows do not divide the input width "
                                  f"{layer.in_features}")
        layer.awq_group_size = layer.in_features // rows
        n = layer.out_features
        layer.qzeros = nn.Parameter(torch.zeros(rows, n // PACK_FACTOR, dtype=torch.int32,
                                                device=device), requires_grad=False)
        layer.scales = nn.Parameter(torch.zeros(rows, n, dtype=torch.float32, device=device),
                                    requires_grad=False)

    # -- after loading -----------------------------------------------------------------------
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Rewrite the layer into INT4_ZP blocks kept packed (on the CPU with the
        compiled kernels or on CUDA, groups of a multiple of 32 columns, float16 scales:
        :mod:`~tandem.engine.quantization.int4_packed`, 4.75 bits per weight, exactly
        the weights ``(q - z) * s``); otherwise dequantize once to a dense ``weight``
        in the model's dtype for the dense method's kernels. The checkpoint's
        tensors are dropped either way (idempotent)."""
        if not hasattr(layer, "qweight"):
            return
        layer.int4_blocks = None
        if packed_int4_supported(layer.qweight.device, layer.in_features,
                                 getattr(layer, "batch_invariant", False)):
            k = layer.in_features
            g_idx = torch.arange(k, device=layer.qweight.device) // (k // layer.scales.shape[0])
            try:
                blocks, _ = pack_int4_zp(unpack_int4(layer.qweight.data).t(),
                                         unpack_int4(layer.qzeros.data), layer.scales.data,
                                         g_idx)
            except ValueError as exc:       # e.g. groups of 16, or bfloat16 scales
                logger.debug("AWQ layer kept dense: %s", exc)
            else:
                del layer.qweight, layer.qzeros, layer.scales
                layer.int4_blocks = nn.Parameter(blocks, requires_grad=False)
                return
        weight = dequantize_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                                layer.awq_dtype or layer.scales.dtype)
        del layer.qweight, layer.qzeros, layer.scales
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        self._dense.process_weights_after_loading(layer)

    @staticmethod
    def dequantized_weight(layer: Linear) -> torch.Tensor:
        """The processed layer's weight ``[N, K]``: float32 from its blocks when packed,
        else its dense weight (the model's dtype).

        Raises:
            RuntimeError: the layer was not processed yet, or its dense weight was
                re-laid out for a kernel (bfloat16 panels).
        """
        if getattr(layer, "int4_blocks", None) is not None:
            return dequantize_int4_zp(layer.int4_blocks, None, layer.in_features)
        if hasattr(layer, "weight"):
            return layer.weight
        raise RuntimeError("awq: the layer holds no weight to read back")

    def supports_int8_activations(self, layer: Linear) -> bool:
        blocks = getattr(layer, "int4_blocks", None)
        return blocks is not None and blocks.device.type == "cpu"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if hasattr(layer, "qweight"):
            raise RuntimeError("awq: process_weights_after_loading() was not run on this layer")
        if layer.int4_blocks is not None:
            return int4_zp_linear(x, layer.int4_blocks, None, layer.in_features,
                                  getattr(layer, "batch_invariant", False),
                                  layer.int8_activations)
        return self._dense.apply(layer, x)
