"""Attention backends: one small interface, chosen by config (``auto``, ``torch``, ``cpu``,
``triton``).

A backend owns the hot per-layer operations of the model: writing new K/V into
the paged cache, attention over it (decode and prefill), RMSNorm, rotary
embedding and SiLU-and-mul. The model calls only this interface, so the CPU
(torch reference) path and the GPU (Triton) path run the same model code.

The interface lives beside its implementations (:class:`TorchAttentionBackend`
here, the Triton one in :mod:`tandem.kernels.backend`, the compiled CPU one in
:mod:`tandem.kernels.cpu.backend`) so that ``tandem.kernels`` never imports
``tandem.engine``: the engine depends on the kernels, not the other way round. The
registry keyed by the config string is :mod:`tandem.kernels.registry`.

Batch layout (built by the model runner for every step): tokens of all scheduled
sequences are packed along dim 0, **decode sequences first** (one query token
each), then prefill chunks::

    | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |      <- T packed tokens
      num_decodes = 3               query_start_loc = [0, 1, 2, 3, 7, 9]
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.kernels import int4_kv
from tandem.kernels import reference as ref


@dataclass(frozen=True)
class AttentionMetadata:
    """Forward metadata of one step, shared by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot (``block_id * block_size + offset``)
            where each packed token's K/V is written.
        block_tables: ``[B, max_blocks]`` int32, padded with 0 past a sequence's blocks.
        seq_lens: ``[B]`` int32, context length of each sequence after this step
            (cached/computed tokens plus this step's tokens).
        query_start_loc_cpu: ``B + 1`` host ints, cumulative query lengths.
        seq_lens_cpu: ``B`` host ints (same values as ``seq_lens``).
        num_decodes: the first ``num_decodes`` sequences have exactly one query
            token each and are decodes.
        max_seq_len: ``max(seq_lens)`` (tokens).
        int4_plan: with an int4 KV cache, the step's
            :class:`~tandem.kernels.int4_kv.Int4WritePlan`; None otherwise.
        prompt_lens_cpu: ``B`` host ints, each sequence's prompt length (tokens),
            for a model whose RoPE depends on it (``longrope``); None otherwise.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    max_seq_len: int
    int4_plan: Any = None
    prompt_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class AttentionBackend(ABC):
    """Per-layer hot operations over a paged KV cache.

    Methods may write only the tensors their docstrings name (the KV cache in
    :meth:`attention`, q/k in :meth:`rotary_embedding`).
    """

    name: str = ""
    supports_sliding_window: bool = False
    """Whether :meth:`attention` takes ``window`` (a model with a sliding-window
    layer is refused on a backend without it; see
    :meth:`~tandem.engine.model.layers.DecoderForCausalLM.check_backend`)."""
    supports_logit_softcap: bool = False
    """Whether :meth:`attention` takes ``softcap`` (Gemma 2's attention logit
    soft-capping)."""

    def decode_from_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_dim: int, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, *, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor | None:
        """A layer's whole attention from its fused QKV projection ``[T, (Hq + 2 Hkv)
        D]`` -- RoPE, the cache write and attention -- in one call where the backend
        has a faster path for the step (``[T, Hq D]``, the same values as
        :meth:`rotary_embedding` then :meth:`attention`); None where it has not, and
        the caller takes the general path. Arguments as in :meth:`attention` and
        :meth:`rotary_embedding`. This base has no such path."""
        return None

    @abstractmethod
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float,
                  k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend.

        A backend whose :attr:`supports_sliding_window` / :attr:`supports_logit_softcap`
        is true also takes the keywords ``window`` (int tokens or None: a query at
        position ``p`` sees only keys at ``p - window + 1 .. p``, transformers'
        ``sliding_window``) and ``softcap`` (float or None: scores ``s * scale``
        become ``softcap * tanh(s * scale / softcap)`` before the mask and softmax);
        callers pass them only when set, so other backends keep this signature.

        Args:
            query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]``.
            key_cache, value_cache: ``[NB, BS, Hkv, D]`` of this layer, in the
                model dtype or ``torch.float8_e4m3fn``, or packed int4 rows
                ``uint8 [NB, BS, Hkv, R]`` (:mod:`tandem.kernels.int4_kv`); written
                at ``meta.slot_mapping``.
            meta: the step's :class:`AttentionMetadata`.
            scale: softmax scale.
            k_scale, v_scale: ``[Hkv]`` float32 per-head scales of an fp8 cache
                (stored = e4m3(clamp(x / scale, +-448)), read = scale * stored; see
                :mod:`tandem.kernels.reference`); for an int4 cache ``k_scale`` is
                this layer's open-block K store ``[S, BS, Hkv, D]`` in the model dtype
                and ``v_scale`` is None; None for a cache in the model dtype.

        Returns:
            ``[T, Hq, D]``.

        Raises:
            ValueError: a quantized cache without scales, or one the backend cannot read.
        """

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """See :func:`tandem.kernels.reference.rms_norm_ref`."""

    @abstractmethod
    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]`` in place."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, 2F]`` -> ``[T, F]``."""

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): ``[T, 2F]`` = [gate | up] -> ``gelu_tanh(gate) * up``
        ``[T, F]`` (torch's ``gelu(approximate="tanh")``, transformers'
        ``gelu_pytorch_tanh``), in x's dtype. Torch ops on every backend."""
        f = x.shape[-1] // 2
        return F.gelu(x[..., :f], approximate="tanh") * x[..., f:]

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """The routed experts of a mixture-of-experts block in one fused kernel, or
        None when the backend has none (the model then runs its own grouped
        dispatch, :func:`tandem.engine.model.moe.fused_experts`).

        Args:
            x: ``[T, H]`` hidden states; w13: ``[E, 2I, H]`` stacked gate/up rows;
            w2: ``[E, H, I]``; topk_weights: ``[T, k]`` float32 routing weights;
            topk_ids: ``[T, k]`` int64 expert ids.

        Returns:
            ``[T, H]`` in ``x``'s dtype: ``sum_j w_tj * down_e(silu(gate_e(x_t)) *
            up_e(x_t))``, or None.
        """
        return None


# numpy has no bfloat16: gather 2-byte elements as int16 (a copy moves bits, not values).
_BITS_AS = {torch.bfloat16: torch.int16, torch.float16: torch.float16,
            torch.float32: torch.float32, torch.float8_e4m3fn: torch.uint8,
            torch.uint8: torch.uint8}


def gather_blocks_cpu(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` for a CPU cache ``[NB, BS, Hkv, D]`` -> ``[n, BS, Hkv, D]``.

    numpy's fancy indexing copies whole rows with memcpy; torch's CPU
    ``index_select`` is several times slower here (measured 1.4 ms vs 8 ms for
    2,560 bf16 blocks of 6 KiB on 2 cores).
    """
    nb = cache.shape[0]
    rows = cache.view(nb, -1).view(_BITS_AS[cache.dtype]).numpy()
    out = torch.from_numpy(rows[block_ids.numpy()])
    return out.view(cache.dtype).view(-1, *cache.shape[1:])


_DECODE_GROUP = 16   # sequences per padded group in CPU decode attention


def decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_seq_len: int, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """Paged decode attention for CPU tensors (see :func:`_decode_attention_group`);
    ``window`` (tokens) and ``softcap`` as in :meth:`AttentionBackend.attention`.

    Large batches are sorted by context length and cut into groups of
    ``_DECODE_GROUP`` sequences, each padded only to its own longest context, so
    short sequences do not pay for the longest one's padding. A quantized cache's
    gathered blocks are dequantized into the query's dtype (fp8 with
    ``k_scale``/``v_scale`` ``[Hkv]``; int4 with its rows' own parameters, the open
    last blocks' K from the store ``k_scale`` at the entries ``v_scale`` ``[B]``).
    """
    b = query.shape[0]
    if b <= _DECODE_GROUP:
        return _decode_attention_group(query, key_cache, value_cache, block_tables, seq_lens,
                                       scale, max_seq_len, k_scale, v_scale, window, softcap)
    lens = seq_lens.tolist()
    order = sorted(range(b), key=lens.__getitem__)
    out = torch.empty_like(query)
    per_seq = key_cache.dtype == torch.uint8 and v_scale is not None   # int4 store entries
    for start in range(0, b, _DECODE_GROUP):
        rows = order[start:start + _DECODE_GROUP]
        idx = torch.tensor(rows)
        out[idx] = _decode_attention_group(query[idx], key_cache, value_cache, block_tables[idx],
                                           seq_lens[idx], scale, max(lens[r] for r in rows),
                                           k_scale, v_scale[idx] if per_seq else v_scale,
                                           window, softcap)
    return out


def _decode_attention_group(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Paged decode attention for CPU tensors, same contract as
    :func:`tandem.kernels.reference.paged_decode_attention_ref` (``[B, Hq, D]``).

    Grouped-query attention as two dense batched matmuls: the gathered K/V stay in
    their cache layout ``[B, L, Hkv * D]`` and the queries are spread into a
    block-diagonal ``[B, Hq, Hkv * D]`` matrix (query head ``h`` only has entries
    in its KV head's ``D`` columns). That multiplies ``Hkv`` times more zeros than
    needed, but decode attention is bound by reading K/V, and contiguous bmm
    operands avoid the permute copies a per-head layout would need.
    """
    b, hq, d = query.shape   # an int4 cache's last dim is its row width, not D
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    g = hq // hkv
    nblk = (max_seq_len + bs - 1) // bs
    length = nblk * bs
    ids = block_tables[:, :nblk].reshape(-1).long()
    k = gather_blocks_cpu(key_cache, ids)
    v = gather_blocks_cpu(value_cache, ids)
    if key_cache.dtype == torch.uint8:
        full = int4_kv.full_blocks(seq_lens, nblk, bs).reshape(-1)
        k = int4_kv.dequantize_int4_blocks(k, d, full, True, query.dtype)
        k = int4_kv.overlay_open_keys(k.view(b, nblk, *k.shape[1:]), seq_lens, k_scale,
                                      v_scale)
        v = int4_kv.dequantize_int4_blocks(v, d, full, False, query.dtype)
    elif ref._check_scales(key_cache, k_scale, v_scale):
        k = ref.dequantize_fp8_e4m3_ref(k, k_scale, query.dtype)
        v = ref.dequantize_fp8_e4m3_ref(v, v_scale, query.dtype)
    k, v = k.view(b, length, hkv * d), v.view(b, length, hkv * d)
    q_bd = query.new_zeros(b, hkv, g, hkv, d)
    q_bd.diagonal(dim1=1, dim2=3).copy_(query.view(b, hkv, g, d).permute(0, 2, 3, 1))
    scores = torch.bmm(q_bd.view(b, hq, hkv * d), k.transpose(1, 2)).float()   # [B, Hq, L]
    scores *= scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(length)[None, :]
    pad = pos >= seq_lens[:, None].long()
    if window is not None:     # the query at seq_len - 1 sees the last `window` keys
        pad |= pos < seq_lens[:, None].long() - window
    scores.masked_fill_(pad[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    full = torch.bmm(probs, v)                                                 # [B, Hq, Hkv*D]
    out = full.view(b, hkv, g, hkv, d).diagonal(dim1=1, dim2=3)                # [B, G, D, Hkv]
    return out.permute(0, 3, 1, 2).reshape(b, hq, d)


class TorchAttentionBackend(AttentionBackend):
    """The CPU path: torch ops (the references of :mod:`tandem.kernels.reference`, and a
    faster equivalent for decode attention on CPU tensors). Reads a quantized (fp8
    or int4) cache by dequantizing the gathered blocks into the model dtype."""

    name = "torch"
    supports_sliding_window = True
    supports_logit_softcap = True
    _int4_token_rows = None      # the int4 per-token write; None: torch's (int4_kv)

    @staticmethod
    def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                k_scale=None, v_scale=None):
        return TorchAttentionBackend._torch_decode(query, key_cache, value_cache, block_tables,
                                                   seq_lens, scale, max_seq_len, k_scale,
                                                   v_scale)

    @staticmethod
    def _torch_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                      k_scale=None, v_scale=None, window=None, softcap=None):
        """Decode attention in torch ops (a soft-capped one on CPU tensors only)."""
        if query.device.type == "cpu":
            return decode_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens,
                                        scale, max_seq_len, k_scale, v_scale, window, softcap)
        return ref.paged_decode_attention_ref(query, key_cache, value_cache, block_tables,
                                              seq_lens, scale, max_seq_len, k_scale, v_scale,
                                              window)

    def _decode_windowed(self, query, key_cache, value_cache, block_tables, seq_lens, scale,
                         max_seq_len, k_scale=None, v_scale=None, window=None, softcap=None):
        """Decodes of a layer with a sliding ``window`` or a ``softcap``: torch ops."""
        return TorchAttentionBackend._torch_decode(query, key_cache, value_cache, block_tables,
                                                   seq_lens, scale, max_seq_len, k_scale,
                                                   v_scale, window, softcap)

    def attention(self, query, key, value, key_cache, value_cache, meta, scale,
                  k_scale=None, v_scale=None, *, window=None, softcap=None):
        if key_cache.dtype == torch.uint8:
            if meta.int4_plan is None or k_scale is None:
                raise ValueError("int4 KV cache: needs the step's write plan (meta.int4_plan) "
                                 "and the layer's open-block K store (k_scale)")
            int4_kv.reshape_and_cache_int4(key, value, key_cache, value_cache, meta.slot_mapping,
                                           k_scale, meta.int4_plan, self._int4_token_rows)
            return self.attend(query, key, value, key_cache, value_cache, meta, scale, k_scale,
                               meta.int4_plan.seq_open_entries, window=window, softcap=softcap)
        ref.reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping,
                                  k_scale, v_scale)
        return self.attend(query, key, value, key_cache, value_cache, meta, scale,
                           k_scale, v_scale, window=window, softcap=softcap)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None, *, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """:meth:`attention` after the cache write: decodes through :meth:`_decode`,
        each prefill chunk through a fused causal SDPA (its fresh K/V directly when
        nothing precedes the chunk, else its context gathered from the cache).

        A sliding ``window`` or a ``softcap`` (see :meth:`AttentionBackend.attention`):
        decodes through :meth:`_decode_windowed` (torch ops: :func:`decode_attention_cpu`
        on CPU; elsewhere the reference, or with ``softcap`` the per-sequence path;
        the ``cpu`` backend's compiled kernel for unquantized caches), prefill chunks
        through a masked SDPA or, soft-capped, explicit scores.

        With a quantized cache every chunk reads its K/V from the cache (dequantized),
        its own tokens' included: with fp8 a token's attention then sees the same K/V
        whether it is computed in the first chunk, a later chunk, after a prefix-
        cache hit or on another engine that received the blocks. With int4 a
        sequence's open last block's K comes from the store instead (exact; entries
        ``v_scale``), so what a token sees depends on whether the blocks before it
        were full when it was computed, as in KIVI."""
        nd = meta.num_decodes
        quantized = ref._check_scales(key_cache, k_scale, v_scale)
        plain = window is None and softcap is None
        if plain:
            decode = self._decode
        else:
            def decode(*args):
                return self._decode_windowed(*args, window, softcap)
            if softcap is not None and query.device.type != "cpu":
                nd = 0          # decodes too through the per-sequence path below
        if nd == meta.num_seqs:
            return decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                          scale, meta.max_seq_len, k_scale, v_scale)
        out = torch.empty_like(query)
        int4 = key_cache.dtype == torch.uint8 and v_scale is not None   # v_scale: entries
        if nd:
            out[:nd] = decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd],
                              meta.seq_lens[:nd], scale, max(meta.seq_lens_cpu[:nd]),
                              k_scale, v_scale[:nd] if int4 else v_scale)
        qsl = meta.query_start_loc_cpu
        hq, hkv = query.shape[1], key.shape[1]
        for i in range(nd, meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_cpu[i]
            q = query[start:end].transpose(0, 1)
            if q_len == seq_len and not quantized:
                # Nothing cached before this chunk: attend to the fresh K/V directly.
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                k = ref._gather_kv(key_cache, meta.block_tables[i], seq_len, k_scale,
                                   query.dtype, query.shape[2],
                                   open_entry=int(v_scale[i]) if int4 else -1).transpose(0, 1)
                v = ref._gather_kv(value_cache, meta.block_tables[i], seq_len, v_scale,
                                   query.dtype, query.shape[2], is_key=False).transpose(0, 1)
            if softcap is None:
                o = ref._causal_sdpa(q, k, v, scale, hq != hkv, window)
            else:
                o = softcapped_attention(q, k, v, scale, softcap, window)
            out[start:end] = o.transpose(0, 1)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        return ref.rms_norm_ref(x, weight, eps, residual)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        return ref.rotary_embedding_ref(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x):
        return ref.silu_and_mul_ref(x)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         softcap: float, window: int | None = None) -> torch.Tensor:
    """Causal attention with soft-capped logits (Gemma 2), as transformers' eager
    attention computes it: scores ``q k^T * scale`` in q's dtype, then
    ``softcap * tanh(scores / softcap)``, the causal (and ``window``) mask, a float32
    softmax rounded to q's dtype, times V.

    Args:
        q: ``[Hq, q_len, D]``, the last ``q_len`` positions of k/v ``[Hkv, S, D]``.
        scale: softmax scale; softcap: the cap (> 0); window: see
            :func:`tandem.kernels.reference.attention_mask`.

    Returns:
        ``[Hq, q_len, D]``.
    """
    hq, hkv = q.shape[0], k.shape[0]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale          # [Hq, q_len, S]
    scores = torch.tanh(scores / softcap) * softcap
    hidden = ref.attention_mask(q.shape[1], k.shape[1], window, q.device)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def default_scale(head_dim: int) -> float:
    """Softmax scale ``1 / sqrt(head_dim)`` of scaled dot-product attention."""
    return 1.0 / math.sqrt(head_dim)
