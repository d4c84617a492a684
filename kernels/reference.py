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

FP8 KV cache (``kv_cache_dtype fp8_e4m3``): the caches may be
``torch.float8_e4m3fn`` with float32 scales ``k_scale``, ``v_scale`` ``[Hkv]`` per
KV head; an element is stored as ``e4m3(clamp(x / scale[h], +-448))`` and read
back as ``scale[h] * value``. Every function below takes the scales as optional
arguments and requires them with an fp8 cache.

Int4 KV cache (``kv_cache_dtype int4``): the caches are ``uint8 [NB, BS, Hkv, R]``
packed rows (format and write path in :mod:`tandem.kernels.int4_kv`, after KIVI);
the functions below read them (K per channel in full blocks, per token in the
last, open one; V per token) and take no scales for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import int4_kv


FP8_E4M3_MAX = 448.0
"""Largest finite ``torch.float8_e4m3fn`` value."""


def quantize_fp8_e4m3_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., Hkv, D]`` (any float dtype) -> ``float8_e4m3fn`` of the same shape:
    ``clamp(x.float() / scale[h], -448, 448)`` rounded to nearest even.

    Args:
        scale: ``[Hkv]`` float32, > 0.
    """
    q = x.float() / scale.to(device=x.device, dtype=torch.float32)[:, None]
    return q.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8_e4m3_ref(x: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """``float8_e4m3fn`` ``x`` ``[..., Hkv, D]`` -> ``scale[h] * x`` in ``dtype``
    (computed in float32, then rounded once)."""
    return (x.float() * scale.to(device=x.device, dtype=torch.float32)[:, None]).to(dtype)


def _check_scales(cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Whether ``cache`` is quantized (fp8, or int4 rows: ``uint8``, which need no
    scales); raises ValueError for an fp8 cache without scales."""
    if cache.dtype == torch.uint8:
        return True
    if cache.dtype != torch.float8_e4m3fn:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale/v_scale: required with a float8_e4m3fn KV cache")
    return True


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
    """Write new K/V into the paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, same dtype as key/value, or
            ``torch.float8_e4m3fn`` (K/V quantized by :func:`quantize_fp8_e4m3_ref`).
        slot_mapping: ``[T]`` int64 slot of each token (``block_id * BS + offset``).
        k_scale, v_scale: ``[Hkv]`` float32 scales of an fp8 cache.

    Raises:
        ValueError: an fp8 cache without scales.
    """
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    if key_cache.dtype == torch.uint8:
        raise ValueError("key_cache: an int4 cache is written by "
                         "tandem.kernels.int4_kv.reshape_and_cache_int4 (with the step's plan)")
    if _check_scales(key_cache, k_scale, v_scale):
        # torch has no index_copy_ for float8 on the CPU: move the bytes.
        key = quantize_fp8_e4m3_ref(key, k_scale).view(torch.uint8)
        value = quantize_fp8_e4m3_ref(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(nb * bs, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(nb * bs, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
               scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               head_dim: int | None = None, is_key: bool = True,
               open_entry: int = -1) -> torch.Tensor:
    """``[num_tokens, Hkv, D]`` of one sequence, read through its block table; an
    fp8 cache is dequantized with ``scale`` ``[Hkv]`` into ``dtype``, an int4 one
    (``head_dim`` channels; K when ``is_key``) with its rows' own parameters, its
    open last block's K taken from entry ``open_entry`` of the store ``scale``."""
    bs = cache.shape[1]
    nblk = (num_tokens + bs - 1) // bs
    blocks = cache[block_table[:nblk].long()]
    if cache.dtype == torch.uint8:
        lens = torch.tensor([num_tokens])
        full = int4_kv.full_blocks(lens, nblk, bs)[0]
        blocks = int4_kv.dequantize_int4_blocks(blocks, head_dim, full, is_key, dtype)
        if is_key and open_entry >= 0:
            blocks = int4_kv.overlay_open_keys(blocks[None], lens, scale,
                                               torch.tensor([open_entry]))[0]
    out = blocks.flatten(0, 1)[:num_tokens]
    if cache.dtype == torch.float8_e4m3fn:
        out = dequantize_fp8_e4m3_ref(out, scale, dtype)
    return out


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               max_seq_len: int | None = None,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None,
                               window: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int32 block ids (rows may be padded).
        seq_lens: ``[B]`` int32 context length of each sequence, including the
            query token (its K/V must already be in the cache).
        scale: softmax scale, usually ``D ** -0.5``.
        max_seq_len: ``max(seq_lens)`` if the caller knows it (saves a sync).
        k_scale, v_scale: ``[Hkv]`` float32 scales of a ``float8_e4m3fn`` cache,
            whose gathered blocks are dequantized into the query's dtype; for an
            int4 ``uint8 [NB, BS, Hkv, R]`` cache the open-block K store and the
            sequences' entries, or None (see :mod:`tandem.kernels.int4_kv`).
        window: sliding-window attention: the query (at position ``seq_len - 1``)
            sees only the last ``window`` tokens (keys at positions ``> seq_len - 1 -
            window``, transformers' ``sliding_window``); None: the whole context.

    Returns:
        ``[B, Hq, D]`` in the query's dtype (accumulated in float32).

    Raises:
        ValueError: an fp8 cache without scales.
    """
    b, hq, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    nblk = (max_seq_len + bs - 1) // bs
    table = block_tables[:, :nblk].long()
    # [B, nblk*BS, Hkv, D] -> [B, Hkv, L, D]
    if key_cache.dtype == torch.uint8:
        full = int4_kv.full_blocks(seq_lens, nblk, bs)
        k = int4_kv.dequantize_int4_blocks(key_cache[table], d, full, True, query.dtype)
        k = int4_kv.overlay_open_keys(k, seq_lens, k_scale, v_scale)
        v = int4_kv.dequantize_int4_blocks(value_cache[table], d, full, False, query.dtype)
        k, v = k.flatten(1, 2), v.flatten(1, 2)
    else:
        k = key_cache[table].flatten(1, 2)
        v = value_cache[table].flatten(1, 2)
        if _check_scales(key_cache, k_scale, v_scale):
            k = dequantize_fp8_e4m3_ref(k, k_scale, query.dtype)
            v = dequantize_fp8_e4m3_ref(v, v_scale, query.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    length = k.shape[2]
    pos = torch.arange(length, device=query.device)[None, :]
    mask = pos < seq_lens[:, None].long()
    if window is not None:
        mask &= pos >= seq_lens[:, None].long() - window
    q = query.view(b, hq, 1, d)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=(hq != hkv))
    return out.view(b, hq, d)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: list[int], seq_lens: list[int],
                                scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None,
                                window: int | None = None) -> torch.Tensor:
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
        k_scale, v_scale: ``[Hkv]`` float32 scales of a ``float8_e4m3fn`` cache; for
            an int4 cache the open-block K store and the sequences' entries, or None.
        window: sliding-window attention (tokens): a query at position ``p`` sees
            keys at positions ``p - window + 1 .. p``; None: ``0 .. p``.

    Returns:
        ``[T, Hq, D]``.

    Raises:
        ValueError: an fp8 cache without scales.
    """
    hq, hkv = query.shape[1], key_cache.shape[2]
    _check_scales(key_cache, k_scale, v_scale)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        d = query.shape[2]
        entry = -1 if key_cache.dtype != torch.uint8 or v_scale is None else int(v_scale[i])
        k = _gather_kv(key_cache, block_tables[i], seq_len, k_scale, query.dtype,
                       d, open_entry=entry).transpose(0, 1)                    # [Hkv, S, D]
        v = _gather_kv(value_cache, block_tables[i], seq_len, v_scale, query.dtype, d,
                       is_key=False).transpose(0, 1)
        q = query[start:end].transpose(0, 1)                                   # [Hq, q_len, D]
        out[start:end] = _causal_sdpa(q, k, v, scale, hq != hkv, window).transpose(0, 1)
    return out


def attention_mask(q_len: int, s: int, window: int | None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``[q_len, S]`` bool, True where a key is hidden: queries at positions
    ``S - q_len .. S - 1`` see keys at positions up to their own, and with a
    ``window`` (tokens) only the last ``window`` of those (key ``j`` visible to the
    query at ``p`` iff ``p - window < j <= p``, as transformers' sliding window)."""
    pos = torch.arange(s - q_len, s, device=device)[:, None]
    keys = torch.arange(s, device=device)[None, :]
    hidden = keys > pos
    if window is not None:
        hidden |= keys <= pos - window
    return hidden


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 gqa: bool, window: int | None = None) -> torch.Tensor:
    """q ``[H, q_len, D]`` are the last q_len positions of k/v ``[Hkv, S, D]``;
    ``window``: see :func:`attention_mask`.

    Inputs go to SDPA as 4-D tensors with an additive float mask: on CPU that
    selects the fused flash kernel, while 3-D inputs or a boolean mask fall back
    to the unfused math path (measured 5x slower for 1,500 tokens).
    """
    q_len, s = q.shape[1], k.shape[1]
    if window is not None and s - q_len - window + 1 > 0:
        # Keys older than the first query's window are hidden from every query.
        lo = s - q_len - window + 1
        k, v, s = k[:, lo:], v[:, lo:], s - lo
    q4, k4, v4 = q[None], k[None], v[None]
    if q_len == s and (window is None or window >= s):
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[0]
    # Query j sits at position (s - q_len + j) and sees keys 0..that position.
    hidden = attention_mask(q_len, s, window, q.device)
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


# --- GGUF quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) ------------
#
# A quantized weight stays in GGUF's own bytes: ``qweight`` is uint8
# ``[N, row_bytes]``, one row per output feature (row-major ``[out, in]``), each row
# ``K / QB`` consecutive blocks of ``QB`` weights. Per block, little-endian:
#
#     Q4_0   32 w   18 bytes  fp16 d, 16 qs                  w_j = (q_j - 8) * d
#     Q4_1   32 w   20 bytes  fp16 d, fp16 m, 16 qs          w_j = q_j * d + m
#     Q5_0   32 w   22 bytes  fp16 d, u32 qh, 16 qs          w_j = (q_j + 16 h_j - 16) * d
#     Q5_1   32 w   24 bytes  fp16 d, fp16 m, u32 qh, 16 qs  w_j = (q_j + 16 h_j) * d + m
#     Q8_0   32 w   34 bytes  fp16 d, 32 int8 qs             w_j = qs[j] * d
#
# where for the 4- and 5-bit types q_j = qs[j] & 0xF for j < 16 and qs[j - 16] >> 4
# for j >= 16 (low nibbles hold the first half of the block, high nibbles the
# second) and h_j is bit j of qh. The K-quants (super-blocks of 256 weights):
#
#     Q4_K  256 w  144 bytes  fp16 d, fp16 dmin, 12 bytes scales, 128 qs
#         8 sub-blocks s of 32 weights, w = d * sc_s * q - dmin * m_s, q in 0..15;
#         sub-blocks 2i, 2i + 1 are the low and high nibbles of qs[32i : 32i + 32];
#         sc_s, m_s 6-bit: for s < 4 the low 6 bits of scales[s], scales[s + 4]; for
#         s >= 4 the nibbles of scales[s + 4] with the top 2 bits of scales[s - 4],
#         scales[s] above them.
#     Q6_K  256 w  210 bytes  128 ql, 64 qh, 16 int8 scales, fp16 d
#         16 sub-blocks of 16 weights, w = d * sc_(j / 16) * (q_j - 32), q in 0..63;
#         weight 128h + 32p + l: low 4 bits in ql[64h + 32(p % 2) + l] (high nibble
#         for p >= 2), high 2 bits at bit 2p of qh[32h + l].
#
# (ggml's block_q4_0 ... block_q6_K; llama.cpp PR #1684 for the K-quants.) And
# Tandem's own block for GPTQ / AWQ int4 weights (not a ggml type, see
# engine/quantization/int4_packed.py):
#
#     INT4_ZP 32 w   19 bytes  fp16 s, u8 zero z, 16 qs       w_j = (q_j - z) * s

# ggml type id (``gguf.GGMLQuantizationType``) -> (weights per block, bytes per block).
GGUF_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    2: (32, 18),    # Q4_0
    3: (32, 20),    # Q4_1
    6: (32, 22),    # Q5_0
    7: (32, 24),    # Q5_1
    8: (32, 34),    # Q8_0
    12: (256, 144),  # Q4_K
    14: (256, 210),  # Q6_K
}
INT4_ZP = 1001
#: Every block type the kernels read: the ggml ones and :data:`INT4_ZP`.
PACKED_BLOCK_SIZES: dict[int, tuple[int, int]] = {**GGUF_BLOCK_SIZES, INT4_ZP: (32, 19)}
GGUF_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K",
                   INT4_ZP: "INT4_ZP"}
_GGUF_Q4_0, _GGUF_Q4_1, _GGUF_Q5_0, _GGUF_Q5_1, _GGUF_Q8_0 = 2, 3, 6, 7, 8
_GGUF_Q4_K, _GGUF_Q6_K = 12, 14


def check_gguf_weight(qweight: torch.Tensor, qtype: int, in_features: int) -> tuple[int, int]:
    """Validate a packed GGUF weight; returns ``(N, row_bytes)``.

    Raises:
        ValueError: ``qtype`` not a key of :data:`PACKED_BLOCK_SIZES`, ``in_features``
            not a positive multiple of the block's weights (32, or 256 for the
            K-quants), ``qweight`` not a 2-D uint8 tensor of ``in_features /
            weights_per_block * bytes_per_block`` columns.
    """
    if isinstance(qtype, bool) or not isinstance(qtype, int) or qtype not in PACKED_BLOCK_SIZES:
        raise ValueError(f"qtype: {qtype!r} not supported, expected one of "
                         f"{sorted(PACKED_BLOCK_SIZES)} "
                         f"({', '.join(GGUF_TYPE_NAMES[t] for t in sorted(PACKED_BLOCK_SIZES))})")
    block_weights, block_bytes = PACKED_BLOCK_SIZES[qtype]
    if isinstance(in_features, bool) or not isinstance(in_features, int) \
            or in_features <= 0 or in_features % block_weights:
        raise ValueError(f"in_features: {in_features!r} is not a positive multiple of "
                         f"{block_weights}")
    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight: dtype {qweight.dtype}, expected torch.uint8 (GGUF bytes)")
    row_bytes = in_features // block_weights * block_bytes
    if qweight.dim() != 2 or qweight.shape[1] != row_bytes:
        raise ValueError(f"qweight: expected shape [N, {row_bytes}] ({in_features // block_weights}"
                         f" blocks of {block_bytes} bytes per row), got {tuple(qweight.shape)}")
    return qweight.shape[0], row_bytes


def _fp16_from_bytes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float32 value of the little-endian fp16 whose bytes are ``lo``, ``hi`` (uint8)."""
    bits = lo.to(torch.int32) | (hi.to(torch.int32) << 8)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def _u32_bits(b: torch.Tensor) -> torch.Tensor:
    """The 32 bits (0/1, int64 ``[..., 32]``, bit 0 first) of the little-endian u32 in
    the last dim's 4 bytes ``b`` (uint8 ``[..., 4]``)."""
    v = (b[..., 0].to(torch.int64) | (b[..., 1].to(torch.int64) << 8)
         | (b[..., 2].to(torch.int64) << 16) | (b[..., 3].to(torch.int64) << 24))
    return (v[..., None] >> torch.arange(32, device=b.device)) & 1


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., 144]`` uint8 Q4_K blocks -> float32 ``[..., 256]``."""
    d = _fp16_from_bytes(blocks[..., 0], blocks[..., 1])[..., None]
    dmin = _fp16_from_bytes(blocks[..., 2], blocks[..., 3])[..., None]
    lo, mid, hi = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1).to(torch.float32)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1).to(torch.float32)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    w = (d * sc)[..., None] * q.to(torch.float32) - (dmin * mn)[..., None]
    return w.reshape(*blocks.shape[:-1], 256)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., 210]`` uint8 Q6_K blocks -> float32 ``[..., 256]``."""
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 2, 32)                 # [half, p % 2, l]
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)                    # [half, p, l]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = (qh >> shifts.reshape(4, 1)) & 3                          # [half, p, l]
    q = (low | (high << 4)).to(torch.float32) - 32.0
    sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _fp16_from_bytes(blocks[..., 208], blocks[..., 209])[..., None]
    w = (d * sc)[..., None] * q.reshape(*lead, 16, 16)
    return w.reshape(*lead, 256)


def dequantize_gguf_reference(qweight: torch.Tensor, qtype: int, in_features: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack a weight of a type in :data:`PACKED_BLOCK_SIZES` (pure torch, any device).

    Computed in float32 with the operations of ``gguf.quants.dequantize`` (so the
    float32 result equals it bit for bit; INT4_ZP: ``(q - z) * s``, exact), then cast
    to ``dtype``.

    Args:
        qweight: ``[N, row_bytes]`` uint8, GGUF blocks (layout above).
        qtype: a key of :data:`PACKED_BLOCK_SIZES` (a ggml type id, or :data:`INT4_ZP`).
        in_features: ``K``, weights per row, a multiple of the block's weights.
        dtype: dtype of the result.

    Returns:
        ``[N, K]`` in ``dtype`` on qweight's device.

    Raises:
        ValueError: see :func:`check_gguf_weight`.
    """
    n, _ = check_gguf_weight(qweight, qtype, in_features)
    block_weights, block_bytes = PACKED_BLOCK_SIZES[qtype]
    blocks = qweight.reshape(n, in_features // block_weights, block_bytes)
    if qtype == INT4_ZP:
        s = _fp16_from_bytes(blocks[..., 0], blocks[..., 1])[..., None]
        z = blocks[..., 2:3].to(torch.float32)
        qs = blocks[..., 3:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)
        return ((q - z) * s).reshape(n, in_features).to(dtype)
    if qtype == _GGUF_Q4_K:
        return _dequantize_q4_k(blocks).reshape(n, in_features).to(dtype)
    if qtype == _GGUF_Q6_K:
        return _dequantize_q6_k(blocks).reshape(n, in_features).to(dtype)
    d = _fp16_from_bytes(blocks[..., 0], blocks[..., 1])[..., None]
    if qtype == _GGUF_Q8_0:
        w = blocks[..., 2:].view(torch.int8).to(torch.float32) * d
    else:
        has_min = qtype in (_GGUF_Q4_1, _GGUF_Q5_1)
        five = qtype in (_GGUF_Q5_0, _GGUF_Q5_1)
        start = 2 + 2 * has_min
        qs = blocks[..., start + 4 * five:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.int64)
        if five:
            q = q | (_u32_bits(blocks[..., start:start + 4]) << 4)
        q = q.to(torch.float32)
        if has_min:
            w = q * d + _fp16_from_bytes(blocks[..., 2], blocks[..., 3])[..., None]
        else:
            w = (q - (16.0 if five else 8.0)) * d
    return w.reshape(n, in_features).to(dtype)


def gguf_linear_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                          in_features: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` the dequantized GGUF weight, accumulated in float32.

    Args:
        x: ``[M, K]`` float32 / float16 / bfloat16.
        qweight, qtype, in_features: as :func:`dequantize_gguf_reference`.

    Returns:
        ``[M, N]`` in x's dtype (``(x.float() @ W.T).to(x.dtype)``).

    Raises:
        ValueError: a bad weight (see :func:`check_gguf_weight`), or ``x`` not
            ``[M, in_features]``.
    """
    w = dequantize_gguf_reference(qweight, qtype, in_features)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x: expected shape [M, {in_features}], got {tuple(x.shape)}")
    return (x.float() @ w.T).to(x.dtype)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """Int8 activation blocks of 32 values (llama.cpp's Q8_0, the scale in float32).

    Per 32-value chunk: ``d = max |x| / 127``, codes ``round_half_even(x * (1 / d))``
    (zero where ``d`` is 0), each step one float32 operation.

    Args:
        x: ``[M, K]``, ``K`` a multiple of 32 (computed in float32).

    Returns:
        ``(codes int8 [M, K], d float32 [M, K / 32], d * sum(codes) float32 [M, K / 32])``.

    Raises:
        ValueError: ``x`` not ``[M, K]`` with ``K`` a multiple of 32.
    """
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"x: expected [M, K] with K a multiple of 32, got {tuple(x.shape)}")
    m, k = x.shape
    chunks = x.float().reshape(m, k // 32, 32)
    d = chunks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    codes = torch.round(chunks * inv[..., None]).clamp(-127, 127)
    dsum = d * codes.sum(dim=-1)
    return codes.to(torch.int8).reshape(m, k), d, dsum


def gguf_linear_int8_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                               in_features: int) -> torch.Tensor:
    """``x~ @ W.T`` with ``x~`` the int8 activation blocks of ``x``
    (:func:`quantize_activations_reference`) and ``W`` the dequantized weight,
    accumulated in float64: what the CPU kernel's ``activations="int8"`` computes,
    up to its float32 rounding.

    Args:
        x: ``[M, K]`` float32 / bfloat16.
        qweight, qtype, in_features: as :func:`dequantize_gguf_reference`.

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: as :func:`gguf_linear_reference`.
    """
    w = dequantize_gguf_reference(qweight, qtype, in_features)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x: expected shape [M, {in_features}], got {tuple(x.shape)}")
    codes, d, _ = quantize_activations_reference(x)
    m = x.shape[0]
    xq = (codes.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, in_features)
    return (xq @ w.double().T).to(x.dtype)
