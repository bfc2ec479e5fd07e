"""Paged attention over the flat batch, and the KV cache write.

One program per (sequence, tile of ``BLOCK_Q`` query tokens, KV head): it loads the tile's
queries for every query head sharing that KV head (``BLOCK_Q * GROUP`` rows, so GQA reads
each K/V block once for the whole group), walks the sequence's blocks through its block
table up to the tile's last causal position, and keeps an online softmax. Decode tokens
are tiles of one query; prefill chunks with cached context read the cache the same way.
Not built yet: split-K (flash-decoding) for long-context decode, quantized caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.reference.attention import AttentionMetadata


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slots_ptr,
    v_offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    slot = tl.load(slots_ptr + tok)
    dst = (slot * num_kv_heads + head) * head_dim + d
    k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(cache_ptr + dst, k, mask=mask)
    tl.store(cache_ptr + v_offset + dst, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """See :func:`lamina.kernels.reference.write_kv_cache` (``k``/``v`` may be strided views
    with a contiguous head dimension)."""
    t, h, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    _write_kv_kernel[(t, h)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_cache[0].numel(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        h,
        d,
        BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_table_ptr,
    query_start_ptr,
    context_len_ptr,
    scale,
    v_offset,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context = tl.load(context_len_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP)  # (token in tile, head in group), token-major
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = q_idx < q_len
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_pos = context + q_idx  # absolute position of each query row

    m_i = tl.full([BLOCK_Q * GROUP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP, D_PAD], dtype=tl.float32)
    last_pos = context + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    t = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(last_pos + 1, BLOCK_SIZE)):
        block = tl.load(block_table_ptr + seq * stride_bt + j)
        kv_off = ((block * BLOCK_SIZE + t)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[
            None, :
        ]
        k = tl.load(cache_ptr + kv_off, mask=d_valid[None, :], other=0.0)  # (BS, D)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=d_valid[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
        key_pos = j * BLOCK_SIZE + t
        s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.paged_attention`; reads everything (this step's
    keys too) from ``kv_cache``, which :func:`write_kv_cache` has already filled."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    block_q = max(1, 16 // group)  # at least 16 rows per tile, as tl.dot needs on GPUs
    num_seqs = meta.context_lens.shape[0]
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        out,
        meta.block_table,
        meta.query_start_loc,
        meta.context_lens,
        scale,
        kv_cache[0].numel(),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
    )
    return out
