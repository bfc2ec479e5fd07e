"""Rotary position embedding (NeoX / Llama half-split layout) with llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths are divided by ``factor``,
    short ones kept, and the band in between interpolated smoothly."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute ``cos`` and ``sin`` tables of shape ``(max_positions, head_dim // 2)`` in fp32.

    ``scaling`` is the checkpoint's ``rope_scaling`` with its ``rope_type`` among
    ``default``, ``linear`` and ``llama3``; the loader rejects the others.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
    elif rope_type == "linear":
        inv_freq = inv_freq / float((scaling or {})["factor"])
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # (max_positions, head_dim // 2)
    return freqs.cos().to(device), freqs.sin().to(device)


def rotary_for_positions(
    positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up ``cos``/``sin`` ``(T, 1, D/2)`` for a step's token ``positions`` ``(T,)``, once
    per step: every layer rotates by the same angles."""
    return cos_table[positions].unsqueeze(1).to(dtype), sin_table[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` (queries and keys may share one call) by per-token angles.

    Half-split (NeoX / Hugging Face Llama) layout: dimension ``i`` pairs with ``i + D/2``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
