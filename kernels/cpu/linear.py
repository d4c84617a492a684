"""Linear layers with their weights pre-packed for oneDNN (bfloat16 and float32 on CPU).

``F.linear`` on bfloat16 CPU tensors runs oneDNN's matmul, which re-lays the
weight out into its blocked format on every call: one extra read and write of
every weight per step. Packing once at load time removes that (measured 15%
faster decode-sized matmuls here, results bit-identical). On float32 tensors
``F.linear`` runs MKL's sgemm, which on AMD CPUs takes its AVX2 code path
whatever the CPU has (229 GFLOP/s on 2 AVX-512 cores, the AVX2 FMA peak); oneDNN's
packed float32 matmul uses AVX-512 there and ran the default model's layers 2-4x
faster (results equal to float32 rounding, not bit-identical: another summation
order). Uses torch's ``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``
ops, the same ones torch.compile's CPU backend emits; where they are missing, or
this CPU lacks their path for the dtype, nothing is packed.

Also here: the batch-invariant linear kernel (:func:`invariant_linear`) and, for
bfloat16 inputs of up to :data:`AMX_LINEAR_MAX_ROWS` rows on AMX CPUs,
:func:`amx_linear` (up to :data:`DPBF16_LINEAR_MAX_ROWS` on AVX-512 BF16 CPUs
without AMX, :func:`dpbf16_linear`), all over the same 16-column panel layout
(:func:`pack_invariant_weight`).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build has the oneDNN packed-linear ops and this CPU runs
    their ``dtype`` path (bfloat16: oneDNN wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    without them the reorder raises at the first pack). Probed once per process and
    dtype."""
    try:
        if not (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        return True
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Copy ``weight`` ``[out_features, in_features]`` (bfloat16 or float32, CPU) into
    oneDNN's blocked layout; the result is only meaningful to :func:`packed_linear`.

    Call only where :func:`packing_available` is true for its dtype.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` for a weight from :func:`pack_weight`: ``[T, in]`` -> ``[T, out]``;
    bfloat16: bit-identical to ``F.linear(x, W)``; float32: equal up to summation
    order."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


class PackedLinear(nn.Module):
    """A bias-free linear layer ``y = x W^T`` holding ``W`` in oneDNN's layout.

    Args:
        weight: ``[out_features, in_features]`` bfloat16 on the CPU; copied into the
            packed layout (the module keeps no plain copy).

    Shapes: ``x`` ``[T, in_features]`` -> ``[T, out_features]``, bfloat16.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A plain attribute, not a parameter: .to() and state_dict() must not see it.
        self.packed_weight = pack_weight(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every bias-free bfloat16 CPU ``nn.Linear`` of ``model`` by a
    :class:`PackedLinear` (in place). Idempotent.

    Returns:
        The number of layers replaced (0 when packing is unavailable).
    """
    if not packing_available():
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is nn.Linear and child.bias is None
                    and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu"):
                setattr(module, name, PackedLinear(child.weight))
                count += 1
    return count


# -- batch-invariant linear (csrc/linear.cpp) ---------------------------------------------
INVARIANT_PANEL = 16   # output columns per packed panel of csrc/linear.cpp


@functools.cache
def invariant_linear_available() -> bool:
    """Whether the compiled kernels (and with them :func:`invariant_linear`) load on
    this machine (a C++ compiler built them, or a cached build exists). Probed
    once per process."""
    from tandem.kernels.cpu.build import CpuKernelsUnavailable, load_library

    try:
        load_library()
        return True
    except CpuKernelsUnavailable:
        return False


def pack_invariant_weight(weight: torch.Tensor) -> torch.Tensor:
    """Copy ``weight`` ``[N, K]`` (float32 or bfloat16, CPU) into the panel layout of
    the batch-invariant kernel (see ``csrc/linear.cpp``): float32 ``[P, K, 16]``,
    bfloat16 ``[P, Kp / 2, 16, 2]`` (``P = ceil(N / 16)``, ``Kp`` = ``K`` rounded up
    to even), zero-padded. The result is only meaningful to :func:`invariant_linear`.

    Raises:
        ValueError: another dtype or device, or not 2-D.
    """
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in (
            torch.float32, torch.bfloat16):
        raise ValueError(f"weight: expected a 2-D float32/bfloat16 CPU tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    p = -(-n // INVARIANT_PANEL)
    w = weight.detach()
    kp = k + (k & 1) if weight.dtype == torch.bfloat16 else k
    if n % INVARIANT_PANEL or kp != k:
        # Zero rows (and a zero k) to whole panels (pairs); a weight that needs none
        # is permuted straight from itself (one copy, not two: ~5x faster to pack,
        # which every engine build does for every dense layer).
        padded = w.new_zeros(p * INVARIANT_PANEL, kp)
        padded[:n, :k] = w
        w = padded
    if weight.dtype == torch.float32:
        return w.view(p, INVARIANT_PANEL, k).transpose(1, 2).contiguous()
    return w.view(p, INVARIANT_PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def invariant_linear(x: torch.Tensor, packed_weight: torch.Tensor, out_features: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` whose every row is computed the same way whatever the batch:
    ``[T, K]`` -> ``[T, N]`` in ``x``'s dtype (float32 or bfloat16, that of the
    packed weight), each element one float32 fused-multiply-add chain over ``k`` in
    order, rounded once (``csrc/linear.cpp``). Row ``t`` of the result is
    bit-identical for any ``T`` and any other rows.

    Args:
        x: ``[T, K]`` CPU, rows may be strided, the last dim contiguous.
        packed_weight: from :func:`pack_invariant_weight` of a ``[N, K]`` weight.
        out_features: ``N``.
        out: optional ``[T, N]`` destination (rows may be strided).

    Raises:
        ValueError: dtype, device or shape mismatch.
    """
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype != packed_weight.dtype:
        raise ValueError(f"x: expected a 2-D CPU tensor of {packed_weight.dtype}, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    t, k = x.shape
    kw = packed_weight.shape[1] * (2 if x.dtype == torch.bfloat16 else 1)
    if kw != k + (k & 1 if x.dtype == torch.bfloat16 else 0) or out_features > (
            packed_weight.shape[0] * INVARIANT_PANEL):
        raise ValueError(f"x: in_features {k} does not fit the packed weight "
                         f"{tuple(packed_weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = x.new_empty(t, out_features)
    elif out.shape != (t, out_features) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out: expected [{t}, {out_features}] {x.dtype} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype}")
    if t:
        _linear_fn(x.dtype)(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                            packed_weight.data_ptr(), t, out_features, k, torch.get_num_threads())
    return out


@functools.cache
def _linear_fn(dtype: torch.dtype):
    """The compiled kernel for ``dtype``, looked up once (every layer of every step calls it)."""
    from tandem.kernels.cpu.build import load_library

    return getattr(load_library(), "tandem_linear_f32" if dtype == torch.float32
                   else "tandem_linear_bf16")


# -- small batches on AMX tiles (csrc/amx_linear.cpp) --------------------------------------
def _max_rows_from_env(default: int, name: str = "TANDEM_AMX_LINEAR_MAX_ROWS") -> int:
    """The row bound in the environment variable ``name``; ``default`` where it is
    unset or empty.

    Raises:
        ValueError: anything but an integer >= 0, naming the variable.
    """
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{name}: expected a row count >= 0, got {value!r}")
    return rows


AMX_LINEAR_MAX_ROWS = _max_rows_from_env(1280)
"""Rows up to which :func:`amx_linear` is used instead of oneDNN's packed matmul
(``TANDEM_AMX_LINEAR_MAX_ROWS`` in the environment sets another bound, read at import:
the crossing point is the host's and the model's; 0: decode steps too on oneDNN).
SmolLM2-135M's 30 layers on a 2-core AMX host (``benchmarks/amx_linear.py``, the
weights coming from memory as in a step): 1.2-1.3x oneDNN's speed from 1 to 64
rows, 1.05-1.3x from 128 to 1280 (reading x 512 rows at a time), 0.85x from 1408
to 2048, where oneDNN's blocking wins. Below this bound there is also no
primitive to create: oneDNN JIT-compiles one per layer shape for every row count
new to the process (5-18 ms a step, ~4 MiB per count; 1024 primitives, so 128
counts, kept), so steps of varying token counts paid it again and again
(``benchmarks/onednn_row_counts.py``). An invalid value of the variable raises
``ValueError`` when this module is imported (with the engine)."""


def _check_panel_input(x: torch.Tensor, panel_weight: torch.Tensor, out_features: int,
                       dtype: torch.dtype = torch.bfloat16) -> int:
    """``x``'s in_features after the checks :func:`amx_linear`, :func:`dpbf16_linear`
    and (``dtype`` float32) :func:`avx512_f32_linear` share.

    Raises:
        ValueError: ``x`` not 2-D ``dtype`` on the CPU, the weight not ``dtype``, or the
            two shapes not matching.
    """
    name = str(dtype).removeprefix("torch.")
    if x.dim() != 2 or x.device.type != "cpu" or x.dtype != dtype or \
            panel_weight.dtype != dtype:
        raise ValueError(f"x: expected a 2-D {name} CPU tensor (and a {name} panel "
                         f"weight), got {tuple(x.shape)} {x.dtype} on {x.device}")
    k = x.shape[1]
    per_row = 2 if dtype == torch.bfloat16 else 1
    if panel_weight.shape[1] * per_row != k or \
            out_features > panel_weight.shape[0] * INVARIANT_PANEL:
        raise ValueError(f"x: in_features {k} does not fit the panel weight "
                         f"{tuple(panel_weight.shape)}")
    return k


@functools.cache
def _library_fn(name: str):
    """The compiled kernel ``name``, looked up once (every layer of every step calls it)."""
    from tandem.kernels.cpu.build import load_library

    return getattr(load_library(), name)


def _panel_call(fn, x: torch.Tensor, panel_weight: torch.Tensor,
                out_features: int) -> torch.Tensor:
    """``[T, K]`` -> ``[T, N]`` through the compiled panel kernel ``fn`` (out, out
    stride, x, x stride, weight, M, N, K, threads)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    t, k = x.shape
    out = x.new_empty(t, out_features)
    if t:
        fn(out.data_ptr(), out_features, x.data_ptr(), x.stride(0), panel_weight.data_ptr(), t,
           out_features, k, torch.get_num_threads())
    return out


@functools.cache
def amx_linear_usable(in_features: int) -> bool:
    """Whether :func:`amx_linear` runs here for ``in_features``: the compiled kernels
    load, the CPU has AMX-BF16 (the build's ``-march``), the OS granted this process
    AMX tile state, and ``in_features`` is a multiple of 32 (a whole tile of k)."""
    if not invariant_linear_available():
        return False
    from tandem.kernels.cpu.build import load_library

    return bool(load_library().tandem_amx_linear_usable(in_features))


def amx_linear(x: torch.Tensor, panel_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x W^T`` in bfloat16 on AMX tiles (TDPBF16PS), reading the weight in the
    16-column panels of :func:`pack_invariant_weight` (``[P, K / 2, 16, 2]``: 16
    k-pair rows of a panel are one 1 KiB B tile): ``[T, K]`` -> ``[T, N]``.

    Every output is a float32 sum of bfloat16 products, rounded to bfloat16 once;
    the order of the sum is the tile unit's (oneDNN's AMX kernels give the same bits
    at decode sizes, not always beyond). Meant for ``T`` up to
    :data:`AMX_LINEAR_MAX_ROWS`: a decode step's matmul is reading its weight, and
    this reads it front to back, 1 KiB tiles prefetched four steps ahead; a prompt's
    rows are taken 512 at a time (each a pass over the weight), so that they stay in
    L2 while every panel walks them. A row's result does not depend on ``T``.

    Args:
        x: ``[T, K]`` bfloat16 CPU, rows may be strided, the last dim contiguous.
        panel_weight: :func:`pack_invariant_weight` of a bfloat16 ``[N, K]`` weight.
        out_features: ``N``.

    Raises:
        ValueError: dtype, device or shape mismatch, or :func:`amx_linear_usable` is
            false for ``K``.
    """
    k = _check_panel_input(x, panel_weight, out_features)
    if not amx_linear_usable(k):
        raise ValueError(f"x: no AMX linear kernel here for in_features {k} (needs an "
                         "AMX-BF16 CPU and in_features % 32 == 0)")
    return amx_linear_unchecked(x, panel_weight, out_features)


def amx_linear_unchecked(x: torch.Tensor, panel_weight: torch.Tensor,
                         out_features: int) -> torch.Tensor:
    """:func:`amx_linear` without its checks, for a layer whose ``panel_weight`` was
    packed for it where :func:`amx_linear_usable` held (every decode step calls this
    once per linear layer; the checks were ~2.5 us of a ~10 us call)."""
    return _panel_call(_library_fn("tandem_amx_linear_bf16"), x, panel_weight, out_features)


# -- small batches on AVX-512 BF16 without AMX (csrc/dpbf16_linear.cpp) ------------------
DPBF16_LINEAR_MAX_ROWS = _max_rows_from_env(256, "TANDEM_DPBF16_LINEAR_MAX_ROWS")
"""Rows up to which :func:`dpbf16_linear` is used instead of oneDNN's packed matmul
on a CPU with AVX-512 BF16 and no AMX (``TANDEM_DPBF16_LINEAR_MAX_ROWS`` in the
environment sets another bound, read at import; 0: oneDNN everywhere).
SmolLM2-135M's 30 layers on a 2-core AMD EPYC with AVX-512 BF16, the weights
coming from memory as in a step (``benchmarks/amx_linear.py``, two runs): 1.4-1.7x
oneDNN's speed from 1 to 8 rows, 1.2-1.3x at 16-32, 1.04-1.2x from 64 to 256 (1.04x
at 512 in one run). Below the bound no oneDNN primitive is created per row count
either (2-3 ms a count here, far less than on AMX hosts).
An invalid value raises ``ValueError`` when this module is imported."""


@functools.cache
def dpbf16_linear_usable(in_features: int) -> bool:
    """Whether :func:`dpbf16_linear` runs here for ``in_features``: the compiled
    kernels load, the build has AVX-512 BF16 (the ``-march``), and ``in_features`` is
    even (whole k pairs)."""
    if not invariant_linear_available():
        return False
    from tandem.kernels.cpu.build import load_library

    return bool(load_library().tandem_dpbf16_linear_usable(in_features))


def dpbf16_linear(x: torch.Tensor, panel_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x W^T`` in bfloat16 by AVX-512 BF16 dot products (``vdpbf16ps``), reading the
    weight in the 16-column panels of :func:`pack_invariant_weight` (``[P, K / 2, 16,
    2]``: one k pair of a panel is one 64-byte vector): ``[T, K]`` -> ``[T, N]``.

    Each output is a float32 sum over the k pairs in order, rounded to bfloat16 once;
    a row's result does not depend on ``T`` or on the other rows. Meant for ``T`` up
    to :data:`DPBF16_LINEAR_MAX_ROWS` on CPUs without AMX: blocks of up to 6 rows by
    4 panels (24 zmm accumulators) walk K once, so a decode step reads each weight
    once, four panels side by side; the threads split the panels.

    Args:
        x: ``[T, K]`` bfloat16 CPU, rows may be strided, the last dim contiguous.
        panel_weight: :func:`pack_invariant_weight` of a bfloat16 ``[N, K]`` weight.
        out_features: ``N``.

    Raises:
        ValueError: dtype, device or shape mismatch, or :func:`dpbf16_linear_usable`
            is false for ``K``.
    """
    k = _check_panel_input(x, panel_weight, out_features)
    if not dpbf16_linear_usable(k):
        raise ValueError(f"x: no AVX-512 BF16 linear kernel here for in_features {k} (needs "
                         "a CPU with AVX-512 BF16 and an even in_features)")
    return dpbf16_linear_unchecked(x, panel_weight, out_features)


def dpbf16_linear_unchecked(x: torch.Tensor, panel_weight: torch.Tensor,
                            out_features: int) -> torch.Tensor:
    """:func:`dpbf16_linear` without its checks, for a layer whose ``panel_weight``
    was packed for it where :func:`dpbf16_linear_usable` held."""
    return _panel_call(_library_fn("tandem_dpbf16_linear_bf16"), x, panel_weight, out_features)


# -- small batches in float32 on AVX-512F (csrc/dpbf16_linear.cpp) ---------------------------
AVX512_F32_LINEAR_MAX_ROWS = _max_rows_from_env(1024, "TANDEM_AVX512_F32_LINEAR_MAX_ROWS")
"""Rows up to which :func:`avx512_f32_linear` is used instead of oneDNN's packed
float32 matmul on an AVX-512F CPU (``TANDEM_AVX512_F32_LINEAR_MAX_ROWS`` in the
environment sets another bound, read at import; 0: oneDNN everywhere).
SmolLM2-135M's 30 layers on a 2-core AMD EPYC with AVX-512 (``benchmarks/amx_linear.py
--dtype float32``): 1.3-2x oneDNN's speed from 1 to 8 rows, 1.1-1.3x at 16-64,
1.03-1.1x from 128 to 1024, level at 1536-2048. Below the bound no oneDNN
primitive is created per row count either. An invalid value raises
``ValueError`` when this module is imported."""


@functools.cache
def avx512_f32_linear_usable(in_features: int) -> bool:
    """Whether :func:`avx512_f32_linear` runs here for ``in_features``: the compiled
    kernels load and the build has AVX-512F (the ``-march``)."""
    if not invariant_linear_available():
        return False
    from tandem.kernels.cpu.build import load_library

    return bool(load_library().tandem_avx512_f32_linear_usable(in_features))


def avx512_f32_linear(x: torch.Tensor, panel_weight: torch.Tensor,
                      out_features: int) -> torch.Tensor:
    """``x W^T`` in float32 by AVX-512 FMAs, reading the weight in the float32
    16-column panels of :func:`pack_invariant_weight` (``[P, K, 16]``: one k of a
    panel is one 64-byte vector): ``[T, K]`` -> ``[T, N]``.

    Each output is one float32 fused-multiply-add chain over ``k`` in order, as in
    :func:`invariant_linear`, whose results it equals bit for bit (so a row's result
    does not depend on ``T``). Meant for ``T`` up to
    :data:`AVX512_F32_LINEAR_MAX_ROWS`: blocks of up to 6 rows by 4 panels (24 zmm
    accumulators) walk K once, the four panels' weights streaming side by side; the
    threads split the panels.

    Args:
        x: ``[T, K]`` float32 CPU, rows may be strided, the last dim contiguous.
        panel_weight: :func:`pack_invariant_weight` of a float32 ``[N, K]`` weight.
        out_features: ``N``.

    Raises:
        ValueError: dtype, device or shape mismatch, or :func:`avx512_f32_linear_usable`
            is false for ``K``.
    """
    k = _check_panel_input(x, panel_weight, out_features, torch.float32)
    if not avx512_f32_linear_usable(k):
        raise ValueError(f"x: no AVX-512 float32 linear kernel here for in_features {k} "
                         "(needs a CPU with AVX-512F)")
    return avx512_f32_linear_unchecked(x, panel_weight, out_features)


def avx512_f32_linear_unchecked(x: torch.Tensor, panel_weight: torch.Tensor,
                                out_features: int) -> torch.Tensor:
    """:func:`avx512_f32_linear` without its checks, for a layer whose ``panel_weight``
    was packed for it where :func:`avx512_f32_linear_usable` held."""
    return _panel_call(_library_fn("tandem_avx512_f32_linear_f32"), x, panel_weight,
                       out_features)
