"""Reference Llama-3 RoPE frequencies for the rope kernel tests."""

from __future__ import annotations

import math

import torch


def llama3_inv_freq(head_dim: int, theta: float = 500000.0, factor: float = 8.0, low: float = 1.0,
                    high: float = 4.0, original: int = 8192) -> torch.Tensor:  # fmt: skip
    """Llama-3 frequency scaling folded into inv_freq, as the frontend does at build time."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
