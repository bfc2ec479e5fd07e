"""Quantized KV caches: what is stored, how it is scaled, and the torch reference of both.

The cache's dtype says how it is quantized (``kv_scales`` carries the scales):

* **fp8** (``torch.float8_e4m3fn``): ``x / scale`` rounded to e4m3 and clamped to ±448,
  with static scales ``(2, Hkv)`` float32 (keys, values): one value repeated for a
  per-tensor scale, or one per KV head. They come from the checkpoint (``k_scale`` /
  ``v_scale``) and default to 1.0, as in vLLM.
* **int8** (``torch.int8``): a scale per (block, KV head), ``(2, num_blocks, Hkv)``
  float32, kept so that the block's largest magnitude maps to 127. Blocks fill up a few
  tokens at a time, so a write rescales what the block already holds when the new tokens
  raise its maximum (each rescale rounds again, at most half a step of the new scale).

int8 values are rounded half up (``floor(x + 0.5)``), the rule the Triton kernels use too,
so both paths store the same integers.
"""

from __future__ import annotations

import typing
from typing import Literal

import numpy as np
import torch

FP8_MAX = 448.0
INT8_MAX = 127.0
KvCacheDtype = Literal["auto", "fp8", "int8"]
KV_CACHE_DTYPES: tuple[KvCacheDtype, ...] = typing.get_args(KvCacheDtype)


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` (``auto``/``fp8``/``int8``) stores."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose one of auto, fp8, int8")
    return {"auto": model_dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]


def quant_kind(kv_cache: torch.Tensor) -> str | None:
    """``"fp8"``, ``"int8"`` or None (not quantized), from the cache's dtype."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return "fp8"
    if kv_cache.dtype == torch.int8:
        return "int8"
    return None


def new_scales(
    kind: str | None, num_blocks: int, num_kv_heads: int, device: torch.device
) -> torch.Tensor | None:
    """Initial scales: fp8 ``(2, Hkv)`` ones, int8 ``(2, num_blocks, Hkv)`` (set by writes)."""
    if kind == "fp8":
        return torch.ones(2, num_kv_heads, dtype=torch.float32, device=device)
    if kind == "int8":
        return torch.ones(2, num_blocks, num_kv_heads, dtype=torch.float32, device=device)
    return None


def block_writes(
    query_lens: list[int], context_lens: list[int], block_table: np.ndarray, block_size: int
) -> np.ndarray:
    """Which cache blocks a step writes, one row per (sequence, block touched):
    ``(block id, first new offset in the block, new tokens, first token's flat index)``.
    Rows follow the flat batch, so their token ranges tile ``0..T`` in order."""
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context_lens, dtype=np.int64)
    first, last = c // block_size, (c + q - 1) // block_size
    per_seq = last - first + 1
    seq = np.repeat(np.arange(len(q)), per_seq)
    j = first[seq] + np.arange(per_seq.sum()) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    lo = np.maximum(c[seq], j * block_size)
    hi = np.minimum(c[seq] + q[seq], (j + 1) * block_size)
    token0 = (np.cumsum(q) - q)[seq] + lo - c[seq]
    return np.stack([block_table[seq, j], lo - j * block_size, hi - lo, token0], axis=1)


def _round_half_up(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5)


def write_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
) -> None:
    """Store ``k``/``v`` ``(T, Hkv, D)`` scaled by the per-head scales, as e4m3."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    raw = kv_cache.view(torch.uint8)  # index_copy_ has no fp8 kernel on CPU
    for which, x in enumerate((k, v)):
        scaled = x.float() / kv_scales[which][None, :, None]
        stored = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        raw[which].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, stored)


def write_int8(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    writes: torch.Tensor,
) -> None:
    """Store ``k``/``v`` into int8 blocks, rescaling each touched block (``writes`` from
    :func:`block_writes`) to its new maximum."""
    block_size = kv_cache.shape[2]
    blocks, start, count = writes[:, 0], writes[:, 1], writes[:, 2]
    # Each new token's row and offset among the touched blocks.
    row = torch.repeat_interleave(torch.arange(len(writes), device=k.device), count)
    offset = start[row] + torch.arange(k.shape[0], device=k.device) - writes[row, 3]
    slots = torch.arange(block_size, device=k.device)
    held = (slots[None, :] < start[:, None])[:, :, None, None]  # (W, bs, 1, 1)
    filled = (slots[None, :] < (start + count)[:, None])[:, :, None, None]
    for which, x in enumerate((k, v)):
        old_scale = kv_scales[which][blocks]  # (W, Hkv)
        values = kv_cache[which][blocks].float() * old_scale[:, None, :, None]
        values = torch.where(held, values, 0.0)
        values[row, offset] = x.float()
        amax = values.abs().amax(dim=(1, 3))  # (W, Hkv)
        scale = amax.clamp_min(1e-8) / INT8_MAX
        stored = _round_half_up(values / scale[:, None, :, None]).clamp(-INT8_MAX, INT8_MAX)
        stored = torch.where(filled, stored, 0.0).to(torch.int8)
        kv_cache[which].index_copy_(0, blocks, stored)
        kv_scales[which].index_copy_(0, blocks, scale)


def dequantize_blocks(
    stored: torch.Tensor,
    which: int,
    block_ids: torch.Tensor,
    kv_scales: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``stored`` ``(N, bs, Hkv, D)`` blocks ``block_ids`` of keys (``which=0``) or values,
    back in ``dtype``."""
    if stored.dtype == torch.float8_e4m3fn:
        scale = kv_scales[which][None, None, :, None]
    else:
        scale = kv_scales[which][block_ids][:, None, :, None]
    return (stored.float() * scale).to(dtype)
