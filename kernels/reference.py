"""Pure-torch reference of every hot operation of the model.

These are the CPU path of the engine and the ground truth that each Triton kernel
in this package is tested against. Shapes use:

    T   packed tokens of a batch (sequences concatenated along dim 0)
    B   sequences in the batch
    Hq  query heads, Hkv key/value heads (GQA: Hq % Hkv == 0)
    D   head dim
    NB  blocks in the KV cache, BS block size (tokens per block)

KV cache layout (one layer): ``key_cache`` and ``value_cache`` are each
``[NB, BS, Hkv, D]``; token ``t`` of a sequence lives in block
``block_table[t // BS]`` at offset ``t % BS``. A *slot* is
``block_id * BS + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V into the paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, same dtype as key/value.
        slot_mapping: ``[T]`` int64 slot of each token (``block_id * BS + offset``).
    """
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    key_cache.view(nb * bs, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(nb * bs, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens, Hkv, D]`` of one sequence, read through its block table."""
    bs = cache.shape[1]
    nblk = (num_tokens + bs - 1) // bs
    return cache[block_table[:nblk].long()].flatten(0, 1)[:num_tokens]


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int32 block ids (rows may be padded).
        seq_lens: ``[B]`` int32 context length of each sequence, including the
            query token (its K/V must already be in the cache).
        scale: softmax scale, usually ``D ** -0.5``.
        max_seq_len: ``max(seq_lens)`` if the caller knows it (saves a sync).

    Returns:
        ``[B, Hq, D]`` in the query's dtype (accumulated in float32).
    """
    b, hq, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    nblk = (max_seq_len + bs - 1) // bs
    table = block_tables[:, :nblk].long()
    # [B, nblk*BS, Hkv, D] -> [B, Hkv, L, D]
    k = key_cache[table].flatten(1, 2).transpose(1, 2)
    v = value_cache[table].flatten(1, 2).transpose(1, 2)
    length = k.shape[2]
    mask = torch.arange(length, device=query.device)[None, :] < seq_lens[:, None].long()
    q = query.view(b, hq, 1, d)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=(hq != hkv))
    return out.view(b, hq, d)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: list[int], seq_lens: list[int],
                                scale: float) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks over paged KV.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
    (``q_len`` tokens), which are the *last* ``q_len`` of its ``seq_lens[i]``
    context tokens; the first ``seq_lens[i] - q_len`` come from the cache (a cached
    prefix or earlier chunks of a chunked prefill). All K/V, the new tokens'
    included, must already be in the cache.

    Args:
        query: ``[T, Hq, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``B + 1`` host ints, cumulative query lengths.
        seq_lens: ``B`` host ints, context lengths after this step.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]``.
    """
    hq, hkv = query.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        k = _gather_kv(key_cache, block_tables[i], seq_len).transpose(0, 1)   # [Hkv, S, D]
        v = _gather_kv(value_cache, block_tables[i], seq_len).transpose(0, 1)
        q = query[start:end].transpose(0, 1)                                   # [Hq, q_len, D]
        out[start:end] = _causal_sdpa(q, k, v, scale, hq != hkv).transpose(0, 1)
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 gqa: bool) -> torch.Tensor:
    """q ``[H, q_len, D]`` are the last q_len positions of k/v ``[Hkv, S, D]``.

    Inputs go to SDPA as 4-D tensors with an additive float mask: on CPU that
    selects the fused flash kernel, while 3-D inputs or a boolean mask fall back
    to the unfused math path (measured 5x slower for 1,500 tokens).
    """
    q_len, s = q.shape[1], k.shape[1]
    q4, k4, v4 = q[None], k[None], v[None]
    if q_len == s:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[0]
    # Query j sits at position (s - q_len + j) and sees keys 0..that position.
    pos = torch.arange(s - q_len, s, device=q.device)[:, None]
    hidden = torch.arange(s, device=q.device)[None, :] > pos
    mask = torch.zeros(q_len, s, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019), optionally with a fused residual add.

    Args:
        x: ``[T, H]``; weight: ``[H]``.
        residual: ``[T, H]`` or None. If given, ``x + residual`` is normalised and
            also returned as the new residual.

    Returns:
        ``y`` ``[T, H]`` in x's dtype, or ``(y, x + residual)``. Computed in float32.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * weight.float()).to(x.dtype)
    return y if residual is None else (y, residual)


def rope_cos_sin_cache(head_dim: int, max_position: int, base: float,
                       dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """``[max_position, head_dim]``: cos of the ``head_dim/2`` frequencies, then sin.

    Frequencies ``base ** (-2i / head_dim)`` (RoFormer, Su et al. 2021, eq. 15).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                               .float() / head_dim))
    t = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place, half-split (NeoX / Hugging Face Llama) layout.

    Args:
        positions: ``[T]`` int64 token positions.
        query: ``[T, Hq, D]``; key: ``[T, Hkv, D]``.
        cos_sin_cache: ``[max_position, D]`` from :func:`rope_cos_sin_cache`.

    Returns:
        ``(query, key)``, the same tensors, rotated.
    """
    half = query.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = cs[:, None, :half].float()
    sin = cs[:, None, half:].float()
    for x in (query, key):
        x1 = x[..., :half].float()
        x2 = x[..., half:].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        x.copy_(torch.cat([o1, o2], dim=-1).to(x.dtype))
    return query, key


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer 2020): ``x`` ``[T, 2F]`` = [gate | up] -> ``silu(gate) * up`` ``[T, F]``."""
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]
