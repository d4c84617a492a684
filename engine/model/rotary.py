"""Rotary position embedding tables with the RoPE scaling types checkpoints use.

One table per model, ``[max_position, D]`` float32: the cosines of the ``D/2``
frequencies, then their sines (the layout every attention backend's
``rotary_embedding`` reads, half-split / NeoX style). Scaling changes only the
frequencies (``linear``, ``llama3``, ``yarn``, ``longrope``, ``dynamic``) and, for
``yarn`` and ``longrope``, multiplies cos and sin by an attention factor; the rotation
kernels are the same for every type. ``longrope`` has two sets of frequencies (short
and long factors): its table holds both, short rows first (the model picks the rows).
``dynamic`` (NTK) changes the base with the sequence length: its table's row ``p``
holds position ``p`` rotated with the base of a context of ``p + 1`` tokens (what a
decode step uses), and :func:`dynamic_ntk_rows` computes the rows of a long prompt's
tokens, which rotate with the prompt length's base.
Each formula follows transformers' ``modeling_rope_utils`` operation for operation,
in float32, so positions rotate to the same values as the reference.
"""

from __future__ import annotations

import math

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.model.hf_config import RopeScaling


def _base_inv_freq(head_dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """``[D/2]`` float32 ``base ** (-2i / D)`` (RoFormer, Su et al. 2021, eq. 15)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation between (wavelength band ``original / {low,high}_freq_factor``); or,
    read from a GGUF file, each frequency divided by its ``freq_factors`` entry (the
    same divisors, as llama.cpp's converter computes them).

    Raises:
        ValueError: ``freq_factors`` whose length is not ``D/2``.
    """
    if s.freq_factors is not None:
        if len(s.freq_factors) != inv_freq.numel():
            raise ValueError(f"rope_freqs.weight: {len(s.freq_factors)} factors for "
                             f"{inv_freq.numel()} frequencies")
        return inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32,
                                       device=inv_freq.device)
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, base: float, s: RopeScaling,
                   device: torch.device | str) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies ramped between interpolated (``/factor``)
    and extrapolated by rotation count; returns ``(inv_freq, attention_factor)``."""
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, s.mscale)
                                     / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001       # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float)
                         / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (interpolation * (1 - extrapolation_factor)
                + extrapolation * extrapolation_factor)
    return inv_freq, attention_factor


def _longrope_inv_freq(head_dim: int, base: float, s: RopeScaling, long: bool,
                       device: torch.device | str) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024; Phi-3): each frequency divided by its own factor,
    ``short_factor`` or ``long_factor``; cos/sin scaled by ``attention_factor``
    (default ``sqrt(1 + ln(factor) / ln(original))``, 1 when ``factor <= 1``).

    Raises:
        ValueError: a factor list whose length is not ``D/2``.
    """
    factors = s.long_factor if long else s.short_factor
    if len(factors) != head_dim // 2:
        raise ValueError(f"rope_parameters.{'long' if long else 'short'}_factor: "
                         f"{len(factors)} factors for head_dim {head_dim} (expected "
                         f"{head_dim // 2})")
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if s.factor <= 1.0 else math.sqrt(
            1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (ext * base ** shape), attention_factor


def _dynamic_ntk_inv_freq(s: RopeScaling, theta: float, head_dim: int, seq_len: int,
                          device: torch.device | str) -> torch.Tensor:
    """``[D/2]`` float32 inverse frequencies of a ``seq_len``-token context under
    dynamic NTK scaling (bloc97's and emozilla's "dynamic NTK-aware" RoPE, 2023;
    transformers' ``_compute_dynamic_ntk_parameters``): base
    ``theta * (factor * L / M - (factor - 1)) ** (D / (D - 2))`` with
    ``L = max(seq_len, M)``, ``M`` = ``max_position_embeddings``.

    Computed op for op as transformers does at run time, on a 0-dim int64 length:
    the same torch calls on the same shapes round the same way (a batched
    ``[R, D/2]`` version differs from it in the last bit for some lengths)."""
    m = s.original_max_position_embeddings
    length = torch.maximum(torch.tensor(seq_len), torch.tensor(m, dtype=torch.int64))
    base = theta * ((s.factor * length / m) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (base ** exponents)).to(device)


def _dynamic_ntk_table(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """``[max_model_len, D]``: row ``p`` is position ``p`` rotated as a forward whose
    longest context is ``p + 1`` tokens rotates it (transformers' ``inv_freq`` before
    any growth for ``p + 1 <= M``: the config's base, computed in Python floats as at
    its init; the NTK base of ``p + 1`` tokens beyond)."""
    s, n = cfg.rope_scaling, cfg.max_model_len
    m = s.original_max_position_embeddings
    table = _table(*inv_freq_and_scale(cfg, device), min(n, m), device)
    if n <= m:
        return table
    # one length at a time, as transformers computes them (~20 us per row)
    inv_freq = torch.stack([_dynamic_ntk_inv_freq(s, cfg.rope_theta, cfg.head_dim, p + 1, "cpu")
                            for p in range(m, n)]).to(device)               # [n - m, D/2]
    freqs = torch.arange(m, n, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    return torch.cat([table, torch.cat([freqs.cos(), freqs.sin()], dim=-1)])


def dynamic_ntk_rows(cfg: ModelConfig, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[T, D]`` float32 cos/sin rows (the table's layout) of ``positions`` (``[T]``
    int64) rotated with the dynamic NTK base of a ``seq_len``-token context: what
    transformers uses for every token of a prompt of ``seq_len`` tokens, since its
    prefill forward's longest sequence sets the base for all of them."""
    inv_freq = _dynamic_ntk_inv_freq(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim, seq_len,
                                     positions.device)
    freqs = torch.outer(positions.float(), inv_freq)                        # [T, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def inv_freq_and_scale(cfg: ModelConfig, device: torch.device | str = "cpu",
                       long: bool = False) -> tuple[torch.Tensor, float]:
    """The ``[D/2]`` float32 inverse frequencies of ``cfg``'s RoPE (scaled as
    ``cfg.rope_scaling`` says; ``long``: ``longrope``'s long factors) and the factor
    cos and sin are multiplied by (1.0 except for ``yarn`` and ``longrope``).
    ``dynamic``: the frequencies of contexts up to ``max_position_embeddings``."""
    s = cfg.rope_scaling
    if s is None:
        return _base_inv_freq(cfg.head_dim, cfg.rope_theta, device), 1.0
    if s.rope_type == "yarn":
        return _yarn_inv_freq(cfg.head_dim, cfg.rope_theta, s, device)
    if s.rope_type == "longrope":
        return _longrope_inv_freq(cfg.head_dim, cfg.rope_theta, s, long, device)
    if s.rope_type == "dynamic":
        # transformers' init: the base of M tokens (theta), in Python floats
        d, m = cfg.head_dim, s.original_max_position_embeddings
        base = cfg.rope_theta * ((s.factor * m / m) - (s.factor - 1)) ** (d / (d - 2))
        return _base_inv_freq(d, base, device), 1.0
    inv_freq = _base_inv_freq(cfg.head_dim, cfg.rope_theta, device)
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, s), 1.0
    raise ValueError(f"rope_scaling: unknown rope_type {s.rope_type!r}")


def _table(inv_freq: torch.Tensor, scale: float, num_positions: int,
           device: torch.device | str) -> torch.Tensor:
    t = torch.arange(num_positions, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)                     # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], dim=-1)


def rope_cos_sin_cache(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[cfg.max_model_len, D]`` float32: ``cos`` of the ``D/2`` angles
    ``position * inv_freq``, then their ``sin``, both times the attention factor.
    With ``longrope``: ``[2 max_model_len, D]``, the short factors' rows, then the
    long factors' (row ``max_model_len + p`` is position ``p``). With ``dynamic``:
    row ``p`` rotated with the NTK base of a ``p + 1``-token context
    (:func:`_dynamic_ntk_table`; the rows of a long prompt's tokens come from
    :func:`dynamic_ntk_rows`).

    Raises:
        ValueError: a ``rope_scaling.rope_type`` this module does not implement (the
            config refuses those first); ``longrope`` factor lists of the wrong length.
    """
    n = cfg.max_model_len
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "dynamic":
        return _dynamic_ntk_table(cfg, device)
    table = _table(*inv_freq_and_scale(cfg, device), n, device)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope":
        table = torch.cat([table, _table(*inv_freq_and_scale(cfg, device, long=True), n, device)])
    return table


def local_rope_cos_sin_cache(cfg: ModelConfig, device: torch.device | str = "cpu"
                             ) -> torch.Tensor:
    """``[cfg.max_model_len, D]`` float32 table of the sliding-window layers' own
    unscaled RoPE with base ``cfg.rope_local_theta`` (Gemma 3)."""
    return _table(_base_inv_freq(cfg.head_dim, cfg.rope_local_theta, device), 1.0,
                  cfg.max_model_len, device)
