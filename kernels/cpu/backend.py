"""The ``cpu`` attention backend: compiled CPU kernels behind
:class:`tandem.kernels.attention_backend.AttentionBackend`.

Decode attention, KV-cache writes, RMSNorm, rotary embedding and SiLU-and-mul run
in :mod:`tandem.kernels.cpu.ops` (one call per layer each, instead of a dozen
small torch ops). Prefill attention runs there too, in bfloat16 on CPUs with
AVX-512 BF16 (its products on AMX tiles where the CPU has them) and in float32 on
CPUs with AVX-512F; otherwise (AVX2-only CPUs) it stays on torch's fused CPU flash attention (see
:class:`~tandem.kernels.attention_backend.TorchAttentionBackend`). float32 and
bfloat16 only.

An fp8 (``float8_e4m3fn``) KV cache is written by the compiled fp8
``reshape_and_cache`` and read by the compiled fp8 decode kernel; prefill chunks
then take the torch path, which dequantizes the gathered blocks (the prefill
kernel reads caches in the query's dtype only).

An int4 (packed ``uint8``) KV cache: a step's new per-token rows are quantized and
written by the compiled int4 ``reshape_and_cache`` (the bytes of
:func:`tandem.kernels.int4_kv.quantize_int4_tokens`), the blocks it fills are
rewritten per channel by the torch code of :mod:`tandem.kernels.int4_kv`; it is
read by the compiled int4 decode kernel; prefill chunks take the torch path.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention_backend import AttentionMetadata, TorchAttentionBackend
from tandem.kernels.cpu import ops


class CpuAttentionBackend(TorchAttentionBackend):
    """Compiled CPU kernels for the per-layer hot path; stateless, one per engine.

    Args:
        batch_invariant: attend every query token, prefill chunks' too, with the
            paged decode kernel over its own cached context (the first ``p + 1``
            tokens for position ``p``), so that a token's attention is one fixed
            computation whatever the batch, the chunking or which of its context
            came from the prefix cache. Prefill attention then costs a pass over
            the context per query token instead of a tiled FlashAttention loop.

    Raises:
        tandem.kernels.cpu.build.CpuKernelsUnavailable: at construction, when the
            kernels cannot be built on this machine.
    """

    name = "cpu"
    _int4_token_rows = staticmethod(ops.reshape_and_cache_int4_rows)

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        # The dtypes this build has the prefill kernel for: fixed per process, so
        # decided once here rather than on every layer of every step (asking builds
        # and loads the kernels, raising CpuKernelsUnavailable where they cannot be).
        self._prefill_dtypes = {dt for dt in (torch.bfloat16, torch.float32)
                                if ops.has_prefill_attention(dt, 64)}
        # (the step's metadata, its ops.DecodeStep or None where the step is not all
        # decodes): decided and prepared by the step's first layer, reused by the rest.
        self._decode_step: tuple | None = None

    @staticmethod
    def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                k_scale=None, v_scale=None):
        return ops.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                          seq_lens, scale, k_scale=k_scale, v_scale=v_scale)

    def _decode_windowed(self, query, key_cache, value_cache, block_tables, seq_lens, scale,
                         max_seq_len, k_scale=None, v_scale=None, window=None, softcap=None):
        """Decodes of a sliding-window or soft-capped layer: the compiled decode kernel
        (it starts each sequence's context ``window`` tokens back and caps the
        scores) for a cache in the query's dtype; a quantized cache's through torch."""
        if key_cache.dtype == query.dtype:
            return ops.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                              seq_lens, scale, window=window, softcap=softcap)
        return super()._decode_windowed(query, key_cache, value_cache, block_tables, seq_lens,
                                        scale, max_seq_len, k_scale, v_scale, window, softcap)

    def decode_from_qkv(self, qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache,
                        key_cache, value_cache, meta, scale, k_scale=None, v_scale=None, *,
                        window=None, softcap=None):
        """A step of decodes only, with a cache in the model's dtype: RoPE, the cache
        write and the decode kernel through :func:`ops.decode_from_qkv`, with the
        step's slots, tables and lengths prepared once for all layers (the
        general path checks and converts them in every layer: ~2.5 ms of a 31-34 ms
        16-sequence bfloat16 step of the default model here). The same kernels as
        :meth:`attention` takes for such a step, so the same values bit for bit; None
        for any other step (prefill chunks, a quantized cache), and for a window
        below 1 or a cap not above 0, which the general path refuses by name."""
        cached = self._decode_step
        if cached is None or cached[0] is not meta:     # once per step: all decodes?
            cached = (meta, ops.DecodeStep(meta.slot_mapping, meta.block_tables, meta.seq_lens)
                      if meta.num_decodes == meta.num_seqs else None)
            self._decode_step = cached
        step = cached[1]
        if (step is None or key_cache.dtype != qkv.dtype
                or (window is not None and window < 1)
                or (softcap is not None and not softcap > 0)
                or qkv.dtype not in (torch.float32, torch.bfloat16)
                or not qkv.is_contiguous() or cos_sin_cache.dtype != torch.float32
                or not (cos_sin_cache.is_contiguous() and key_cache.is_contiguous()
                        and value_cache.is_contiguous())):
            return None
        return ops.decode_from_qkv(qkv, num_heads, num_kv_heads, head_dim, positions,
                                   cos_sin_cache, key_cache, value_cache, step, scale,
                                   window=window, softcap=softcap)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, *, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Shapes as in :meth:`AttentionBackend.attention`. Decodes read the cache in
        place; prefill chunks go through :func:`ops.paged_prefill_attention` where it
        runs (a bfloat16 cache with AVX-512 BF16, a float32 one with AVX-512F), else
        through :meth:`TorchAttentionBackend.attend`.

        A layer with a sliding ``window`` or a ``softcap`` is written by the compiled
        cache write; its decodes take the compiled decode kernel (which has both),
        its prefill chunks :meth:`TorchAttentionBackend.attend`'s torch ops (the
        compiled prefill kernel has neither).

        In batch-invariant mode every query token of such a layer, too, goes through
        the decode kernel over its own context, with the window and the cap.

        Raises:
            ValueError: a quantized cache in batch-invariant mode, or without scales.
        """
        if window is not None or softcap is not None:
            if self.batch_invariant and key_cache.dtype != query.dtype:
                raise ValueError("batch_invariant: needs kv_cache_dtype auto")
            if key_cache.dtype == torch.uint8:
                return super().attention(query, key, value, key_cache, value_cache, meta,
                                         scale, k_scale, v_scale, window=window,
                                         softcap=softcap)
            ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping,
                                  k_scale, v_scale)
            if self.batch_invariant:
                return self.attend_per_token(query, key_cache, value_cache, meta, scale,
                                             window=window, softcap=softcap)
            return self.attend(query, key, value, key_cache, value_cache, meta, scale,
                               k_scale, v_scale, window=window, softcap=softcap)
        if key_cache.dtype == torch.uint8:
            if self.batch_invariant:
                raise ValueError("batch_invariant: needs kv_cache_dtype auto")
            # Through TorchAttentionBackend: the compiled row write (_int4_token_rows),
            # the rest of the write in torch, decodes via self._decode.
            return super().attention(query, key, value, key_cache, value_cache, meta, scale,
                                     k_scale, v_scale)
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping,
                              k_scale, v_scale)
        nd = meta.num_decodes
        if self.batch_invariant:
            if key_cache.dtype != query.dtype:
                raise ValueError("batch_invariant: needs kv_cache_dtype auto")
            return self.attend_per_token(query, key_cache, value_cache, meta, scale)
        if (nd == meta.num_seqs or query.dtype not in self._prefill_dtypes
                or key_cache.dtype != query.dtype
                or not ops.prefill_head_dim_ok(query.shape[2])):
            return self.attend(query, key, value, key_cache, value_cache, meta, scale,
                               k_scale, v_scale)
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

    @staticmethod
    def attend_per_token(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, *, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
        """Attention of the batch-invariant mode, after the cache write: every query
        token ``[T, Hq, D]`` through the paged decode kernel over its own context
        (:func:`per_token_context`), so that its result is the same computation
        whether the token is a decode, in a prefill chunk, or after cached blocks (a
        sliding ``window``: its last ``window`` tokens; ``softcap`` caps its scores).
        Returns ``[T, Hq, D]``."""
        if meta.num_decodes == meta.num_seqs:
            return ops.paged_decode_attention(query, key_cache, value_cache, meta.block_tables,
                                              meta.seq_lens, scale, window=window,
                                              softcap=softcap)
        tables, lens = per_token_context(meta)
        return ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale,
                                          window=window, softcap=softcap)

    def rms_norm(self, x, weight, eps, residual=None):
        return ops.rms_norm(x, weight, eps, residual)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        return ops.rotary_embedding(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x):
        return ops.silu_and_mul(x)


def per_token_context(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed query token as a sequence of its own: the block table of its
    sequence and its context length (its position + 1). Computed once per step and
    kept on ``meta`` (every layer asks).

    Returns:
        ``(block_tables [T, max_blocks] int32, seq_lens [T] int32)``.
    """
    cached = meta.__dict__.get("_per_token_context")
    if cached is None:
        qsl = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs), q_lens)     # [T]
        # A token `back` places before its sequence's last query token sees
        # seq_len - back tokens (itself included).
        back = qsl[1:][seq] - 1 - torch.arange(meta.num_tokens)
        lens = (torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)[seq] - back).to(torch.int32)
        cached = (meta.block_tables.index_select(0, seq).contiguous(), lens)
        object.__setattr__(meta, "_per_token_context", cached)   # frozen: a per-step cache
    return cached
