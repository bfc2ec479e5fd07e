"""Paged attention over a flattened batch of decode tokens and prefill chunks.

The batch is one flat run of tokens: first ``num_decodes`` sequences with one query token
each (best sorted by length), then prefill chunks of any length. Every sequence has
``context_len`` tokens already in the paged KV cache and ``query_len`` new ones whose
K/V are written by :func:`write_kv_cache` before :func:`paged_attention` reads the cache.
The reference path gathers decodes' blocks into padded dense tensors, in a few groups of
similar length so that short sequences do not pay for the longest one's padding, and calls
``scaled_dot_product_attention`` once per group; prefill chunks get one call each (see
:func:`prefill_attention`). Masks and tables are built once per step in
:meth:`AttentionMetadata.build` and shared by every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from lamina.kernels.reference import kv_quant
from lamina.kernels.transfer import upload

Context = TypeVar("Context")

_DECODE_GROUPS = 4  # at most this many decode groups per step
_MIN_GROUP = 8  # ... of at least this many sequences each


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode sequences ``start:end`` of the batch, padded to the longest of them."""

    start: int
    end: int
    block_tables: torch.Tensor  # (B, max_blocks)
    mask: torch.Tensor  # (B, 1, 1, L) True where the key is attended


@dataclass(frozen=True, slots=True)
class PrefillContext:
    """A prefill chunk that continues a sequence: the blocks holding its context and its
    own new tokens, and which of those keys each of its queries sees."""

    block_table: torch.Tensor  # (1, blocks)
    mask: torch.Tensor  # (1, 1, Q, blocks * block_size): query j sees keys <= context + j


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers."""

    slot_mapping: torch.Tensor  # (T,) flat cache slot of each new token
    num_decodes: int
    decode_groups: tuple[DecodeGroup, ...]  # one query per sequence
    num_prefill_tokens: int
    # Flat per-sequence view, for kernels that walk block tables themselves (Triton).
    query_start_loc: torch.Tensor  # (num_seqs + 1,) offsets of each sequence's tokens
    context_lens: torch.Tensor  # (num_seqs,) tokens already in the cache
    block_table: torch.Tensor  # (num_seqs, max_blocks)
    max_query_len: int
    # int8 caches only: the blocks this step writes (see ``kv_quant.block_writes``).
    block_writes: torch.Tensor | None = None  # (W, 4)
    prefill_lens: tuple[int, ...] = ()  # each prefill chunk's length, in batch order
    # The reference path's view of each prefill chunk (aligned with ``prefill_lens``):
    # None for a fresh prompt, its cached context for a chunk that continues one.
    prefill_contexts: tuple[PrefillContext | None, ...] = ()

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_table: np.ndarray,
        num_decodes: int,
        block_size: int,
        slot_mapping: torch.Tensor,
        device: torch.device,
        dense_decodes: bool = True,
        dense_prefill: bool = True,
        with_block_writes: bool = False,
    ) -> AttentionMetadata:
        """Derive the masks and padded indices for one step (decode sequences first).

        ``block_table`` is ``(num_seqs, max_blocks)``, each row a sequence's block ids padded
        with any valid id (padding is masked out). The padded groups and masks are for the
        reference path; kernels that walk block tables themselves need just the flat
        per-sequence view, so ``dense_decodes=False`` / ``dense_prefill=False`` skip them.
        ``with_block_writes`` adds the per-block write plan that int8 caches need.
        """
        writes = None
        if with_block_writes:
            writes = kv_quant.block_writes(query_lens, context_lens, block_table, block_size)
            writes = upload(writes, torch.int64, device)
        flat = dict(
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            num_prefill_tokens=sum(query_lens[num_decodes:]),
            query_start_loc=upload(np.cumsum([0, *query_lens]), torch.int64, device),
            context_lens=upload(context_lens, torch.int64, device),
            block_table=upload(block_table, torch.int64, device),
            max_query_len=max(query_lens),
            block_writes=writes,
            prefill_lens=tuple(int(n) for n in query_lens[num_decodes:]),
        )
        decode_groups = []
        seq_lens = np.asarray(context_lens[:num_decodes]) + 1
        num_groups = max(1, min(_DECODE_GROUPS, num_decodes // _MIN_GROUP))
        bounds = np.linspace(0, num_decodes, num_groups + 1).astype(int)
        for start, end in itertools.pairwise(bounds):
            if start == end or not dense_decodes:
                continue
            lens = seq_lens[start:end]
            max_blocks = -(-int(lens.max()) // block_size)
            keys = np.arange(max_blocks * block_size)
            mask = torch.from_numpy(keys[None, :] < lens[:, None])[:, None, None, :]
            tables = _table(block_table[start:end], max_blocks, device)
            decode_groups.append(DecodeGroup(int(start), int(end), tables, _to(mask, device)))

        contexts: list[PrefillContext | None] = []
        prefills = range(num_decodes, len(query_lens)) if dense_prefill else range(0)
        for i in prefills:
            ctx, n = int(context_lens[i]), int(query_lens[i])
            if ctx == 0:
                contexts.append(None)
                continue
            num_blocks = -(-(ctx + n) // block_size)
            keys = np.arange(num_blocks * block_size)
            mask = keys[None, :] <= ctx + np.arange(n)[:, None]
            contexts.append(
                PrefillContext(
                    _table(block_table[i : i + 1], num_blocks, device),
                    _to(torch.from_numpy(mask)[None, None], device),
                )
            )
        return AttentionMetadata(
            decode_groups=tuple(decode_groups), prefill_contexts=tuple(contexts), **flat
        )


def _table(block_table: np.ndarray, width: int, device: torch.device) -> torch.Tensor:
    return upload(np.ascontiguousarray(block_table[:, :width]), torch.int64, device)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else upload(t, t.dtype, device)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    block_writes: torch.Tensor | None = None,
) -> None:
    """Store new keys/values ``(T, Hkv, D)`` at ``slot_mapping`` in ``kv_cache``
    ``(2, num_blocks, block_size, Hkv, D)``; quantized if the cache is (see
    :mod:`~lamina.kernels.reference.kv_quant`: fp8 needs ``kv_scales``, int8 also the
    step's ``block_writes``)."""
    kind = kv_quant.quant_kind(kv_cache)
    if kind == "fp8":
        kv_quant.write_fp8(k, v, kv_cache, slot_mapping, kv_scales)
        return
    if kind == "int8":
        kv_quant.write_int8(k, v, kv_cache, kv_scales, block_writes)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(
    kv_cache: torch.Tensor,
    which: int,
    tables: torch.Tensor,
    kv_scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Keys (``which=0``) or values of blocks ``tables`` ``(B, n)`` → ``(B, Hkv, n * bs, D)``."""
    b, n = tables.shape
    _, _, bs, h, d = kv_cache.shape
    flat = tables.reshape(-1)
    # index_select copies whole blocks, which on CPU is faster than advanced indexing.
    blocks = torch.index_select(kv_cache[which], 0, flat)  # (B * n, bs, Hkv, D)
    if kv_scales is not None:
        blocks = kv_quant.dequantize_blocks(blocks, which, flat, kv_scales, dtype)
    return blocks.view(b, n * bs, h, d).transpose(1, 2)


def _stored(
    kv_cache: torch.Tensor,
    which: int,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """This step's keys or values as the quantized cache holds them, ``(T, Hkv, D)``."""
    _, _, bs, h, d = kv_cache.shape
    block_ids = torch.div(slot_mapping, bs, rounding_mode="floor")
    stored = kv_cache[which].view(-1, h, d)[slot_mapping][:, None]  # (T, 1, Hkv, D)
    return kv_quant.dequantize_blocks(stored, which, block_ids, kv_scales, dtype)[:, 0]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``(T, Hq, D)`` for queries ``q`` ``(T, Hq, D)``.

    ``k``/``v`` ``(T, Hkv, D)`` are this step's new keys and values, already written to
    ``kv_cache`` (quantized if it is: ``kv_scales`` as for :func:`write_kv_cache`).
    """
    nd = meta.num_decodes
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    out = None
    if len(meta.decode_groups) > 1 or (nd and meta.num_prefill_tokens):
        out = q.new_empty(q.shape)
    for group in meta.decode_groups:
        keys = _gather(kv_cache, 0, group.block_tables, kv_scales, q.dtype)  # (B, Hkv, L, D)
        values = _gather(kv_cache, 1, group.block_tables, kv_scales, q.dtype)
        # The query heads sharing a KV head act as that head's queries: no K/V expansion.
        b = group.end - group.start
        queries = q[group.start : group.end].reshape(b, num_kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scale
        ).reshape(b, num_heads, head_dim)
        if out is None:
            return o
        out[group.start : group.end] = o
    if meta.num_prefill_tokens:
        o = prefill_attention(q[nd:], k[nd:], v[nd:], kv_cache, meta, scale, kv_scales)
        if out is None:
            return o
        out[nd:] = o
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``(P, Hq, D)`` of the step's prefill tokens (``q``, ``k``, ``v``
    are the batch's rows after its decodes), by SDPA on 4-D inputs (on CPU, 3-D inputs
    take SDPA's math path with a materialised score matrix, 4-D ones its flash kernel).

    A fresh prompt attends to its own new keys and values directly (as the cache holds
    them, if it is quantized) with the causal fast path; consecutive fresh prompts of one
    length share a call, as a batch (the same result for each as alone; the per-call cost,
    most of SDPA's time on a CPU at prompts of a hundred tokens, is paid once).
    A chunk that continues a sequence gathers its blocks and applies its mask; no chunk is
    padded to another's length.
    """
    assert len(meta.prefill_contexts) == len(meta.prefill_lens), "built with dense_prefill"
    if kv_scales is not None and any(c is None for c in meta.prefill_contexts):  # fresh ones
        slots = meta.slot_mapping[meta.num_decodes :]
        k = _stored(kv_cache, 0, slots, kv_scales, q.dtype)
        v = _stored(kv_cache, 1, slots, kv_scales, q.dtype)
    out = q.new_empty(q.shape)
    start = 0
    for n, context, count in _runs(meta.prefill_lens, meta.prefill_contexts):
        rows = slice(start, start + n * count)
        queries = q[rows].unflatten(0, (count, n)).transpose(1, 2)  # (count, Hq, n, D)
        if context is None:
            keys = k[rows].unflatten(0, (count, n)).transpose(1, 2)
            values = v[rows].unflatten(0, (count, n)).transpose(1, 2)
            mask, causal = None, True
        else:
            keys = _gather(kv_cache, 0, context.block_table, kv_scales, q.dtype)
            values = _gather(kv_cache, 1, context.block_table, kv_scales, q.dtype)
            mask, causal = context.mask, False
        out[rows] = (
            F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True,
            )
            .transpose(1, 2)
            .flatten(0, 1)
        )  # fmt: skip
        start += n * count
    return out


def _runs(lens: Sequence[int], contexts: Sequence[Context]) -> Iterator[tuple[int, Context, int]]:
    """(length, context, count) of each run of consecutive prefill chunks that one SDPA call
    takes: fresh prompts (no context) of one length together, every other chunk alone."""
    chunks = list(zip(lens, contexts, strict=True))
    i = 0
    while i < len(chunks):
        n, context = chunks[i]
        j = i + 1
        while context is None and j < len(chunks) and chunks[j][0] == n and chunks[j][1] is None:
            j += 1
        yield n, context, j - i
        i = j
