"""Python entry points of the compiled CPU kernels (``csrc/``: decode_attention.cpp,
prefill_attention.cpp, elementwise.cpp).

Every function takes CPU tensors of one dtype, float32 or bfloat16 (the KV cache
may instead be ``torch.float8_e4m3fn``, with per-KV-head float32 scales, or packed
int4 rows, ``uint8``), whose rows
may be strided (views into a fused QKV output) but whose innermost ``[H, D]`` is
contiguous; anything else raises ``ValueError``. Each has a torch reference in
:mod:`tandem.kernels.reference` with the same contract, which the tests compare
against. Work is split over ``torch.get_num_threads()`` OpenMP threads.
"""

from __future__ import annotations

import functools

import torch

from tandem.kernels import int4_kv
from tandem.kernels.cpu.build import load_library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


_FNS: dict[tuple[str, torch.dtype], object] = {}
"""The kernels looked up so far, by (name, dtype): called on every layer of every step."""


def _fn(name: str, dtype: torch.dtype):
    fn = _FNS.get((name, dtype))
    if fn is not None:
        return fn
    try:
        fn = getattr(load_library(), f"tandem_{name}_{_SUFFIX[dtype]}")
    except KeyError:
        raise ValueError(f"{name}: dtype {dtype} is not supported on CPU "
                         f"(float32, bfloat16)") from None
    _FNS[(name, dtype)] = fn
    return fn


def _rows(x: torch.Tensor, what: str) -> int:
    """Row stride (elements) of a tensor whose dims after the first are contiguous."""
    if x.device.type != "cpu":
        raise ValueError(f"{what}: expected a CPU tensor, got {x.device}")
    inner = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != inner:
            raise ValueError(f"{what}: dims after the first must be contiguous, "
                             f"got strides {x.stride()} for shape {tuple(x.shape)}")
        inner *= size
    return x.stride(0)


def _fp8_scales(key_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``None`` for a cache in the model dtype; for a ``float8_e4m3fn`` cache
    ``[NB, BS, Hkv, D]`` the two scales as contiguous float32 ``[Hkv]``.

    Raises:
        ValueError: an fp8 cache without both scales, or scales of another shape.
    """
    if key_cache.dtype != torch.float8_e4m3fn:
        return None
    hkv = key_cache.shape[2]
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale/v_scale: required with a float8_e4m3fn KV cache")
    scales = tuple(s.to(torch.float32).contiguous() for s in (k_scale, v_scale))
    if any(tuple(s.shape) != (hkv,) for s in scales):
        raise ValueError(f"k_scale/v_scale: expected shape ({hkv},), got "
                         f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    return scales


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (any shape) -> its e4m3 codes as ``uint8``, by the compiled
    encoder of the KV-cache writes: round to nearest even, saturating to +-448,
    NaN -> 0x7F with x's sign. Meant to equal ``x.to(torch.float8_e4m3fn)`` bit for bit."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    load_library().tandem_fp8_e4m3_encode(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def fp8_e4m3_decode(codes: torch.Tensor, vectorized: bool = True) -> torch.Tensor:
    """``uint8`` e4m3 codes -> float32 values, by the compiled decoder: the 256-entry
    table (``vectorized=False``), or the row decoder of the fp8 attention kernels
    (F16C where the CPU has it; exact except for the NaN codes 0x7F and 0xFF)."""
    codes = codes.view(torch.uint8).contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    load_library().tandem_fp8_e4m3_decode(codes.data_ptr(), out.data_ptr(), codes.numel(),
                                          int(vectorized))
    return out


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, *, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Decode attention reading K/V blocks in place (no gathered copy).

    For every (sequence, KV head) pair the ``Hq / Hkv`` query heads that share the
    KV head score all ``seq_lens[b]`` cached tokens, take a float32 softmax and sum
    the values (two passes over the blocks). Same contract as
    :func:`tandem.kernels.reference.paged_decode_attention_ref`.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: ``[NB, BS, Hkv, D]``, contiguous, in the query's
            dtype or ``torch.float8_e4m3fn``; or int4 rows ``uint8 [NB, BS, Hkv, R]``
            (:mod:`tandem.kernels.int4_kv`: K per channel in full blocks, per token
            in a sequence's last, open block; V per token).
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32 context lengths (tokens), each >= 1; the current
            token's K/V must already be in the cache.
        scale: softmax scale.
        out: optional ``[B, Hq, D]`` destination (may be a row-strided view).
        k_scale, v_scale: ``[Hkv]`` float32 dequantization scales of an fp8 cache
            (K = k_scale[h] * stored value); for an int4 cache, optionally the
            open-block K store ``[S, BS, Hkv, D]`` (query dtype) and ``[B]`` int64
            entries (-1: the last block is full), whose open last blocks' K are read
            from it; ignored otherwise.
        window: a sliding window (tokens): each sequence attends only its last
            ``window`` cached tokens (transformers' ``sliding_window``); None: all.
            Caches in the query's dtype only.
        softcap: scores ``s * scale`` become ``softcap * tanh(s * scale / softcap)``
            before the softmax (Gemma 2's ``attn_logit_softcapping``); None: off.
            Caches in the query's dtype only.

    Returns:
        ``[B, Hq, D]`` in the query's dtype.

    Raises:
        ValueError: non-contiguous caches, non-int32 tables or lengths, a quantized
            cache without (or with misshapen) scales; ``window`` or ``softcap`` with
            a quantized cache, a window below 1 or a cap not above 0.
    """
    b, hq, d = query.shape
    if window is not None or softcap is not None:
        if key_cache.dtype != query.dtype:
            raise ValueError("window/softcap: the decode kernel takes them for caches in "
                             f"the query's dtype only, not {key_cache.dtype}")
        if window is not None and window < 1:
            raise ValueError(f"window: must be at least 1 token, got {window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap: must be positive, got {softcap}")
    nb, bs, hkv, _ = key_cache.shape
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache/value_cache: must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables/seq_lens: must be int32")
    if out is None:
        out = torch.empty_like(query)
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    if key_cache.dtype == torch.uint8:
        row = key_cache.shape[3]
        if row != int4_kv.int4_kv_row_bytes(d, bs):
            raise ValueError(f"key_cache: int4 rows of {row} bytes do not hold {d} channels "
                             f"in blocks of {bs}")
        store = entries = None
        if k_scale is not None and v_scale is not None:      # the open-block K store
            if k_scale.dtype != query.dtype or tuple(k_scale.shape[1:]) != (bs, hkv, d) \
                    or not k_scale.is_contiguous():
                raise ValueError(f"k_scale: an int4 open-block K store must be contiguous "
                                 f"[S, {bs}, {hkv}, {d}] {query.dtype}, got "
                                 f"{tuple(k_scale.shape)} {k_scale.dtype}")
            store = k_scale
            entries = v_scale.to(torch.int64).contiguous()
            if entries.shape != (b,) or int(entries.max()) >= store.shape[0]:
                raise ValueError(f"v_scale: expected {b} store entries below {store.shape[0]}")
        _fn("decode_attention_int4", query.dtype)(
            out.data_ptr(), _rows(out, "out"), query.data_ptr(), _rows(query, "query"),
            key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), b, hq, hkv, d, bs, int4_kv.int4_kv_group_size(d), row, scale,
            None if store is None else store.data_ptr(),
            None if entries is None else entries.data_ptr(), torch.get_num_threads())
        return out
    fp8 = _fp8_scales(key_cache, k_scale, v_scale)
    if fp8 is not None:
        _fn("decode_attention_fp8", query.dtype)(
            out.data_ptr(), _rows(out, "out"), query.data_ptr(), _rows(query, "query"),
            key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), b, hq, hkv, d, bs, scale, fp8[0].data_ptr(), fp8[1].data_ptr(),
            torch.get_num_threads())
        return out
    _fn("decode_attention", query.dtype)(
        out.data_ptr(), _rows(out, "out"), query.data_ptr(), _rows(query, "query"),
        key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), b, hq, hkv, d, bs, scale, window or 0, softcap or 0.0,
        torch.get_num_threads())
    return out


class DecodeStep:
    """What every layer's :func:`decode_from_qkv` of one all-decode step shares: the
    step's cache slots, block tables and context lengths, checked and converted once
    per step instead of once per layer.

    Args:
        slot_mapping: ``[B]`` cache slots of the step's tokens (any integer dtype).
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32 context lengths (tokens), each >= 1.

    Raises:
        ValueError: tables or lengths not int32.
    """

    __slots__ = ("_slots", "_tables", "_lens", "slots", "tables", "table_stride", "lens",
                 "num_seqs", "num_threads")

    def __init__(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor):
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("block_tables/seq_lens: must be int32")
        self._slots = slot_mapping.to(torch.int64).contiguous()
        self._tables = block_tables.contiguous()
        self._lens = seq_lens.contiguous()
        self.slots, self.lens = self._slots.data_ptr(), self._lens.data_ptr()
        self.tables, self.table_stride = self._tables.data_ptr(), self._tables.stride(0)
        self.num_seqs = self._lens.shape[0]
        self.num_threads = torch.get_num_threads()


def decode_from_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, step: DecodeStep,
                    scale: float, *, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """One layer's attention for a step of decodes only, from the fused QKV
    projection: RoPE on Q and K in place (:func:`rotary_embedding`), K and V written
    to the cache (:func:`reshape_and_cache`), then :func:`paged_decode_attention` --
    the same three kernels, called with the step's shared pointers (``step``) and no
    per-call tensor checks: bit for bit what the three calls give, with less host
    work per layer.

    Args:
        qkv: ``[B, (Hq + 2 Hkv) D]`` contiguous, float32 or bfloat16 (one token per
            sequence); its Q and K parts are rotated in place.
        positions: ``[B]`` int64 positions (rows of ``cos_sin_cache``).
        cos_sin_cache: float32 ``[max_position, D]``, contiguous.
        key_cache, value_cache: ``[NB, BS, Hkv, D]`` in ``qkv``'s dtype, contiguous.
        step: the step's :class:`DecodeStep`.
        window, softcap: as in :func:`paged_decode_attention`.

    Returns:
        ``[B, Hq D]`` in ``qkv``'s dtype.

    Raises:
        ValueError: a dtype other than float32 / bfloat16.
    """
    dtype = qkv.dtype
    rotary, write, decode = (_fn(name, dtype) for name in
                             ("rotary_embedding", "reshape_and_cache", "decode_attention"))
    b = step.num_seqs
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    row = qkv.stride(0)
    q_ptr = qkv.data_ptr()
    k_ptr = q_ptr + q_size * qkv.element_size()
    v_ptr = k_ptr + kv_size * qkv.element_size()
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    nt = step.num_threads
    rotary(positions.data_ptr(), q_ptr, row, num_heads, k_ptr, row, num_kv_heads, head_dim,
           cos_sin_cache.data_ptr(), b, nt)
    kc, vc = key_cache.data_ptr(), value_cache.data_ptr()
    write(k_ptr, row, v_ptr, row, kc, vc, step.slots, b, kv_size)
    out = torch.empty(b, q_size, dtype=dtype)
    decode(out.data_ptr(), q_size, q_ptr, row, kc, vc, step.tables, step.table_stride,
           step.lens, b, num_heads, num_kv_heads, head_dim, key_cache.shape[1], scale,
           window or 0, softcap or 0.0, nt)
    return out


def prefill_head_dim_ok(head_dim: int) -> bool:
    """Head sizes the prefill kernel handles (multiples of 16, at most 256)."""
    return head_dim % 16 == 0 and head_dim <= 256


def has_prefill_attention(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`paged_prefill_attention` runs here for this dtype and head size
    (bfloat16: AVX-512 BF16; float32: AVX-512F)."""
    if not prefill_head_dim_ok(head_dim) or dtype not in _SUFFIX:
        return False
    return bool(getattr(load_library(), f"tandem_has_prefill_attention_{_SUFFIX[dtype]}")())


@functools.cache
def amx_prefill_usable(head_dim: int) -> bool:
    """Whether the AMX bfloat16 prefill kernel runs in this process for ``head_dim``:
    built for a CPU with AMX-BF16, ``head_dim % 32 == 0`` and ``<= 256``, and tile
    state granted by the OS (asked once per process)."""
    return bool(load_library().tandem_prefill_attention_bf16_amx_usable(head_dim))


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: list[int], seq_lens: list[int], scale: float,
                            out: torch.Tensor | None = None,
                            use_amx: bool | None = None) -> torch.Tensor:
    """Causal attention of packed prefill chunks over paged KV, bfloat16 or float32.

    FlashAttention-2 (Dao 2023, Alg. 1): each sequence's context (cached prefix,
    earlier chunks and this chunk, all read from the cache) is first repacked per
    KV head into 16-token tiles; then groups of query rows stream over the tiles
    with an online softmax in float32. bfloat16 (AVX-512 BF16): tiles of bf16 pairs
    for the dot-product instruction, 8 rows at a time, P rounded to bfloat16 before
    P.V as in torch's CPU flash attention. float32 (AVX-512F): K tiles transposed
    (each channel's 16 keys in one vector), an FMA per channel for the scores and
    per key for P.V, 4 rows at a time. bfloat16 on a CPU with AMX (``use_amx``):
    the same loop with both products on AMX tiles, 16 query rows by 32 keys per
    step, the online softmax on AVX-512. Same contract as
    :func:`tandem.kernels.reference.paged_prefill_attention_ref`.

    Args:
        query: ``[T, Hq, D]`` bfloat16 or float32 (rows may be strided).
        key_cache, value_cache: ``[NB, BS, Hkv, D]`` in the query's dtype,
            contiguous, already holding this step's K/V.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``B + 1`` ints, cumulative query lengths (rows of ``query``).
        seq_lens: ``B`` ints, context length (tokens) of each sequence after this step.
        scale: softmax scale.
        out: optional ``[T, Hq, D]`` destination.
        use_amx: bfloat16 only: True runs the AMX kernel, False the AVX-512 BF16 one;
            None: AMX where :func:`amx_prefill_usable`.

    Raises:
        ValueError: :func:`has_prefill_attention` is false for the query's dtype and
            head size, the caches are not in the query's dtype, or ``use_amx`` where
            the AMX kernel cannot run.
    """
    t, hq, d = query.shape
    hkv, bs = key_cache.shape[2], key_cache.shape[1]
    if not has_prefill_attention(query.dtype, d):
        raise ValueError("paged_prefill_attention: needs head_dim % 16 == 0 and bfloat16 "
                         "(a CPU with AVX-512 BF16) or float32 (AVX-512F), got "
                         f"{query.dtype}, head_dim {d}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"key_cache/value_cache: must be {query.dtype} like the query")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache/value_cache: must be contiguous")
    fn = _fn("prefill_attention", query.dtype)
    if query.dtype == torch.bfloat16 and use_amx is not False:
        if amx_prefill_usable(d):
            fn = load_library().tandem_prefill_attention_bf16_amx
        elif use_amx:
            raise ValueError(f"use_amx: the AMX prefill kernel cannot run here (head_dim {d})")
    if out is None:
        out = torch.empty_like(query)
    tables = block_tables.to(torch.int32).contiguous()
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    fn(
        out.data_ptr(), _rows(out, "out"), query.data_ptr(), _rows(query, "query"),
        key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        qsl.data_ptr(), lens.data_ptr(), len(seq_lens), hq, hkv, d, bs, scale,
        torch.get_num_threads())
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the cache ``[NB, BS, Hkv, D]`` at
    ``slot_mapping`` ``[T]`` (int64 ``block * BS + offset``; negative = skip).

    A ``torch.float8_e4m3fn`` cache stores ``e4m3(clamp(x / scale[h], +-448))``
    (round to nearest even) with the ``[Hkv]`` float32 ``k_scale``/``v_scale``,
    bit for bit as :func:`tandem.kernels.reference.reshape_and_cache_ref`.

    Raises:
        ValueError: non-contiguous caches; an fp8 cache without scales.
    """
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache/value_cache: must be contiguous")
    slots = slot_mapping.to(torch.int64).contiguous()
    fp8 = _fp8_scales(key_cache, k_scale, v_scale)
    if fp8 is not None:
        _fn("reshape_and_cache_fp8", key.dtype)(
            key.data_ptr(), _rows(key, "key"), value.data_ptr(), _rows(value, "value"),
            key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), key.shape[0],
            key.shape[1], key.shape[2], fp8[0].data_ptr(), fp8[1].data_ptr())
        return
    _fn("reshape_and_cache", key.dtype)(
        key.data_ptr(), _rows(key, "key"), value.data_ptr(), _rows(value, "value"),
        key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), key.shape[0],
        key.shape[1] * key.shape[2])


def reshape_and_cache_int4_rows(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into an int4 cache ``uint8 [NB, BS, Hkv, R]``
    at ``slot_mapping`` ``[T]`` (negative = skip), every row in the per-token format:
    the rows of :func:`tandem.kernels.int4_kv.quantize_int4_tokens`, bit for bit,
    quantized and stored in one pass (the per-channel rewrite of filled blocks and
    the open-block store stay in :func:`~tandem.kernels.int4_kv.reshape_and_cache_int4`).

    Raises:
        ValueError: non-contiguous caches, rows that cannot hold ``D`` channels, or a
            dtype other than float32 / bfloat16.
    """
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache/value_cache: must be contiguous")
    *_, hkv, row = key_cache.shape
    d = key.shape[-1]
    int4_kv.check_token_rows(row, d)
    slots = slot_mapping.to(torch.int64).contiguous()
    _fn("reshape_and_cache_int4", key.dtype)(
        key.data_ptr(), _rows(key, "key"), value.data_ptr(), _rows(value, "value"),
        key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), key.shape[0], hkv, d,
        int4_kv.int4_kv_group_size(d), row, torch.get_num_threads())


def float_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (any shape) -> ``torch.float16`` by the compiled conversion of the
    int4 write (round to nearest even); meant to equal ``x.to(torch.float16)`` bit for bit."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.float16)
    load_library().tandem_float_to_fp16(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

    Args:
        x: ``[T, H]`` contiguous; weight: ``[H]`` in x's dtype.
        residual: ``[T, H]`` contiguous, or None.

    Returns:
        ``y`` ``[T, H]``, or ``(y, x + residual)`` (a new tensor); as
        :func:`tandem.kernels.reference.rms_norm_ref`.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(x)
    res = None if residual is None else residual.contiguous()
    _fn("rms_norm", x.dtype)(
        out.data_ptr(), x.data_ptr(), None if res is None else res.data_ptr(),
        None if res_out is None else res_out.data_ptr(),
        (weight if weight.dtype == x.dtype else weight.to(x.dtype)).data_ptr(),
        x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out if residual is None else (out, res_out)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]`` in place (half-split
    layout, RoFormer eq. 34); ``cos_sin_cache`` is float32 ``[max_position, D]``,
    ``positions`` int64 ``[T]``. Returns ``(query, key)``."""
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache: must be contiguous float32")
    pos = positions.to(torch.int64).contiguous()
    _fn("rotary_embedding", query.dtype)(
        pos.data_ptr(), query.data_ptr(), _rows(query, "query"), query.shape[1],
        key.data_ptr(), _rows(key, "key"), key.shape[1], query.shape[2],
        cos_sin_cache.data_ptr(), query.shape[0], torch.get_num_threads())
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer 2020): ``[T, 2F]`` = [gate | up] -> ``silu(gate) * up`` ``[T, F]``."""
    x = x.contiguous()
    n, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, f, dtype=x.dtype)
    _fn("silu_and_mul", x.dtype)(out.data_ptr(), x.data_ptr(), n, f, torch.get_num_threads())
    return out
