"""The ``triton`` attention backend: the Triton kernels of this package behind
:class:`tandem.kernels.attention_backend.AttentionBackend`.

On GPU the kernels compile natively. On CPU tensors they run under the Triton
interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before
``triton`` is first imported (the launchers raise ``ValueError`` otherwise);
that path exists for tests, the ``torch`` backend is the fast CPU path.
"""

from __future__ import annotations

import torch

from tandem.kernels.activation import silu_and_mul
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata
from tandem.kernels.paged_decode_attention import paged_decode_attention
from tandem.kernels.paged_prefill_attention import paged_prefill_attention
from tandem.kernels.reshape_and_cache import reshape_and_cache
from tandem.kernels.rms_norm import rms_norm
from tandem.kernels.rotary import rotary_embedding


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels for the per-layer hot path; stateless, one per engine."""

    name = "triton"

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's K/V at ``meta.slot_mapping``, then decode attention for
        the first ``meta.num_decodes`` sequences and causal prefill attention over
        the cache for the rest. Shapes as in :meth:`AttentionBackend.attention`.

        Raises:
            ValueError: a quantized cache (``kv_cache_dtype fp8_e4m3`` or ``int4``): the
                Triton kernels read caches in the model dtype only, for now.
        """
        if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
            raise ValueError(f"KV cache of {key_cache.dtype}: not supported by the triton "
                             "attention backend yet (use kv_cache_dtype auto, or the "
                             "torch/cpu backend)")
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decodes
        if nd:
            # Decodes own exactly one query row each, so rows [0, nd) are theirs.
            paged_decode_attention(
                query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                scale, max(meta.seq_lens_cpu[:nd]), out=out[:nd])
        if nd < meta.num_seqs:
            qsl = meta.query_start_loc_cpu[nd:]
            first = qsl[0]
            query_start_loc = torch.tensor([x - first for x in qsl], dtype=torch.int32,
                                           device=query.device)
            max_query_len = max(b - a for a, b in zip(qsl[:-1], qsl[1:]))
            paged_prefill_attention(
                query[first:], key_cache, value_cache, meta.block_tables[nd:],
                query_start_loc, meta.seq_lens[nd:], max_query_len, scale, out=out[first:])
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """See :func:`tandem.kernels.rms_norm.rms_norm`."""
        return rms_norm(x, weight, eps, residual)

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`tandem.kernels.rotary.rotary_embedding`."""
        return rotary_embedding(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See :func:`tandem.kernels.activation.silu_and_mul`."""
        return silu_and_mul(x)
