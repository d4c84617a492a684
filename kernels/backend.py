"""The ``triton`` attention backend: the Triton kernels of this package behind
:class:`tandem.kernels.attention_backend.AttentionBackend`.

On GPU the kernels compile natively. On CPU tensors they run under the Triton
interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before
``triton`` is first imported (the launchers raise ``ValueError`` otherwise);
that path exists for tests, the ``torch`` backend is the fast CPU path.
"""

from __future__ import annotations

import torch

from tandem.kernels import int4_kv
from tandem.kernels.activation import silu_and_mul
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata
from tandem.kernels.fused_moe import fused_moe
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

        An fp8 cache (``kv_cache_dtype fp8_e4m3``) is written and read by the same
        kernels with the per-head ``k_scale``/``v_scale`` ``[Hkv]``. An int4 cache
        (``uint8`` rows, :mod:`tandem.kernels.int4_kv`) is written by
        :func:`~tandem.kernels.int4_kv.reshape_and_cache_int4` with the step's plan
        (``k_scale`` is the layer's open-block K store) and read by the attention
        kernels directly, the open last blocks' K from the store.

        Raises:
            ValueError: an fp8 cache without scales; an int4 cache without the
                step's write plan or the store.
        """
        if key_cache.dtype == torch.uint8:
            if meta.int4_plan is None or k_scale is None:
                raise ValueError("int4 KV cache: needs the step's write plan (meta.int4_plan) "
                                 "and the layer's open-block K store (k_scale)")
            int4_kv.reshape_and_cache_int4(key, value, key_cache, value_cache, meta.slot_mapping,
                                           k_scale, meta.int4_plan)
            v_scale = meta.int4_plan.seq_open_entries      # on the cache's device
        else:
            reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping,
                              k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decodes
        if nd:
            # Decodes own exactly one query row each, so rows [0, nd) are theirs.
            paged_decode_attention(
                query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                scale, max(meta.seq_lens_cpu[:nd]), out=out[:nd], k_scale=k_scale,
                v_scale=v_scale[:nd] if key_cache.dtype == torch.uint8 else v_scale)
        if nd < meta.num_seqs:
            qsl = meta.query_start_loc_cpu[nd:]
            first = qsl[0]
            query_start_loc = torch.tensor([x - first for x in qsl], dtype=torch.int32,
                                           device=query.device)
            max_query_len = max(b - a for a, b in zip(qsl[:-1], qsl[1:]))
            paged_prefill_attention(
                query[first:], key_cache, value_cache, meta.block_tables[nd:],
                query_start_loc, meta.seq_lens[nd:], max_query_len, scale, out=out[first:],
                k_scale=k_scale,
                v_scale=v_scale[nd:] if key_cache.dtype == torch.uint8 else v_scale)
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

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """See :func:`tandem.kernels.fused_moe.fused_moe` (block-aligned expert groups,
        one grouped GEMM per projection)."""
        return fused_moe(x, w13, w2, topk_weights, topk_ids)
