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

Int4 KV cache (``kv_cache_dtype int4``): the caches are ``torch.uint8``
``[NB, BS, Hkv, R]``, one packed row of ``R = D / 2 + 4 * D / G`` bytes per (token,
KV head), ``G = gcd(D, 32)`` channels per group (``R = 40`` for ``D = 64``);
``k_scale`` and ``v_scale`` are float32 *channel* scales ``[Hkv, D]`` (static,
calibrated at start; all ones for V). See :func:`quantize_int4_kv_ref` for the row
format. The scheme follows KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric
2bit Quantization for KV Cache", sec. 3): K is treated per channel (its outliers
sit in fixed channels), V per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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


INT4_KV_MAX_GROUP = 32
"""Largest group of channels sharing one int4 step and minimum (KIVI's group size)."""


def int4_kv_group_size(head_dim: int) -> int:
    """Channels per quantization group of an int4 KV row: ``gcd(head_dim, 32)``.

    Raises:
        ValueError: ``head_dim`` not a positive multiple of 8 (groups of at
            least 8 channels keep the fp16 parameters under a third of the row).
    """
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"head_dim: an int4 KV cache needs a multiple of 8, got {head_dim}")
    return math.gcd(head_dim, INT4_KV_MAX_GROUP)


def int4_kv_row_bytes(head_dim: int) -> int:
    """Bytes of one packed int4 KV row for ``head_dim`` elements: ``D / 2`` bytes of
    nibbles and 4 bytes (fp16 step, fp16 minimum) per group of
    :func:`int4_kv_group_size` channels; 40 for ``D = 64``.

    Raises:
        ValueError: see :func:`int4_kv_group_size`.
    """
    return head_dim // 2 + 4 * (head_dim // int4_kv_group_size(head_dim))


def quantize_int4_kv_ref(x: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., Hkv, D]`` (any float dtype) -> packed rows ``uint8 [..., Hkv, R]``
    with ``R =`` :func:`int4_kv_row_bytes` ``(D)``.

    Each row is first divided by its static channel scales,
    ``y = x / channel_scale[h]`` (float32), then cut into groups of ``G =``
    :func:`int4_kv_group_size` ``(D)`` channels, each quantized asymmetrically
    to 4 bits over its own range: with ``lo = fp16(min(y_g))`` and
    ``step = fp16((max(y_g) - lo) / 15)``, ``q = clamp(round((y - lo) / step), 0, 15)``
    (round half to even; ``q = 0`` where ``step`` is 0). Row bytes: ``D / 2`` bytes
    of nibbles (element ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the
    high one), then ``(step, lo)`` of each group as little-endian fp16. Read back
    by :func:`dequantize_int4_kv_ref` as ``(q * step + lo) * channel_scale``.

    With ``channel_scale`` the calibrated per-channel maxima of K (see
    :mod:`tandem.engine.runtime.kv_scales`), K's outlier channels are scaled down
    before the per-token groups are formed, so they do not stretch the step of
    the channels beside them: the per-channel treatment of K of KIVI (Liu et al.
    2024, sec. 3.2), with static channel statistics (as KVQuant, Hooper et al.
    2024, sec. 3.1) instead of groups of tokens, which keeps every token's row
    self-contained. V uses unit channel scales: per-token groups, as in KIVI.

    Args:
        channel_scale: ``[Hkv, D]`` float32, > 0.

    Raises:
        ValueError: ``D`` not a multiple of 8, or ``channel_scale`` of another shape.
    """
    d = x.shape[-1]
    g = int4_kv_group_size(d)
    if tuple(channel_scale.shape) != tuple(x.shape[-2:]):
        raise ValueError(f"channel_scale: expected shape {tuple(x.shape[-2:])}, "
                         f"got {tuple(channel_scale.shape)}")
    y = x.float() / channel_scale.to(device=x.device, dtype=torch.float32)
    y = y.unflatten(-1, (d // g, g))                                    # [..., Hkv, D/G, G]
    lo = y.amin(dim=-1, keepdim=True).to(torch.float16)
    step = ((y.amax(dim=-1, keepdim=True) - lo.float()) / 15).to(torch.float16)
    step_f = step.float()
    inv = torch.where(step_f > 0, 1.0 / step_f, torch.zeros_like(step_f))
    q = torch.round((y - lo.float()) * inv).clamp_(0, 15).to(torch.uint8).flatten(-2)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    params = torch.cat([step, lo], dim=-1).flatten(-2)                 # [..., Hkv, 2 D/G] fp16
    return torch.cat([packed, params.view(torch.uint8)], dim=-1)


def dequantize_int4_kv_ref(rows: torch.Tensor, channel_scale: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """Packed rows ``uint8 [..., Hkv, R]`` (see :func:`quantize_int4_kv_ref`)
    -> ``(q * step + lo) * channel_scale[h]`` ``[..., Hkv, D]`` in ``dtype``
    (computed in float32, then rounded once); ``D`` is ``channel_scale``'s last dim.

    Raises:
        ValueError: ``R`` is not the row width of ``D`` channels.
    """
    d = channel_scale.shape[-1]
    g = int4_kv_group_size(d)
    if rows.shape[-1] != int4_kv_row_bytes(d):
        raise ValueError(f"rows: {d} channels take {int4_kv_row_bytes(d)} bytes, "
                         f"got rows of {rows.shape[-1]}")
    packed = rows[..., :d // 2]
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()
    params = rows[..., d // 2:].contiguous().view(torch.float16).float()
    params = params.unflatten(-1, (d // g, 2))                          # [..., Hkv, D/G, 2]
    y = q.unflatten(-1, (d // g, g)) * params[..., :1] + params[..., 1:]
    return (y.flatten(-2) * channel_scale.to(device=rows.device, dtype=torch.float32)).to(dtype)


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype
                    ) -> torch.Tensor:
    """K or V ``[..., Hkv, D]`` -> what a cache of ``cache_dtype`` stores, as bytes:
    ``uint8 [..., Hkv, D]`` for fp8, ``uint8 [..., Hkv, R]`` rows for int4."""
    if cache_dtype == torch.float8_e4m3fn:
        return quantize_fp8_e4m3_ref(x, scale).view(torch.uint8)
    return quantize_int4_kv_ref(x, scale)


def dequantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries read from a quantized cache (fp8 ``[..., Hkv, D]`` with ``scale`` ``[Hkv]``,
    or int4 rows ``uint8 [..., Hkv, R]`` with ``scale`` ``[Hkv, D]``) ->
    ``[..., Hkv, D]`` in ``dtype``."""
    if x.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_e4m3_ref(x, scale, dtype)
    return dequantize_int4_kv_ref(x, scale, dtype)


def _check_scales(cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Whether ``cache`` is quantized (fp8 or int4).

    Raises:
        ValueError: a quantized cache without scales, or an int4 cache whose
            scales are not ``[Hkv, D]`` channel scales.
    """
    if cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"k_scale/v_scale: required with a {str(cache.dtype)[6:]} KV cache")
    if cache.dtype == torch.uint8:
        hkv, row = cache.shape[-2], cache.shape[-1]
        for s in (k_scale, v_scale):
            if s.dim() != 2 or s.shape[0] != hkv or s.shape[1] % 8 \
                    or int4_kv_row_bytes(s.shape[1]) != row or s.shape != k_scale.shape:
                raise ValueError(f"k_scale/v_scale: an int4 KV cache with {hkv} heads and "
                                 f"rows of {row} bytes needs [Hkv, D] channel scales, got "
                                 f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    return True


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
    """Write new K/V into the paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, same dtype as key/value, or
            ``torch.float8_e4m3fn`` (K/V quantized by :func:`quantize_fp8_e4m3_ref`),
            or ``uint8 [NB, BS, Hkv, R]`` (int4, :func:`quantize_int4_kv_ref`).
        slot_mapping: ``[T]`` int64 slot of each token (``block_id * BS + offset``).
        k_scale, v_scale: ``[Hkv]`` float32 scales of an fp8 cache, ``[Hkv, D]``
            channel scales of an int4 one.

    Raises:
        ValueError: a quantized cache without (or with misshapen) scales.
    """
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    if _check_scales(key_cache, k_scale, v_scale):
        # torch has no index_copy_ for float8 on the CPU: move the bytes.
        key = quantize_kv_ref(key, k_scale, key_cache.dtype)
        value = quantize_kv_ref(value, v_scale, value_cache.dtype)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(nb * bs, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(nb * bs, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int,
               scale: torch.Tensor | None = None, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``[num_tokens, Hkv, D]`` of one sequence, read through its block table; a
    quantized (fp8 or int4) cache is dequantized with ``scale`` into ``dtype``."""
    bs = cache.shape[1]
    nblk = (num_tokens + bs - 1) // bs
    out = cache[block_table[:nblk].long()].flatten(0, 1)[:num_tokens]
    if cache.dtype in (torch.float8_e4m3fn, torch.uint8):
        out = dequantize_kv_ref(out, scale, dtype)
    return out


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               max_seq_len: int | None = None,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` int32 block ids (rows may be padded).
        seq_lens: ``[B]`` int32 context length of each sequence, including the
            query token (its K/V must already be in the cache).
        scale: softmax scale, usually ``D ** -0.5``.
        max_seq_len: ``max(seq_lens)`` if the caller knows it (saves a sync).
        k_scale, v_scale: ``[Hkv]`` float32 scales of a ``float8_e4m3fn`` cache, or
            ``[Hkv, D]`` channel scales of an int4 (``uint8 [NB, BS, Hkv, R]``)
            one; the gathered blocks are dequantized into the query's dtype.

    Returns:
        ``[B, Hq, D]`` in the query's dtype (accumulated in float32).

    Raises:
        ValueError: a quantized cache without (or with misshapen) scales.
    """
    b, hq, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    nblk = (max_seq_len + bs - 1) // bs
    table = block_tables[:, :nblk].long()
    # [B, nblk*BS, Hkv, D] -> [B, Hkv, L, D]
    k = key_cache[table].flatten(1, 2)
    v = value_cache[table].flatten(1, 2)
    if _check_scales(key_cache, k_scale, v_scale):
        k = dequantize_kv_ref(k, k_scale, query.dtype)
        v = dequantize_kv_ref(v, v_scale, query.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    length = k.shape[2]
    mask = torch.arange(length, device=query.device)[None, :] < seq_lens[:, None].long()
    q = query.view(b, hq, 1, d)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=(hq != hkv))
    return out.view(b, hq, d)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: list[int], seq_lens: list[int],
                                scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
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
        k_scale, v_scale: ``[Hkv]`` float32 scales of a ``float8_e4m3fn`` cache, or
            ``[Hkv, D]`` channel scales of an int4 one.

    Returns:
        ``[T, Hq, D]``.

    Raises:
        ValueError: a quantized cache without (or with misshapen) scales.
    """
    hq, hkv = query.shape[1], key_cache.shape[2]
    _check_scales(key_cache, k_scale, v_scale)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        k = _gather_kv(key_cache, block_tables[i], seq_len, k_scale,
                       query.dtype).transpose(0, 1)                            # [Hkv, S, D]
        v = _gather_kv(value_cache, block_tables[i], seq_len, v_scale, query.dtype).transpose(0, 1)
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


# --- GGUF quantized weights (Q4_0, Q4_1, Q8_0) ------------------------------------
#
# A quantized weight stays in GGUF's own bytes: ``qweight`` is uint8
# ``[N, row_bytes]``, one row per output feature (row-major ``[out, in]``), each row
# ``K / 32`` consecutive blocks of 32 weights. Per block, little-endian:
#
#     Q4_0  18 bytes  fp16 d, 16 bytes qs       w_j = (q_j - 8) * d
#     Q4_1  20 bytes  fp16 d, fp16 m, 16 qs     w_j = q_j * d + m
#     Q8_0  34 bytes  fp16 d, 32 int8 qs        w_j = qs[j] * d
#
# where for the 4-bit types q_j = qs[j] & 0xF for j < 16 and qs[j - 16] >> 4 for
# j >= 16 (low nibbles hold the first half of the block, high nibbles the second).

# ggml type id (``gguf.GGMLQuantizationType``) -> (weights per block, bytes per block).
GGUF_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    2: (32, 18),   # Q4_0
    3: (32, 20),   # Q4_1
    8: (32, 34),   # Q8_0
}
_GGUF_Q4_0, _GGUF_Q4_1, _GGUF_Q8_0 = 2, 3, 8


def check_gguf_weight(qweight: torch.Tensor, qtype: int, in_features: int) -> tuple[int, int]:
    """Validate a packed GGUF weight; returns ``(N, row_bytes)``.

    Raises:
        ValueError: ``qtype`` not a key of :data:`GGUF_BLOCK_SIZES`, ``in_features``
            not a positive multiple of 32, ``qweight`` not a 2-D uint8 tensor of
            ``in_features / 32 * bytes_per_block`` columns.
    """
    if isinstance(qtype, bool) or not isinstance(qtype, int) or qtype not in GGUF_BLOCK_SIZES:
        raise ValueError(f"qtype: {qtype!r} not supported, expected one of "
                         f"{sorted(GGUF_BLOCK_SIZES)} (Q4_0, Q4_1, Q8_0)")
    block_weights, block_bytes = GGUF_BLOCK_SIZES[qtype]
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


def dequantize_gguf_reference(qweight: torch.Tensor, qtype: int, in_features: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack a GGUF Q4_0 / Q4_1 / Q8_0 weight (pure torch, any device).

    Computed in float32 with the operations of ``gguf.quants.dequantize`` (so the
    float32 result equals it bit for bit), then cast to ``dtype``.

    Args:
        qweight: ``[N, row_bytes]`` uint8, GGUF blocks (layout above).
        qtype: ggml type id, a key of :data:`GGUF_BLOCK_SIZES`.
        in_features: ``K``, weights per row, a multiple of 32.
        dtype: dtype of the result.

    Returns:
        ``[N, K]`` in ``dtype`` on qweight's device.

    Raises:
        ValueError: see :func:`check_gguf_weight`.
    """
    n, _ = check_gguf_weight(qweight, qtype, in_features)
    block_weights, block_bytes = GGUF_BLOCK_SIZES[qtype]
    blocks = qweight.reshape(n, in_features // block_weights, block_bytes)
    d = _fp16_from_bytes(blocks[..., 0], blocks[..., 1])[..., None]
    if qtype == _GGUF_Q8_0:
        w = blocks[..., 2:].view(torch.int8).to(torch.float32) * d
    else:
        qs = blocks[..., 4:] if qtype == _GGUF_Q4_1 else blocks[..., 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)
        if qtype == _GGUF_Q4_0:
            w = (q - 8.0) * d
        else:
            w = q * d + _fp16_from_bytes(blocks[..., 2], blocks[..., 3])[..., None]
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
