"""Rotary position embeddings (the "rotate half" layout of HF Llama checkpoints).

Pair ``(x[i], x[i + d/2])`` of each head is rotated by angle ``position * inv_freq[i]``.
The angles are computed per forward pass from the absolute ``positions`` of the tokens
in the batch, so chunked prefill and decode never depend on where a token sits in the
flat batch.
"""

from __future__ import annotations

import math

import torch

from halfmoon.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``inv_freq`` (float32, ``head_dim / 2`` entries) after the config's rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than original_len / low_freq_factor are slowed down by
    # `factor`, those shorter than original_len / high_freq_factor are kept, and the band in
    # between interpolates linearly in (original_len / wavelength).
    original_len = scaling.original_max_position
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_len / scaling.low_freq_factor
    high_wavelen = original_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``[T, 1, head_dim]`` for tokens at ``positions``."""
    angles = torch.outer(positions.to(torch.float32), inv_freq.to(positions.device))
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
