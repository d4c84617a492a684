"""The ``cpu`` attention backend: compiled CPU kernels behind
:class:`tandem.kernels.attention_backend.AttentionBackend`.

Decode attention, KV-cache writes, RMSNorm, rotary embedding and SiLU-and-mul run
in :mod:`tandem.kernels.cpu.ops` (one call per layer each, instead of a dozen
small torch ops). Prefill attention runs there too in bfloat16 on CPUs with
AVX-512 BF16; otherwise (float32, older CPUs) it stays on torch's fused CPU
flash attention (see :class:`~tandem.kernels.attention_backend.TorchAttentionBackend`).
float32 and bfloat16 only.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention_backend import AttentionMetadata, TorchAttentionBackend
from tandem.kernels.cpu import ops


class CpuAttentionBackend(TorchAttentionBackend):
    """Compiled CPU kernels for the per-layer hot path; stateless, one per engine.

    Raises:
        tandem.kernels.cpu.build.CpuKernelsUnavailable: at construction, when the
            kernels cannot be built on this machine.
    """

    name = "cpu"

    def __init__(self) -> None:
        from tandem.kernels.cpu.build import load_library
        # Whether this build has the bf16 prefill kernel: fixed per process, so
        # decided once here rather than on every layer of every step.
        self._bf16_prefill = bool(load_library().tandem_has_prefill_attention_bf16())

    @staticmethod
    def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len):
        return ops.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                          seq_lens, scale)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Shapes as in :meth:`AttentionBackend.attention`. Decodes read the cache in
        place; prefill chunks go through :func:`ops.paged_prefill_attention` where it
        runs (bfloat16, AVX-512 BF16), else through :meth:`TorchAttentionBackend.attend`."""
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if (nd == meta.num_seqs or not self._bf16_prefill or query.dtype != torch.bfloat16
                or not ops.prefill_head_dim_ok(query.shape[2])):
            return self.attend(query, key, value, key_cache, value_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            ops.paged_decode_attention(query[:nd], key_cache, value_cache,
                                       meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                       out=out[:nd])
        qsl = meta.query_start_loc_cpu[nd:]
        ops.paged_prefill_attention(query[qsl[0]:], key_cache, value_cache,
                                    meta.block_tables[nd:], [x - qsl[0] for x in qsl],
                                    meta.seq_lens_cpu[nd:], scale, out=out[qsl[0]:])
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        return ops.rms_norm(x, weight, eps, residual)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        return ops.rotary_embedding(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x):
        return ops.silu_and_mul(x)
