"""Linear layers whose weight storage, loading and matmul belong to a *linear method*.

This is vLLM's ``LinearMethodBase`` / ``quant_method`` split. A :class:`Linear`
module knows only its shape: ``in_features`` and the output sizes of the
sub-matrices fused into it (``[q, kv, kv]`` for QKV, ``[F, F]`` for gate-up).
Its :class:`LinearMethodBase` decides the rest:

- which tensors the layer stores (:meth:`~LinearMethodBase.create_weights`): one
  dense ``weight`` today; a quantized format registers several packed tensors
  (GPTQ/AWQ ``qweight``, ``scales``, ``qzeros``; GGUF quant blocks) under its
  checkpoint's leaf names, so that the model's name mapping carries
  ``q_proj.qweight`` to ``qkv_proj.qweight`` as it carries ``q_proj.weight``;
- how one checkpoint tensor lands in them (:meth:`~LinearMethodBase.load_weight`):
  a fused layer receives each sub-matrix on its own, by shard id (its index in the
  output sizes), and where a shard goes depends on the packing (rows of a dense
  weight, columns of a GPTQ ``qweight`` ``[in / 8, out]``);
- what happens once every tensor is in
  (:meth:`~LinearMethodBase.process_weights_after_loading`): a re-layout for the
  kernel that will run (oneDNN packing for bfloat16 on CPU);
- the matmul itself (:meth:`~LinearMethodBase.apply`).

Methods are chosen by the config string ``EngineConfig.quantization`` through
:data:`tandem.engine.quantization.registry.LINEAR_METHODS`: ``none`` (dense,
unquantized) is defined here, the quantized formats in :mod:`tandem.engine.quantization`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.weights import WeightLoadError, copy_checked
from tandem.kernels.cpu.linear import (AMX_LINEAR_MAX_ROWS, AVX512_F32_LINEAR_MAX_ROWS,
                                       DPBF16_LINEAR_MAX_ROWS, amx_linear_unchecked,
                                       amx_linear_usable, avx512_f32_linear_unchecked,
                                       avx512_f32_linear_usable,
                                       dpbf16_linear_unchecked, dpbf16_linear_usable,
                                       invariant_linear,
                                       invariant_linear_available, pack_invariant_weight,
                                       pack_weight, packed_linear, packing_available)


class LinearMethodBase(ABC):
    """How a :class:`Linear` layer stores, loads and multiplies by its weights.

    A method is stateless: one instance serves every layer, and whatever a layer
    needs (its tensors, a packed copy) lives on the layer. Methods may mutate only
    the ``layer`` they are given, and only its own attributes.
    """

    name: str = ""

    @abstractmethod
    def create_weights(self, layer: Linear, in_features: int, output_sizes: Sequence[int],
                       params_dtype: torch.dtype) -> None:
        """Register on ``layer`` the parameters this format stores, named as the
        checkpoint names them (the last component of the tensor name).

        Called inside the module's constructor, typically on the ``meta`` device.

        Args:
            layer: the layer being built.
            in_features: input width ``K``.
            output_sizes: rows of each fused sub-matrix; ``sum(output_sizes)`` is
                the output width ``N``.
            params_dtype: dtype of floating-point parameters (activations' dtype);
                packed integer tensors keep their own.
        """

    @abstractmethod
    def load_weight(self, layer: Linear, param_name: str, loaded: torch.Tensor,
                    shard_id: int | None) -> None:
        """Copy one checkpoint tensor into ``layer``'s parameter ``param_name``.

        Args:
            loaded: the checkpoint's tensor, in the checkpoint's dtype.
            shard_id: None (the tensor fills the whole parameter) or the index in
                ``layer.output_sizes`` of the fused sub-matrix it holds.

        Raises:
            WeightLoadError: a shape that does not fit, or a tensor this format
                does not store.
        """

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Re-lay the loaded tensors out for the kernel :meth:`apply` runs.

        Called once every tensor is loaded; must be idempotent. The default keeps
        the tensors as loaded.
        """

    def supports_int8_activations(self, layer: Linear) -> bool:
        """Whether :meth:`apply` can quantize the activations to int8 blocks for
        ``layer`` once processed (its weight kept in blocks the CPU kernel of
        :func:`tandem.kernels.cpu.gguf_linear.gguf_linear` reads). Default: no."""
        return False

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x W^T``: ``[T, in_features]`` -> ``[T, out_features]``, in ``x``'s dtype."""

    # -- tensor parallelism (tandem.engine.parallel.layers) -------------------------------
    shard_units: tuple[int, ...] = (1,)
    """Tensor parallelism: the multiples of which a split of an MLP's intermediate
    features may be made (whole packed words and quantization groups or blocks on
    every rank), in order of preference
    (:func:`~tandem.engine.parallel.partition.split_in_units`)."""

    @property
    def supports_tensor_parallel(self) -> bool:
        """Whether this format's layers shard (it overrides :meth:`narrow_output` and
        :meth:`narrow_input`)."""
        return type(self).narrow_output is not LinearMethodBase.narrow_output

    def narrow_output(self, layer: Linear, param_name: str, loaded: torch.Tensor, full: int,
                      start: int, size: int) -> torch.Tensor:
        """The part of checkpoint tensor ``param_name`` (of a sub-matrix with ``full``
        output rows) that holds output rows ``[start, start + size)``: what a
        column-parallel rank keeps. Called before :meth:`load_weight`.

        Raises:
            WeightLoadError: a tensor of another size, or a slice that cuts a packed
                word.
            NotImplementedError: a format that does not shard (the default).
        """
        raise NotImplementedError(f"tensor_parallel_size > 1: {self.name!r} linear layers "
                                  "are not sharded")

    def narrow_input(self, layer: Linear, param_name: str, loaded: torch.Tensor, full: int,
                     start: int, size: int) -> torch.Tensor:
        """The part of checkpoint tensor ``param_name`` (of a weight with ``full``
        input columns) that holds input columns ``[start, start + size)``: what a
        row-parallel rank keeps (:meth:`narrow_output`'s counterpart; same errors)."""
        raise NotImplementedError(f"tensor_parallel_size > 1: {self.name!r} linear layers "
                                  "are not sharded")


def narrow_checked(loaded: torch.Tensor, dim: int, full: int, start: int, size: int
                   ) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)`` of a tensor that must be ``full`` long along
    ``dim`` (raises :class:`WeightLoadError` otherwise)."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise WeightLoadError(f"checkpoint shape {tuple(loaded.shape)}: expected {full} "
                              f"along dim {dim} to take this rank's slice from")
    return loaded.narrow(dim, start, size)


class UnquantizedLinearMethod(LinearMethodBase):
    """Dense weight ``[out_features, in_features]`` in the model's dtype.

    The matmul is ``F.linear``, except on the CPU:

    - with ``layer.batch_invariant`` (``EngineConfig.batch_invariant``), the
      compiled batch-invariant kernel (:func:`~tandem.kernels.cpu.linear.invariant_linear`:
      each output one float32 FMA chain over ``k`` in order, so a row's result does
      not depend on the batch), its weight packed once into 16-column panels;
    - otherwise for bfloat16, oneDNN's matmul with the weight packed once
      (:mod:`tandem.kernels.cpu.linear`: bit-identical, and it saves a re-layout of
      every weight on every step), where oneDNN has a bfloat16 path on this CPU
      (AVX-512); elsewhere the batch-invariant kernel above (float32 FMAs on the
      bfloat16 weights, 4-5x torch's emulated bfloat16 GEMM on AVX2);
    - and with ``layer.small_batch_linear`` (``EngineConfig.small_batch_linear``) on
      an AMX host, inputs of at most :data:`~tandem.kernels.cpu.linear.AMX_LINEAR_MAX_ROWS`
      (1280) rows (decode steps, most prompts) through
      :func:`~tandem.kernels.cpu.linear.amx_linear`'s kernel, which reads a second
      copy of the weight in 16-column panels 1.05-1.3x faster than oneDNN there and
      creates nothing per row count; larger inputs keep oneDNN. On an AVX-512 BF16
      host without AMX the same copy serves inputs of at most
      :data:`~tandem.kernels.cpu.linear.DPBF16_LINEAR_MAX_ROWS` (256) rows through
      :func:`~tandem.kernels.cpu.linear.dpbf16_linear` (1.3-1.7x oneDNN's speed at
      1-16 rows, 1.04-1.3x up to 256); for float32 on any AVX-512F host, inputs of
      at most :data:`~tandem.kernels.cpu.linear.AVX512_F32_LINEAR_MAX_ROWS` rows
      through :func:`~tandem.kernels.cpu.linear.avx512_f32_linear` (float32 panels).
    """

    name = "none"

    def create_weights(self, layer, in_features, output_sizes, params_dtype):
        weight = nn.Parameter(torch.empty(sum(output_sizes), in_features, dtype=params_dtype),
                              requires_grad=False)
        # nn.Linear's initialisation, so that a model built off the meta device
        # (tests) computes something finite before any checkpoint is loaded.
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        layer.register_parameter("weight", weight)
        layer.packed_weight = None
        layer.invariant_weight = None
        layer.panel_weight = None
        layer.panel_kernel = None       # "amx", "dpbf16", "avx512_f32": reads panel_weight

    def load_weight(self, layer, param_name, loaded, shard_id):
        if param_name != "weight":
            raise WeightLoadError(f"a dense linear layer stores no {param_name!r}")
        target = layer.weight.data
        if shard_id is not None:
            target = target.narrow(0, layer.shard_offset(shard_id), layer.output_sizes[shard_id])
        copy_checked(target, loaded)

    def process_weights_after_loading(self, layer):
        if layer.packed_weight is not None or layer.invariant_weight is not None:
            return
        w = layer.weight
        if layer.batch_invariant:
            if w.device.type != "cpu":
                raise ValueError("batch_invariant: the batch-invariant linear kernel runs on "
                                 f"the CPU only, not on {w.device}")
            layer.invariant_weight = pack_invariant_weight(w)
            del layer.weight            # as below: only the packed copy is read
            return
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if packing_available(w.dtype):
            # oneDNN's packed matmul; for float32 also instead of MKL's sgemm, whose
            # AVX2 path is all AMD CPUs get (see tandem.kernels.cpu.linear).
            layer.packed_weight = pack_weight(w)
            if layer.small_batch_linear:
                if w.dtype == torch.float32:
                    if avx512_f32_linear_usable(layer.in_features):
                        layer.panel_kernel = "avx512_f32"
                elif amx_linear_usable(layer.in_features):
                    layer.panel_kernel = "amx"
                elif dpbf16_linear_usable(layer.in_features):
                    layer.panel_kernel = "dpbf16"
                if layer.panel_kernel is not None:
                    layer.panel_weight = pack_invariant_weight(w)
        elif w.dtype == torch.bfloat16 and invariant_linear_available():
            # No native bfloat16 dot product for oneDNN (no AVX-512): torch
            # emulates bfloat16 GEMMs (about 14 GFLOP/s on 2 AVX2 cores) and the
            # compiled float32-FMA kernel is 4-5x faster on the same weights.
            layer.invariant_weight = pack_invariant_weight(w)
        else:
            return
        # The packed copy is all apply() reads: drop this layer's plain one (a tied
        # weight stays alive through the module it is shared with).
        del layer.weight

    def narrow_output(self, layer, param_name, loaded, full, start, size):
        return narrow_checked(loaded, 0, full, start, size)         # weight [N, K]: rows

    def narrow_input(self, layer, param_name, loaded, full, start, size):
        return narrow_checked(loaded, 1, full, start, size)         # columns

    def apply(self, layer, x):
        if layer.invariant_weight is not None:
            return invariant_linear(x, layer.invariant_weight, layer.out_features)
        if layer.panel_weight is not None:
            kernel, rows = layer.panel_kernel, x.shape[0]
            if kernel == "amx":
                if rows <= AMX_LINEAR_MAX_ROWS:
                    return amx_linear_unchecked(x, layer.panel_weight, layer.out_features)
            elif kernel == "dpbf16":
                if rows <= DPBF16_LINEAR_MAX_ROWS:
                    return dpbf16_linear_unchecked(x, layer.panel_weight, layer.out_features)
            elif rows <= AVX512_F32_LINEAR_MAX_ROWS:
                return avx512_f32_linear_unchecked(x, layer.panel_weight, layer.out_features)
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight)
        return F.linear(x, layer.weight)


class Linear(nn.Module):
    """A linear layer ``y = x W^T (+ b)`` whose weight storage is its method's.

    Args:
        in_features: input width ``K``.
        output_sizes: output width ``N``, or the rows of each sub-matrix fused
            into the layer (``[q, kv, kv]``); checkpoint tensors of a fused layer
            are loaded one sub-matrix (shard) at a time.
        quant_method: the :class:`LinearMethodBase`; dense when None.
        params_dtype: dtype of its floating-point parameters (None: torch's default).
        bias: a bias ``b`` ``[N]`` in ``params_dtype`` (Qwen2's Q/K/V). It belongs to
            the layer, not the method: every weight format adds it after its matmul,
            and a fused layer loads it by shard like the weight.

    ``batch_invariant`` (set before the weights are processed, see
    :func:`process_weights_after_loading`) asks the method for a kernel whose row
    results do not depend on the batch; a method without one raises ``ValueError``
    there.

    Shapes: ``x`` ``[T, in_features]`` -> ``[T, out_features]``.
    """

    def __init__(self, in_features: int, output_sizes: int | Sequence[int],
                 quant_method: LinearMethodBase | None = None,
                 params_dtype: torch.dtype | None = None, bias: bool = False):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.batch_invariant = False
        self.small_batch_linear = False
        self.int8_activations = False
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, in_features, self.output_sizes, params_dtype)
        self.bias = (nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype),
                                  requires_grad=False) if bias else None)

    @property
    def shard_ids(self) -> tuple[int | None, ...]:
        """The shard ids a checkpoint fills this layer's parameters with: one per
        fused sub-matrix, or ``(None,)`` (the whole tensor) when nothing is fused."""
        return tuple(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else (None,)

    def shard_offset(self, shard_id: int) -> int:
        """First output row of sub-matrix ``shard_id``."""
        return sum(self.output_sizes[:shard_id])

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        """See :meth:`LinearMethodBase.load_weight` (raises :class:`WeightLoadError`);
        ``bias`` is the layer's own (rows of shard ``shard_id``)."""
        if param_name == "bias" and self.bias is not None:
            target = self.bias.data
            if shard_id is not None:
                target = target.narrow(0, self.shard_offset(shard_id), self.output_sizes[shard_id])
            copy_checked(target, loaded)
            return
        self.quant_method.load_weight(self, param_name, loaded, shard_id)

    def process_weights_after_loading(self) -> None:
        """See :meth:`LinearMethodBase.process_weights_after_loading`."""
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
                f"quant_method={self.quant_method.name}"
                + (", packed" if getattr(self, "packed_weight", None) is not None else "")
                + (", batch-invariant" if self.batch_invariant else "")
                + (", int8 activations" if self.int8_activations else "")
                + (", bias" if self.bias is not None else ""))


def process_weights_after_loading(model: nn.Module, batch_invariant: bool = False,
                                  activation_quantization: str = "none",
                                  small_batch_linear: bool | None = False) -> None:
    """Run every :class:`Linear` layer's post-loading step, and that of any other
    module with a ``process_weights_after_loading()`` (a quantized embedding)
    (idempotent).

    Args:
        batch_invariant: give every layer a batch-invariant kernel
            (``EngineConfig.batch_invariant``).
        activation_quantization: ``int8``: every layer whose method keeps its weight
            in blocks the int8-activation kernel reads
            (:meth:`LinearMethodBase.supports_int8_activations`) multiplies int8
            activation blocks (``EngineConfig.activation_quantization``).
        small_batch_linear: ``EngineConfig.small_batch_linear``: True gives every
            dense bfloat16 or float32 layer the small-batch kernel the CPU has one
            for (a second copy of its weight); None decides by :func:`small_batch_linear_fits`;
            ignored with ``batch_invariant``.

    Raises:
        ValueError: ``batch_invariant`` where a layer's method or device has no such
            kernel; ``activation_quantization`` ``int8`` where no layer can.
    """
    int8_layers = 0
    if small_batch_linear is None:
        small_batch_linear = small_batch_linear_fits(model)
    for module in model.modules():
        if isinstance(module, Linear):
            if batch_invariant:
                module.batch_invariant = True
            elif small_batch_linear:
                module.small_batch_linear = True
            module.process_weights_after_loading()
            if activation_quantization == "int8" and \
                    module.quant_method.supports_int8_activations(module):
                module.int8_activations = True
                int8_layers += 1
        elif module is not model and callable(getattr(module, "process_weights_after_loading",
                                                      None)):
            module.process_weights_after_loading()
    if activation_quantization == "int8" and not int8_layers:
        raise ValueError("activation_quantization: 'int8' needs linear layers kept in "
                         "quantized blocks on the CPU (quantization 'gguf', --quantization "
                         "gguf, or a GPTQ / AWQ checkpoint); this model has none")


SMALL_BATCH_COPY_SHARE = 0.1
"""``small_batch_linear=None`` keeps the second (panel) copy of the dense bfloat16
and float32 weights while it takes at most this share of the machine's memory."""


def small_batch_linear_fits(model: nn.Module) -> bool:
    """Whether the panel copies of ``model``'s dense bfloat16 and float32 CPU linear
    weights (:func:`~tandem.kernels.cpu.linear.amx_linear`,
    :func:`~tandem.kernels.cpu.linear.dpbf16_linear`,
    :func:`~tandem.kernels.cpu.linear.avx512_f32_linear`) would take at most
    :data:`SMALL_BATCH_COPY_SHARE` of this machine's physical memory (bytes from
    ``sysconf``): SmolLM2-135M's 0.2 GB (bfloat16) or 0.4 GB (float32) yes on 24 GB,
    a 7B model's 13 GB no."""
    import os

    extra = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                if isinstance(m, Linear) and isinstance(m.quant_method, UnquantizedLinearMethod)
                and isinstance(getattr(m, "weight", None), torch.Tensor)
                and m.weight.dtype in (torch.bfloat16, torch.float32)
                and m.weight.device.type == "cpu")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0 < extra <= SMALL_BATCH_COPY_SHARE * total
