"""The attention-backend registry: config string -> backend factory.

Kept apart from :mod:`tandem.kernels.attention_backend` (the interface) because
the factories import the backends that implement it: the interface module
imports none of them, so no import cycle.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tandem.kernels.attention_backend import AttentionBackend, TorchAttentionBackend

logger = logging.getLogger(__name__)


def _torch_backend(device: torch.device, dtype: torch.dtype | None) -> AttentionBackend:
    return TorchAttentionBackend()


def _cpu_backend(device: torch.device, dtype: torch.dtype | None) -> AttentionBackend:
    from tandem.kernels.cpu.backend import CpuAttentionBackend  # builds the kernels lazily
    return CpuAttentionBackend()


def _triton_backend(device: torch.device, dtype: torch.dtype | None) -> AttentionBackend:
    from tandem.kernels.backend import TritonAttentionBackend  # imports triton lazily
    return TritonAttentionBackend()


def _auto_backend(device: torch.device, dtype: torch.dtype | None) -> AttentionBackend:
    """``triton`` on CUDA; on CPU the compiled ``cpu`` kernels for float32/bfloat16
    when they build on this machine (else ``torch``, logged with the reason), and
    ``torch`` for other dtypes (the compiled kernels have no float16)."""
    if device.type == "cuda":
        return _triton_backend(device, dtype)
    if dtype in (None, torch.float32, torch.bfloat16):
        try:
            return _cpu_backend(device, dtype)
        except RuntimeError as exc:     # CpuKernelsUnavailable
            logger.warning("compiled CPU kernels unavailable, using torch ops: %s", exc)
    return TorchAttentionBackend()


# Config string -> factory ``(device, dtype) -> backend``. The kernel modules are
# imported by their factory, so choosing ``torch`` never loads triton or builds C++.
ATTENTION_BACKENDS: dict[str, Callable[[torch.device, torch.dtype | None], AttentionBackend]] = {
    "auto": _auto_backend,
    "torch": _torch_backend,
    "cpu": _cpu_backend,
    "triton": _triton_backend,
}


def attention_backend_names() -> list[str]:
    """Config strings accepted by :func:`get_attention_backend`, ``auto`` first."""
    return list(ATTENTION_BACKENDS)


def get_attention_backend(name: str, device: torch.device,
                          dtype: torch.dtype | None = None,
                          batch_invariant: bool = False) -> AttentionBackend:
    """Build the backend named by config (see :data:`ATTENTION_BACKENDS`).

    ``auto`` picks ``triton`` on CUDA; on CPU it picks the compiled ``cpu``
    kernels for float32/bfloat16 when they build on this machine, and the
    ``torch`` ops otherwise (logged once, with the reason).

    Args:
        name: ``auto``, ``torch``, ``cpu`` or ``triton``.
        device: where the model runs.
        dtype: the model's dtype (None: not known, treated like float32).
        batch_invariant: attention computed per query token the same way whatever
            the batch (``EngineConfig.batch_invariant``): the compiled CPU kernels only.

    Raises:
        ValueError: unknown name.
        tandem.kernels.cpu.build.CpuKernelsUnavailable: ``cpu`` asked for explicitly,
            or ``batch_invariant`` asked for, and no compiler could build it.
    """
    if batch_invariant:
        if name not in ("auto", "cpu") or device.type != "cpu":
            raise ValueError("batch_invariant: needs the compiled CPU kernels "
                             f"(attention_backend auto or cpu on the CPU), not {name!r} on {device}")
        from tandem.kernels.cpu.backend import CpuAttentionBackend
        return CpuAttentionBackend(batch_invariant=True)
    try:
        factory = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention_backend: unknown {name!r}, "
                         f"expected one of {', '.join(ATTENTION_BACKENDS)}") from None
    return factory(device, dtype)
