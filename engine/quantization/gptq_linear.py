"""Serving GPTQ checkpoints (AutoGPTQ layout, :mod:`~tandem.engine.quantization.packing`):
the ``gptq`` linear method (named in :mod:`tandem.engine.quantization.registry`,
and chosen by :mod:`tandem.engine.quantization.checkpoint` for a checkpoint whose
``quantization_config`` says ``gptq``).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from tandem.engine.model.linear import LinearMethodBase, UnquantizedLinearMethod
from tandem.engine.model.weights import WeightLoadError, copy_checked
from tandem.engine.quantization.int4_packed import (dequantize_int4_zp, int4_zp_linear,
                                                    pack_int4_zp, packed_int4_supported)
from tandem.engine.quantization.packing import (dequantize_packed, num_groups, pack_factor,
                                                unpack_qweight, unpack_zeros)

if TYPE_CHECKING:
    from tandem.engine.model.linear import Linear

logger = logging.getLogger(__name__)

_DENSE = UnquantizedLinearMethod()
_PACKED = ("qweight", "qzeros", "scales", "g_idx")
# quantization_config.checkpoint_format -> what is added to a stored zero point.
_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


class GPTQLinearMethod(LinearMethodBase):
    """GPTQ-quantized weights in the AutoGPTQ checkpoint layout.

    Per layer with ``K`` inputs, ``N`` outputs (the fused sub-matrices side by side),
    ``pf = 32 // bits`` and ``G = ceil(K / group_size)`` groups, the parameters are
    the checkpoint's own tensors, under its leaf names:

    - ``qweight`` int32 ``[K / pf, N]``; ``qzeros`` int32 ``[G, N / pf]``;
    - ``scales`` ``[G, N]``: the checkpoint's float16 values, kept as their raw
      bits (int16) so that the model's ``.to(dtype)`` never rounds them;
    - ``g_idx`` int32 ``[K]``.

    A fused layer (``qkv_proj``, ``gate_up_proj``) receives each sub-matrix at its
    column offset of ``qweight``, ``scales`` and ``qzeros``; ``qzeros`` packs ``pf``
    outputs per int32, so every sub-matrix's size must be a multiple of ``pf``.
    ``g_idx`` runs along ``K``, which the sub-matrices share: they must all carry
    the same one.

    After loading, a 4-bit layer on the CPU (with the compiled kernels) or on CUDA
    (the Triton kernel; not with ``batch_invariant``), ``K`` a multiple of 32 and
    every group a multiple of 32 columns, is rewritten into rows of
    INT4_ZP blocks (:mod:`~tandem.engine.quantization.int4_packed`: 4.75 bits per
    weight, ``layer.int4_blocks`` uint8 ``[N, K / 32 * 19]`` and, under act-order,
    ``layer.int4_perm`` int64 ``[K]``), and the checkpoint's ``qweight``, ``qzeros``
    and ``scales`` are dropped (``g_idx`` stays). The matmul reads the blocks with
    the GGUF kernels, on weights exactly
    ``W[n, k] = (code - zero[g_idx[k], n]) * scale[g_idx[k], n]``; only the float32
    summation order differs from a dense layer holding that weight.

    Any other layer (2 or 8 bits, no kernel for the device) is dequantized once to a
    dense ``weight`` ``[N, K]`` in the model's dtype, and the matmul is the dense
    method's (:class:`~tandem.engine.model.linear.UnquantizedLinearMethod`:
    ``F.linear``, or its packed bfloat16 / batch-invariant CPU kernels), so it
    computes exactly what a dense layer with the dequantized weight does; its
    packed tensors stay on the layer.

    Args:
        bits: 2, 4 or 8.
        group_size: input columns per group, or -1 (one group).
        desc_act: the checkpoint was quantized in act-order (informational: ``g_idx``
            carries the grouping either way).
        zero_offset: added to each stored zero point, modulo ``2**bits``: 1 for
            ``checkpoint_format`` ``gptq`` (v1, AutoGPTQ), 0 for ``gptq_v2``.

    Tensor parallelism: a column-parallel layer keeps whole packed columns (its
    outputs' ``qweight`` / ``scales`` columns, ``qzeros`` words of ``pf`` outputs;
    ``g_idx`` whole); a row-parallel one whole groups of inputs (``qweight`` words,
    ``scales`` / ``qzeros`` rows of its groups, its slice of ``g_idx`` renumbered).
    Under act-order (``desc_act``) a row-parallel rank's inputs belong to groups
    anywhere, so it keeps its ``qweight`` words and ``g_idx`` slice (ids unchanged)
    and every group's ``scales`` / ``qzeros`` rows; its groups then rarely fill whole
    32-column blocks, so such a rank's layer is usually served dequantized.

    Raises:
        ValueError: unsupported ``bits`` or ``group_size``.
    """

    name = "gptq"

    def __init__(self, bits: int = 4, group_size: int = 128, desc_act: bool = False,
                 zero_offset: int = 1):
        self.pack_factor = pack_factor(bits)
        if group_size != -1 and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size: expected -1 or an integer >= 1, got {group_size!r}")
        self.bits, self.group_size, self.desc_act = bits, group_size, bool(desc_act)
        self.zero_offset = zero_offset
        pf = self.pack_factor
        # Whole int32 words and whole groups per rank; multiples of 32 preferred (the
        # INT4_ZP kernel's blocks).
        self.shard_units = ((math.lcm(32, pf), pf) if group_size == -1
                            else (math.lcm(32, pf, group_size), math.lcm(pf, group_size)))

    @classmethod
    def from_config(cls, quantization_config: dict) -> "GPTQLinearMethod":
        """From a checkpoint's ``quantization_config`` (config.json) or quantize_config.json.

        Raises:
            ValueError: a field this method cannot serve (named as
                ``quantization_config.<field>``).
        """
        qc = quantization_config
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in _ZERO_OFFSETS:
            raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not served "
                             f"(expected one of {', '.join(_ZERO_OFFSETS)})")
        try:
            return cls(bits=int(qc.get("bits", 4)), group_size=int(qc.get("group_size", 128)),
                       desc_act=bool(qc.get("desc_act", False)), zero_offset=_ZERO_OFFSETS[fmt])
        except ValueError as exc:
            raise ValueError(f"quantization_config.{exc}") from None

    def create_weights(self, layer, in_features, output_sizes, params_dtype):
        pf = self.pack_factor
        if in_features % pf:
            raise WeightLoadError(f"GPTQ packs {pf} inputs per int32 of qweight: "
                                  f"in_features {in_features} is not a multiple of {pf}")
        bad = [size for size in output_sizes if size % pf]
        if bad:
            raise WeightLoadError(f"GPTQ packs {pf} outputs per int32 of qzeros: output "
                                  f"sizes {list(output_sizes)} are not all multiples of {pf}")
        n = sum(output_sizes)
        groups = num_groups(in_features, self.group_size)
        shapes = {"qweight": ((in_features // pf, n), torch.int32),
                  "qzeros": ((groups, n // pf), torch.int32),
                  "scales": ((groups, n), torch.int16),       # float16 bits
                  "g_idx": ((in_features,), torch.int32)}
        for name, (shape, dtype) in shapes.items():
            layer.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype),
                                                        requires_grad=False))
        # Carries the model's dtype through ``.to(dtype)`` (every parameter above
        # is an integer tensor, which ``.to`` leaves alone).
        layer.register_buffer("dtype_probe", torch.empty(0, dtype=params_dtype), persistent=False)
        layer.g_idx_shards = set()
        layer.gptq_dequantized = False
        layer.register_parameter("int4_blocks", None)         # set if packed at load
        layer.register_buffer("int4_perm", None, persistent=False)
        layer.packed_weight = None
        layer.invariant_weight = None
        layer.panel_weight = None

    def load_weight(self, layer, param_name, loaded, shard_id):
        if param_name not in _PACKED:
            raise WeightLoadError(f"a GPTQ linear layer stores no {param_name!r} "
                                  f"(it stores {', '.join(_PACKED)})")
        if param_name == "scales":
            if not loaded.is_floating_point():
                raise WeightLoadError(f"scales: expected a float tensor, got {loaded.dtype}")
            loaded = loaded.to(torch.float16).view(torch.int16)
        elif loaded.dtype != torch.int32:
            raise WeightLoadError(f"{param_name}: expected int32, got {loaded.dtype}")
        target = getattr(layer, param_name).data
        if (param_name in ("scales", "qzeros") and self.desc_act
                and getattr(layer, "full_in_features", layer.in_features) != layer.in_features
                and loaded.shape[0] != target.shape[0]):
            # A row-parallel rank of an act-order layer keeps every group's row
            # (narrow_input): size the tensor by the whole layer's groups.
            target = torch.zeros(loaded.shape[0], *target.shape[1:], dtype=target.dtype)
            layer.register_parameter(param_name, nn.Parameter(target, requires_grad=False))
        if param_name == "g_idx":
            self._load_g_idx(layer, target, loaded, shard_id)
            return
        if shard_id is not None:
            offset, size = layer.shard_offset(shard_id), layer.output_sizes[shard_id]
            if param_name == "qzeros":
                offset, size = offset // self.pack_factor, size // self.pack_factor
            target = target.narrow(1, offset, size)
        copy_checked(target, loaded)

    def narrow_output(self, layer, param_name, loaded, full, start, size):
        from tandem.engine.model.linear import narrow_checked

        if param_name == "g_idx":
            return loaded                        # along the inputs, which every rank has
        if param_name == "qzeros":
            pf = self.pack_factor
            if start % pf or size % pf:
                raise WeightLoadError(f"tensor_parallel_size: output rows [{start}, "
                                      f"{start + size}) cut the {pf}-output words of qzeros")
            return narrow_checked(loaded, 1, full // pf, start // pf, size // pf)
        return narrow_checked(loaded, 1, full, start, size)   # qweight, scales: [., N]

    def narrow_input(self, layer, param_name, loaded, full, start, size):
        from tandem.engine.model.linear import narrow_checked

        pf, g = self.pack_factor, self.group_size
        if self.desc_act:
            return self._narrow_input_act_order(param_name, loaded, full, start, size)
        if start % pf or size % pf or (g != -1 and (start % g or (size % g and
                                                                    start + size != full))):
            raise WeightLoadError(
                f"tensor_parallel_size: input columns [{start}, {start + size}) of {full} do "
                f"not fall on whole {pf}-input words and groups of {g}")
        if param_name == "qweight":                                  # [K / pf, N]
            return narrow_checked(loaded, 0, full // pf, start // pf, size // pf)
        if param_name == "g_idx":
            want = (torch.zeros(full, dtype=torch.int32) if g == -1
                    else torch.arange(full, dtype=torch.int32) // g)
            if not torch.equal(loaded.cpu().to(torch.int32), want):
                raise WeightLoadError("g_idx: not the contiguous groups of a checkpoint "
                                      "without act-order; it is not sharded")
            return narrow_checked(loaded, 0, full, start, size) - (0 if g == -1 else start // g)
        if g == -1:                                                 # one group: whole
            return loaded
        return narrow_checked(loaded, 0, num_groups(full, g), start // g,
                              num_groups(size, g))                  # scales, qzeros rows

    def _narrow_input_act_order(self, param_name, loaded, full, start, size):
        """A row-parallel rank's share of an act-order layer: its input columns'
        ``qweight`` rows and ``g_idx`` entries (group ids as they are), and every
        group's ``scales`` / ``qzeros`` (its inputs belong to groups anywhere)."""
        from tandem.engine.model.linear import narrow_checked

        pf = self.pack_factor
        if start % pf or size % pf:
            raise WeightLoadError(f"tensor_parallel_size: input columns [{start}, "
                                  f"{start + size}) of {full} do not fall on whole "
                                  f"{pf}-input words")
        if param_name == "qweight":
            return narrow_checked(loaded, 0, full // pf, start // pf, size // pf)
        if param_name == "g_idx":
            return narrow_checked(loaded, 0, full, start, size)
        return loaded                                   # scales, qzeros: every group

    @staticmethod
    def _load_g_idx(layer, target, loaded, shard_id):
        if shard_id is None or not layer.g_idx_shards:
            copy_checked(target, loaded)
        else:
            if tuple(loaded.shape) != tuple(target.shape):
                copy_checked(target, loaded)        # raises, naming both shapes
            if not torch.equal(target, loaded.to(target.device)):
                first = min(layer.g_idx_shards)
                raise WeightLoadError(f"g_idx of sub-matrix {shard_id} differs from that of "
                                      f"sub-matrix {first}: the sub-matrices fused into one "
                                      "layer share its inputs and must share g_idx")
        layer.g_idx_shards.add(shard_id)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """The layer's dense weight, float32 ``[N, K]``, from its packed tensors.

        Raises:
            WeightLoadError: a ``g_idx`` entry outside ``[0, G)``.
        """
        if layer.int4_blocks is not None:
            return dequantize_int4_zp(layer.int4_blocks, layer.int4_perm, layer.in_features)
        groups = layer.scales.shape[0]
        g_idx = layer.g_idx
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise WeightLoadError(f"g_idx: values must lie in [0, {groups}), got "
                                  f"[{int(g_idx.min())}, {int(g_idx.max())}]")
        return dequantize_packed(layer.qweight, layer.qzeros, layer.scales.view(torch.float16),
                                 g_idx, self.bits, self.zero_offset)

    def process_weights_after_loading(self, layer):
        """Pack a 4-bit layer into INT4_ZP blocks, or else dequantize once to
        ``layer.weight`` (the model's dtype) and let the dense method prepare it for
        its kernel (see the class docstring; idempotent).

        Raises:
            WeightLoadError: a ``g_idx`` entry outside ``[0, G)``.
            ValueError: ``batch_invariant`` off the CPU (the dense method's check).
        """
        if layer.gptq_dequantized or layer.int4_blocks is not None:
            return
        groups = layer.scales.shape[0]
        g_idx = layer.g_idx
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise WeightLoadError(f"g_idx: values must lie in [0, {groups}), got "
                                  f"[{int(g_idx.min())}, {int(g_idx.max())}]")
        invariant = getattr(layer, "batch_invariant", False)
        if self.bits == 4 and packed_int4_supported(layer.qweight.device, layer.in_features,
                                                    invariant):
            try:
                blocks, perm = pack_int4_zp(
                    unpack_qweight(layer.qweight, self.bits),
                    unpack_zeros(layer.qzeros, self.bits, self.zero_offset),
                    layer.scales.view(torch.float16), g_idx)
            except ValueError as exc:       # e.g. groups of 16 columns: served dense
                logger.debug("GPTQ layer kept dense: %s", exc)
            else:
                layer.int4_blocks = nn.Parameter(blocks, requires_grad=False)
                layer.int4_perm = perm
                del layer.qweight, layer.qzeros, layer.scales
                return
        weight = self.dequantized_weight(layer).to(layer.dtype_probe.dtype)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.gptq_dequantized = True
        _DENSE.process_weights_after_loading(layer)

    def supports_int8_activations(self, layer):
        blocks = getattr(layer, "int4_blocks", None)
        return blocks is not None and blocks.device.type == "cpu"

    def apply(self, layer, x):
        if layer.int4_blocks is not None:
            return int4_zp_linear(x, layer.int4_blocks, layer.int4_perm, layer.in_features,
                                  getattr(layer, "batch_invariant", False),
                                  layer.int8_activations)
        return _DENSE.apply(layer, x)

