"""Paged attention on the CPU: decodes by the native kernel, prefill by the reference (in
fp32 or bf16).

Decode tokens read their keys and values in place from the paged cache
(``paged_attention.cpp``): the reference path instead copies every block of every
sequence into a padded tensor and runs ``scaled_dot_product_attention`` on the copy, which
on a decode-heavy step spends most of attention's time moving memory. Prefill chunks are
compute-bound and keep the reference path (SDPA, one call per chunk or per run of fresh
prompts of one length).
"""

from __future__ import annotations

import torch

from lamina.kernels.cpu.build import load_library, ptr
from lamina.kernels.reference import AttentionMetadata
from lamina.kernels.reference.attention import prefill_attention

_CACHE_KINDS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.int8: 2, torch.bfloat16: 3}
"""The caches the kernel reads, by its ``cache_kind`` argument (a bf16 cache belongs to a
bf16 model)."""

AMX = bool(torch.cpu._is_amx_tile_supported())
"""Whether this CPU has AMX tiles (a bf16 cache's decodes multiply on them by default)."""


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: bool = AMX,
) -> torch.Tensor:
    """Attention of one query ``(Hq, D)`` per sequence over its cached context and its
    own new token (already written): ``context_lens[s] + 1`` tokens. ``q`` ``(S, Hq, D)``
    (rows may be strided; heads contiguous), ``block_table`` ``(S, W)`` int64,
    ``context_lens`` ``(S,)`` int64, as in :class:`AttentionMetadata`. Returns ``(S, Hq,
    D)`` in ``q``'s dtype (written into ``out``, contiguous, if given). fp32 queries, or
    bf16 ones (a bf16 model's) whose result the kernel rounds once, as SDPA's bf16 kernel
    rounds its result; over an 8-bit cache bf16 queries are widened for it. Over a bf16
    cache with ``tiles`` it multiplies on AMX, its softmax weights rounded to bf16 as SDPA's
    are (else in fp32: exactly what the fp32 cache of the same values gives)."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    in_bf16 = q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16
    if q.dtype == torch.bfloat16 and not in_bf16:
        result = decode_attention(
            q.float(), kv_cache, block_table, context_lens, scale, kv_scales, tiles=tiles
        ).to(torch.bfloat16)
        return result if out is None else out.copy_(result)
    if (
        q.dtype not in (torch.float32, torch.bfloat16)
        or q.stride(2) != 1
        or q.stride(1) != head_dim
    ):
        raise ValueError("decode_attention needs fp32 or bf16 queries with contiguous heads")
    if out is not None and (out.dtype != q.dtype or not out.is_contiguous()):
        raise ValueError("decode_attention writes a contiguous output in the queries' dtype")
    contiguous = kv_cache.is_contiguous() and context_lens.is_contiguous()
    if not (contiguous and block_table.stride(1) == 1):
        raise ValueError("decode_attention needs a contiguous cache, table rows and lengths")
    if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
        raise ValueError("decode_attention needs int64 block tables and lengths")
    if kv_cache.dtype not in _CACHE_KINDS:
        raise ValueError(
            f"decode_attention reads fp32, bf16, fp8 or int8 caches, not {kv_cache.dtype}"
        )
    if out is None:
        out = q.new_empty((num_seqs, num_heads, head_dim))
    status = load_library().lamina_paged_decode_attention(
        ptr(q),
        q.stride(0),
        ptr(kv_cache),
        _CACHE_KINDS[kv_cache.dtype],
        ptr(kv_scales.contiguous() if kv_scales is not None else None),
        ptr(block_table),
        block_table.stride(0),
        ptr(context_lens),
        num_seqs,
        num_blocks,
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        ptr(out),
        int(tiles),
        int(in_bf16),
    )
    if status:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for :func:`lamina.kernels.reference.paged_attention` (fp32 or bf16
    queries), with metadata built with ``dense_decodes=False``."""
    nd = meta.num_decodes
    if not nd:
        return prefill_attention(q, k, v, kv_cache, meta, scale, kv_scales)
    if not meta.num_prefill_tokens:
        return decode_attention(q, kv_cache, meta.block_table, meta.context_lens, scale, kv_scales)
    out = q.new_empty(q.shape)
    decode_attention(
        q[:nd],
        kv_cache,
        meta.block_table[:nd],
        meta.context_lens[:nd],
        scale,
        kv_scales,
        out=out[:nd],
    )
    out[nd:] = prefill_attention(q[nd:], k[nd:], v[nd:], kv_cache, meta, scale, kv_scales)
    return out
