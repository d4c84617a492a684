"""FP8 KV cache scales: one-shot calibration at engine start.

With ``kv_cache_dtype fp8_e4m3`` the K and V caches hold ``torch.float8_e4m3fn``
(4 exponent bits, 3 mantissa bits, largest finite value 448). Every element is
stored as ``e4m3(clamp(x / s, -448, 448))`` and read as ``s * stored``, with one
float32 scale ``s`` per (layer, K or V, KV head).

How the scales are chosen (:func:`calibrate_kv_scales`): once, when the engine
starts, the model runs :data:`CALIBRATION_TEXT` (a fixed English paragraph,
~200 tokens) in its own dtype with a scratch KV cache in that dtype, through
the torch reference attention; for each (layer, K/V, head) the largest
``|x|`` written to the cache is taken and

    s = 2 ** ceil(log2(KV_SCALE_MARGIN * amax / 448))

i.e. the scale that maps ``amax`` to ``448 / KV_SCALE_MARGIN`` (``KV_SCALE_MARGIN``
is 2: room for activations up to twice the calibration maximum before they
saturate), rounded up to a power of two. The power of two costs no precision
(e4m3's relative step is the same throughout its normal range: it only shifts
which tiny values become subnormal), makes ``x / s`` and ``s * stored`` exact, and
makes the scales robust: two engines on different devices whose calibration
maxima differ by rounding noise almost always land on the same powers. The
scales are fixed afterwards. Values beyond ``448 * s`` saturate to ``+-448 * s``.

This is the one-shot calibration vLLM performs with ``calculate_kv_scales`` (its
scales are ``amax / 448`` of the first batch); a fixed prompt rather than the
first user request keeps the scales the same on every engine of a model, which
the KV transfer relies on: the two ends of a transfer compute their scales
independently and compare a checksum (:func:`scales_checksum`) in the layout
handshake instead of sending them.

Under tensor parallelism every rank calibrates at once (rank 0 sends the prompt to
the others, :class:`~tandem.engine.parallel.messages.CalibrateKVScales`: the sharded
forward's all-reduces need every rank) and keeps the scales of its own KV heads,
taken from the K and V it writes itself. Those are the heads' scales of one rank up to
the float32 rounding of the row-parallel sums, which the power-of-two rounding
almost always absorbs (SmolLM2: rank 0's scales are exactly one rank's heads 0-1).
"""

from __future__ import annotations

import hashlib
import math

import torch

from tandem.engine.config import ModelConfig

KV_SCALE_MARGIN = 2.0
"""Headroom factor over the calibration maximum (see the module docstring)."""

FP8_E4M3_MAX = 448.0

KV_CACHE_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int4": torch.uint8}
"""``CacheConfig.kv_cache_dtype`` names other than ``auto`` -> storage dtype (an int4
cache is ``uint8``: packed rows, see :mod:`tandem.kernels.int4_kv`; it needs no
calibration: every row or block carries its own parameters)."""

CALIBRATION_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers moved their animals to the hill, while children counted the boats that "
    "drifted past the church. In the city, engineers measured the flow at 3,400 cubic metres "
    "per second and warned that the old bridge (built in 1871) might not hold. "
    "def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([2, 4, 9]))  # 5.0\n"
    "Q: What is the capital of Australia? A: Canberra, not Sydney. "
    "Les enfants jouent dans le jardin; der Hund schläft unter dem Tisch. "
    "Note 7: prices rose 12% in March, fell 4.5% in April, and the index closed at 1,024.75. "
    "She wrote a letter to her brother, describing the storm, the flood, the long wait for "
    "help, and the strange quiet that followed when the rain finally stopped.")
"""The calibration prompt: prose, code, numbers, a question and two other languages,
so that heads specialised on any of them see typical inputs."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache: the model's for ``auto``.

    Raises:
        ValueError: an unknown name.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r}") from None


def scales_from_amax(amax: torch.Tensor, margin: float = KV_SCALE_MARGIN) -> torch.Tensor:
    """Per-head maxima ``|x|`` -> power-of-two scales ``2 ** ceil(log2(margin * amax / 448))``
    (float32, same shape). A head that never left 0 (or whose maximum is tiny) gets
    ``2 ** -24``, the floor that keeps the scale a normal float32 well above 0."""
    raw = (amax.double() * margin / FP8_E4M3_MAX).clamp_min(2.0 ** -24)
    return torch.exp2(torch.ceil(torch.log2(raw))).float()


@torch.inference_mode()
def calibrate_kv_scales(model, cfg: ModelConfig, token_ids: list[int], dtype: torch.dtype,
                        device: torch.device, block_size: int = 16) -> torch.Tensor:
    """Run ``token_ids`` through ``model`` in ``dtype`` and derive the fp8 KV scales.

    Uses a scratch cache in ``dtype`` (freed on return) and the torch reference
    attention backend, so the result depends only on the model, the prompt and
    the device's arithmetic, not on which attention backend the engine runs.

    A tensor-parallel shard (a model built with a communicator of several ranks):
    every rank calls this with the same prompt (rank 0 first broadcasts it, see
    the module docstring), and each gets its own KV heads' scales.

    Args:
        model: a loaded :class:`~tandem.engine.model.layers.DecoderForCausalLM`, or
            a rank's shard of one.
        cfg: its :class:`ModelConfig` (the whole model's, also for a shard).
        token_ids: the calibration prompt (non-empty, at most ``cfg.max_model_len``).
        dtype: the model dtype.
        device: where the model runs.
        block_size: block size of the scratch cache.

    Returns:
        ``[L, 2, Hkv]`` float32 scales on ``device`` (index 0 of dim 1: K, 1: V);
        for a shard, ``Hkv`` is the rank's KV heads.

    Raises:
        ValueError: an empty prompt, or one longer than the model's context.
    """
    from tandem.engine.runtime.model_runner import pack_chunks
    from tandem.kernels.attention_backend import TorchAttentionBackend

    n = len(token_ids)
    if not 0 < n <= cfg.max_model_len:
        raise ValueError(f"calibration prompt: need 1..{cfg.max_model_len} tokens, got {n}")
    comm = getattr(getattr(model, "lm_head", None), "comm", None)
    if comm is not None and comm.world_size > 1:
        from tandem.engine.parallel.group import rank_model_config

        if comm.rank == 0:
            from tandem.engine.parallel.messages import CalibrateKVScales

            comm.broadcast_object(CalibrateKVScales(list(token_ids), block_size))
        cfg = rank_model_config(cfg, comm.world_size, comm.rank)
    num_blocks = math.ceil(n / block_size)
    cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads,
                        cfg.head_dim, dtype=dtype, device=device)
    input_ids, positions, meta = pack_chunks([(list(token_ids), 0, list(range(num_blocks)))],
                                             block_size, device)
    model(input_ids, positions, cache, meta, TorchAttentionBackend())
    # Unwritten slots are 0 and cannot raise a maximum of |x|.
    amax = cache.float().abs().amax(dim=(2, 3, 5))                  # [L, 2, Hkv]
    return scales_from_amax(amax)


def gather_model_kv_scales(scales: torch.Tensor, cfg: ModelConfig, comm) -> torch.Tensor | None:
    """The whole model's fp8 KV scales from every rank's own heads' (a collective:
    every rank of the group calls it, after :func:`calibrate_kv_scales`).

    What a sharded worker's KV connector compares in the transfer handshake
    (:func:`scales_checksum` of all the model's KV heads, as a one-rank engine's
    layout carries it), so that workers of different tensor-parallel sizes can
    exchange an fp8 cache. A KV head that several ranks hold (fewer KV heads than
    ranks) takes the lowest such rank's scales.

    Args:
        scales: ``[L, 2, Hkv_rank]`` float32, this rank's heads' scales.
        cfg: the whole model's config.
        comm: the group's :class:`~tandem.engine.parallel.communicator.Communicator`.

    Returns:
        ``[L, 2, Hkv]`` float32 on rank 0 (``Hkv`` the model's KV heads), None on
        the other ranks.
    """
    from tandem.engine.parallel.partition import head_partition, max_local_kv_heads

    size = max_local_kv_heads(cfg.num_heads, cfg.num_kv_heads, comm.world_size)
    padded = scales.new_zeros(*scales.shape[:2], size)                  # same shape on every rank
    padded[..., :scales.shape[-1]] = scales
    parts = comm.gather(padded, dst=0, dim=-1)                          # [L, 2, world * size]
    if parts is None:
        return None
    whole = scales.new_empty(*scales.shape[:2], cfg.num_kv_heads)
    for rank in reversed(range(comm.world_size)):                       # the lowest rank last
        heads = head_partition(cfg.num_heads, cfg.num_kv_heads, comm.world_size, rank)
        whole[..., heads.kv_start:heads.kv_start + heads.num_kv_heads] = \
            parts[..., rank * size:rank * size + heads.num_kv_heads]
    return whole


def scales_checksum(scales: torch.Tensor | None) -> str:
    """A short hex digest of the scales' float32 bytes (``""`` for None), compared
    across a KV transfer's layout handshake."""
    if scales is None:
        return ""
    data = scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
