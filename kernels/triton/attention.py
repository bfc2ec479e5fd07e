"""Paged attention over the flat batch, and the KV cache write.

One program per (sequence, tile of ``BLOCK_Q`` query tokens, KV head): it loads the tile's
queries for every query head sharing that KV head (``BLOCK_Q * GROUP`` rows, padded to a
power of two, so GQA reads each K/V token once for the whole group), walks the sequence's
cache ``TILE`` tokens at a time up to the tile's last causal position, each token found
through the block table, and keeps an online softmax. Tiles span several blocks: one
16-token block per iteration leaves too few loads in flight to fill HBM. Decode tokens
are tiles of one query; prefill chunks with cached context read the cache the same way.

A batch of decodes only, with long contexts, would give too few programs to fill a GPU,
so it takes the split-K (flash-decoding) path instead: each program covers one slice of a
sequence's blocks for one KV head's group and writes a partial result with its softmax
max and sum; a second kernel combines the slices.

Quantized caches (:mod:`lamina.kernels.reference.kv_quant` defines them) are written by
the same store kernel for fp8 (scale, clamp, cast) and by a per-block kernel for int8
(rescale the touched block to its new maximum); attention converts the stored values as
it loads them and applies their scales to the scores and probabilities, so only the
quantized bytes cross memory and dequantizing costs a few multiplies per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lamina.kernels.reference import kv_quant
from lamina.kernels.reference.attention import AttentionMetadata

_QUANT = {None: 0, "fp8": 1, "int8": 2}  # the kernels' QUANT switch
# Globals a kernel reads must be constexpr (GPU compilation refuses plain floats).
FP8_MAX = tl.constexpr(kv_quant.FP8_MAX)
INT8_MAX = tl.constexpr(kv_quant.INT8_MAX)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    scales_ptr,
    slots_ptr,
    v_offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    head_dim,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    slot = tl.load(slots_ptr + tok)
    dst = (slot * num_kv_heads + head) * head_dim + d
    k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + d, mask=mask)
    if FP8:  # per-head static scales: keys at [head], values at [num_kv_heads + head]
        # IEEE division (``/`` is approximate on GPUs) so bytes match the reference's.
        k = tl.math.div_rn(k.to(tl.float32), tl.load(scales_ptr + head))
        v = tl.math.div_rn(v.to(tl.float32), tl.load(scales_ptr + num_kv_heads + head))
        k = _round_to_e4m3(tl.clamp(k, -FP8_MAX, FP8_MAX))
        v = _round_to_e4m3(tl.clamp(v, -FP8_MAX, FP8_MAX))
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + v_offset + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x):
    """``x`` (fp32, within ±448) rounded to the nearest e4m3 value, ties to even, so the
    cast that follows is exact (the interpreter's own fp32→fp8 cast mis-rounds across
    powers of two; on GPUs this matches the hardware's rounding)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals: one step of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    y = x / step
    r = tl.floor(y + 0.5)
    r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
    return tl.where(r == 0.0, x * 0.0, r * step)  # x * 0.0 keeps the sign of zero


@triton.jit
def _write_int8_block(
    x_ptr,
    stride_xt,
    stride_xh,
    cache_ptr,
    scale_ptr,
    block,
    start,
    count,
    token0,
    head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One block's keys or values for one head: what it holds plus the new tokens,
    requantized to the block's new maximum."""
    r = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    held = r < start
    new = (r >= start) & (r < start + count)
    off = ((block * BLOCK_SIZE + r)[:, None] * NUM_KV_HEADS + head) * HEAD_DIM + d[None, :]
    old_scale = tl.load(scale_ptr)
    old = tl.load(cache_ptr + off, mask=held[:, None] & d_valid[None, :], other=0)
    x = tl.load(
        x_ptr + (token0 + r - start)[:, None] * stride_xt + head * stride_xh + d[None, :],
        mask=new[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(held[:, None], old.to(tl.float32) * old_scale, x)
    # IEEE division (``/`` is approximate on GPUs): scales and bytes equal the reference's.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-8), INT8_MAX)
    stored = tl.clamp(tl.floor(tl.math.div_rn(x, scale) + 0.5), -INT8_MAX, INT8_MAX)
    stored = tl.where((held | new)[:, None], stored, 0.0)  # rows past the tokens: zero
    tl.store(cache_ptr + off, stored.to(tl.int8), mask=d_valid[None, :])
    tl.store(scale_ptr, scale)


@triton.jit
def _write_kv_int8_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    scales_ptr,
    writes_ptr,
    v_offset,
    scale_v_offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per (touched block, KV head); a block is written by one sequence only.
    w = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(writes_ptr + w * 4)
    start = tl.load(writes_ptr + w * 4 + 1)
    count = tl.load(writes_ptr + w * 4 + 2)
    token0 = tl.load(writes_ptr + w * 4 + 3)
    scale_off = block * NUM_KV_HEADS + head
    _write_int8_block(
        k_ptr,
        stride_kt,
        stride_kh,
        cache_ptr,
        scales_ptr + scale_off,
        block,
        start,
        count,
        token0,
        head,
        NUM_KV_HEADS,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
    )
    _write_int8_block(
        v_ptr,
        stride_vt,
        stride_vh,
        cache_ptr + v_offset,
        scales_ptr + scale_v_offset + scale_off,
        block,
        start,
        count,
        token0,
        head,
        NUM_KV_HEADS,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    block_writes: torch.Tensor | None = None,
) -> None:
    """See :func:`lamina.kernels.reference.write_kv_cache` (``k``/``v`` may be strided views
    with a contiguous head dimension)."""
    t, h, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    kind = kv_quant.quant_kind(kv_cache)
    if kind == "int8":
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        _write_kv_int8_kernel[(block_writes.shape[0], h)](
            k,
            v,
            kv_cache,
            kv_scales,
            block_writes,
            kv_cache[0].numel(),
            num_blocks * h,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            NUM_KV_HEADS=h,
            HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d),
            BLOCK_SIZE=block_size,
        )
        return
    _write_kv_kernel[(t, h)](
        k,
        v,
        kv_cache,
        _quant_args(kv_cache, kv_scales)[0],  # the scales, or a placeholder never read
        slot_mapping,
        kv_cache[0].numel(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        h,
        d,
        BLOCK_D=triton.next_power_of_2(d),
        FP8=kind == "fp8",
    )


@triton.jit
def _attend_tile(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    start,
    seq,
    block_table_ptr,
    stride_bt,
    table_width,
    cache_ptr,
    scales_ptr,
    v_offset,
    scale_v_offset,
    kv_head,
    scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Fold the sequence's cache tokens ``start .. start + TILE`` (each found through its
    block table) into the online softmax of the query rows ``q`` at positions ``q_pos``:
    load their keys and values for ``kv_head``, mask keys after each row's position,
    return the updated running max, sum and output. Quantized keys and values are only
    converted: their scales (the head's for fp8, each token's block's for int8) multiply
    the scores and the probabilities instead, a few values per token rather than
    ``HEAD_DIM``."""
    pos = start + tl.arange(0, TILE)
    j = pos // BLOCK_SIZE
    # Past the table's width (a tile overhanging the last block) read block 0: those
    # positions are beyond every query's, so the causal mask drops them.
    block = tl.load(block_table_ptr + seq * stride_bt + j, mask=j < table_width, other=0)
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
    k = tl.load(cache_ptr + kv_off, mask=d_valid[None, :], other=0.0).to(q.dtype)
    v = tl.load(cache_ptr + v_offset + kv_off, mask=d_valid[None, :], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale  # (ROWS, TILE)
    if QUANT == 1:
        s = s * tl.load(scales_ptr + kv_head)
    elif QUANT == 2:
        at = block * NUM_KV_HEADS + kv_head
        s = s * tl.load(scales_ptr + at)[None, :]
    s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT == 1:
        p = p * tl.load(scales_ptr + scale_v_offset + kv_head)
    elif QUANT == 2:
        p = p * tl.load(scales_ptr + scale_v_offset + at)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    scales_ptr,
    out_ptr,
    block_table_ptr,
    query_start_ptr,
    context_len_ptr,
    scale,
    v_offset,
    scale_v_offset,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    table_width,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context = tl.load(context_len_ptr + seq)

    # (token in tile, head in group), token-major; padded to ROWS, a power of two.
    rows = tl.arange(0, ROWS)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if FP16_DOT:  # the cache's values are converted to q's dtype in _attend_tile
        q = q.to(tl.float16)
    q_pos = context + q_idx  # absolute position of each query row

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    last_pos = context + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    for start in range(0, last_pos + 1, TILE):
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, start, seq, block_table_ptr, stride_bt, table_width,
            cache_ptr, scales_ptr, v_offset, scale_v_offset, kv_head, scale,
            NUM_KV_HEADS, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE, QUANT,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    scales_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    block_table_ptr,
    context_len_ptr,
    scale,
    v_offset,
    scale_v_offset,
    stride_qt,
    stride_qh,
    stride_bt,
    table_width,
    tokens_per_split,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUANT: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_len_ptr + seq)  # the query sits at position ``context``
    g = tl.arange(0, G_PAD)
    g_valid = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if FP16_DOT:
        q = q.to(tl.float16)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    # tokens_per_split is a multiple of TILE, so no tile crosses into the next split.
    first = split * tokens_per_split
    last = tl.minimum(first + tokens_per_split, context + 1)
    q_pos = context + tl.zeros([G_PAD], dtype=tl.int64)  # every row: the query at ``context``
    for start in range(first, last, TILE):
        m_i, l_i, acc = _attend_tile(
            q, q_pos, m_i, l_i, acc, start, seq, block_table_ptr, stride_bt, table_width,
            cache_ptr, scales_ptr, v_offset, scale_v_offset, kv_head, scale,
            NUM_KV_HEADS, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE, QUANT,
        )  # fmt: skip
    # One partial per (sequence, head, split): normalised output, its max and its sum.
    part = (seq * NUM_KV_HEADS * GROUP + head) * num_splits + split
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(part_out_ptr + part[:, None] * D_PAD + d[None, :], out, mask=g_valid[:, None])
    tl.store(part_max_ptr + part, m_i, mask=g_valid)
    tl.store(part_sum_ptr + part, l_i, mask=g_valid)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, S_PAD)
    sp_valid = sp < num_splits
    d = tl.arange(0, D_PAD)
    base = (seq * NUM_HEADS + head) * num_splits
    m = tl.load(part_max_ptr + base + sp, mask=sp_valid, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + base + sp, mask=sp_valid, other=0.0)
    o = tl.load(
        part_out_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=sp_valid[:, None], other=0.0
    )
    m_all = tl.max(m, axis=0)
    w = tl.where(sp_valid & (l_s > 0), l_s * tl.exp(m - m_all), 0.0)  # empty splits: 0
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _quant_args(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple:
    """(scales tensor, offset of the values' scales in it, QUANT) for the attention kernels."""
    kind = kv_quant.quant_kind(kv_cache)
    if kind is None:
        return kv_cache, 0, 0  # the scales pointer is never read
    return kv_scales, kv_scales[0].numel(), _QUANT[kind]


@dataclass(frozen=True)
class Launch:
    """How the attention kernels are cut up: ``tile`` cache tokens per loop iteration (a
    power of two; blocks of any size are gathered token by token through the table),
    ``num_warps`` / ``num_stages`` per program, and for decode-only batches the number of
    programs per multiprocessor the split-K path aims for. ``benchmarks/kernels.py
    --parts sweep`` times the alternatives; the defaults are what it measured best on an
    H200 (``default_launch``)."""

    tile: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    fp16_dot: bool = False
    """Quantized caches: take the dots in fp16 (queries converted once, the cache's fp8 or
    int8 values per tile: conversions Hopper does in one instruction, where bf16 takes
    two) rather than in the queries' dtype. Not yet measured on a GPU; fp16 holds a
    query's values only up to 65504 (bf16 queries that large would overflow)."""


# Per cache kind: the best geometric mean of a sweep over tile (32-128) x warps (2-8) x
# stages (2, 3) x programs per SM (2-16) on an H200 (docs/performance.md). Quantized caches
# spend more time converting than loading and prefer fewer stages and bigger tiles.
_DEFAULT_LAUNCHES = {
    None: Launch(64, 4, 3, 4),
    "fp8": Launch(128, 4, 3, 8),
    "int8": Launch(128, 2, 2, 16),
}


def default_launch(kind: str | None) -> Launch:
    """The launch configuration attention uses unless told, for a cache of ``kind``
    (``None``: unquantized, else ``fp8`` or ``int8``)."""
    return _DEFAULT_LAUNCHES[kind]


def _split_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None,
    launch: Launch,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    d_pad = dot_width(head_dim)
    table_width = meta.block_table.shape[1]
    per_split = triton.cdiv(table_width * block_size, num_splits)
    tokens_per_split = triton.cdiv(per_split, launch.tile) * launch.tile
    parts = num_seqs * num_heads * num_splits
    part_out = torch.empty(parts, d_pad, dtype=torch.float32, device=q.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    scales, scale_v_offset, quant = _quant_args(kv_cache, kv_scales)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        kv_cache,
        scales,
        part_out,
        part_max,
        part_sum,
        meta.block_table,
        meta.context_lens,
        scale,
        kv_cache[0].numel(),
        scale_v_offset,
        q.stride(0),
        q.stride(1),
        meta.block_table.stride(0),
        table_width,
        tokens_per_split,
        num_splits,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE=launch.tile,
        QUANT=quant,
        FP16_DOT=launch.fp16_dot and quant != 0,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_max,
        part_sum,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        S_PAD=triton.next_power_of_2(num_splits),
    )
    return out


_MIN_TOKENS_PER_SPLIT = 256


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_tokens: int, multiprocessors: int, per_sm: int
) -> int:
    """How many KV slices a decode-only batch is cut into (1: no split). A batch with two
    programs per multiprocessor or more runs whole (on an H200, splitting batch 64 with
    8 KV heads gained nothing); a smaller one is cut into about ``per_sm`` programs per
    multiprocessor, each with at least ``_MIN_TOKENS_PER_SPLIT`` tokens."""
    programs = num_seqs * num_kv_heads
    if programs >= 2 * multiprocessors:
        return 1
    by_work = max_tokens // _MIN_TOKENS_PER_SPLIT
    return max(1, min(by_work, triton.cdiv(multiprocessors * per_sm, programs)))


def dot_width(head_dim: int) -> int:
    """The head dimension as the attention kernels hold it: the next power of two, and at
    least 16, the shortest inner dimension ``tl.dot`` takes on a GPU (a model with 8-dim
    heads, like the stories260K fixture, is padded; the padding is masked to zero)."""
    return max(16, triton.next_power_of_2(head_dim))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors, which the split-K paths (here and in
    ``quant_linear``) fill; off CUDA (the interpreter, in tests) an H100/H200's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.paged_attention`; reads everything (this step's
    keys too) from ``kv_cache``, which :func:`write_kv_cache` has already filled.
    ``num_splits`` forces the split-K decode path (tests); by default it is chosen from
    the batch's shape and used only for decode-only batches. ``launch``: see
    :class:`Launch` (by default :func:`default_launch`)."""
    launch = launch or default_launch(kv_quant.quant_kind(kv_cache))
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if meta.max_query_len == 1:
        if num_splits is None:
            num_splits = decode_splits(
                num_tokens,
                num_kv_heads,
                meta.block_table.shape[1] * block_size,
                multiprocessors(q.device),
                launch.programs_per_sm,
            )
        if num_splits > 1:
            return _split_decode(q, kv_cache, meta, scale, num_splits, out, kv_scales, launch)
    block_q = max(1, 16 // group)  # at least 16 rows per tile, as tl.dot needs on GPUs
    num_seqs = meta.context_lens.shape[0]
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    scales, scale_v_offset, quant = _quant_args(kv_cache, kv_scales)
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        scales,
        out,
        meta.block_table,
        meta.query_start_loc,
        meta.context_lens,
        scale,
        kv_cache[0].numel(),
        scale_v_offset,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_table.stride(0),
        meta.block_table.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=dot_width(head_dim),
        BLOCK_SIZE=block_size,
        TILE=launch.tile,
        QUANT=quant,
        BLOCK_Q=block_q,
        ROWS=triton.next_power_of_2(block_q * group),
        FP16_DOT=launch.fp16_dot and quant != 0,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
