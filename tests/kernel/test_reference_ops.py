"""Reference ops against direct, unbatched formulations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lamina.kernels.reference import (
    AttentionMetadata,
    apply_rotary,
    paged_attention,
    rms_norm,
    rotary_cos_sin,
    rotary_for_positions,
    silu_and_mul,
    write_kv_cache,
)
from lamina.kernels.reference.attention import _runs


def naive_attention(q, k, v, context_len):
    """One sequence: q (n, Hq, D) at positions context_len.., k/v (context_len + n, Hkv, D)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (context_len + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (context, query) per sequence: decodes first (query 1), then prefill chunks, with
# contexts that end on and off block boundaries, and a chunk with no context.
MIXED = [(0, 1), (7, 1), (8, 1), (12, 5), (0, 9), (3, 1 + 3)]
# Fresh prompts in runs of one length (one SDPA call each run), between other lengths and
# a chunk with context.
FRESH_RUNS = [(0, 1), (0, 6), (0, 6), (0, 6), (0, 5), (0, 6), (4, 6), (0, 6), (0, 6)]
# Enough decodes of spread lengths to be split into several padded groups.
MANY_DECODES = [(n, 1) for n in (0, 2, 3, 5, 8, 9, 11, 15, 16, 17, 20, 23, 24, 30, 31, 40, 47)]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1), (8, 2)])
@pytest.mark.parametrize("seqs", [MIXED, FRESH_RUNS, MANY_DECODES, [*MANY_DECODES, (5, 6)]])
def test_paged_attention_mixed_batch_matches_naive(hq, hkv, seqs):
    torch.manual_seed(0)
    bs, d, num_blocks = 4, 16, 256
    num_decodes = sum(1 for _, n in seqs if n == 1)
    cache = torch.zeros(2, num_blocks, bs, hkv, d)
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, full_k, full_v, slots, qs, ks, vs = [], [], [], [], [], [], []
    for ctx, n in seqs:
        total = ctx + n
        table = [perm.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        k_all, v_all = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
        full_k.append(k_all)
        full_v.append(v_all)
        for pos in range(ctx):  # earlier steps' KV already in the cache
            cache[0, table[pos // bs], pos % bs] = k_all[pos]
            cache[1, table[pos // bs], pos % bs] = v_all[pos]
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, total)]
        qs.append(torch.randn(n, hq, d))
        ks.append(k_all[ctx:])
        vs.append(v_all[ctx:])
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    width = max(len(t) for t in tables)
    table_np = np.array([t + [0] * (width - len(t)) for t in tables])
    slot_mapping = torch.tensor(slots)
    meta = AttentionMetadata.build(
        [n for _, n in seqs],
        [c for c, _ in seqs],
        table_np,
        num_decodes,
        bs,
        slot_mapping,
        torch.device("cpu"),
    )
    assert len(meta.decode_groups) == (2 if num_decodes > 16 else 1)
    write_kv_cache(k, v, cache, slot_mapping)
    out = paged_attention(q, k, v, cache, meta, scale=d**-0.5)
    want = torch.cat(
        [naive_attention(qi, full_k[i], full_v[i], seqs[i][0]) for i, qi in enumerate(qs)]
    )
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_fresh_prompts_of_one_length_share_a_call():
    contexts = [None, None, None, None, "chunk", None, None]
    runs = [(n, c, count) for n, c, count in _runs([6, 6, 6, 5, 6, 6, 6], contexts)]
    assert runs == [(6, None, 3), (5, None, 1), (6, "chunk", 1), (6, None, 2)]


def test_single_fresh_prefill_uses_causal_path():
    torch.manual_seed(1)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cache = torch.zeros(2, 4, 4, 2, 8)
    slots = torch.arange(11)
    meta = AttentionMetadata.build(
        [11], [0], np.array([[0, 1, 2]]), 0, 4, slots, torch.device("cpu")
    )
    assert meta.prefill_contexts == (None,)
    write_kv_cache(k, v, cache, slots)
    out = paged_attention(q, k, v, cache, meta, scale=8**-0.5)
    torch.testing.assert_close(out, naive_attention(q, k, v, 0), atol=1e-5, rtol=1e-5)


def test_rms_norm_with_residual():
    x, res, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    out, new_res = rms_norm(x, w, 1e-6, res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rotary_matches_complex_rotation():
    d, positions = 8, torch.tensor([0, 1, 5, 17])
    cos, sin = rotary_cos_sin(d, 32, theta=10000.0)
    q = torch.randn(4, 2, d)
    rq = apply_rotary(q, *rotary_for_positions(positions, cos, sin, q.dtype))
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angle = positions[:, None].float() * freqs[None, :]  # (T, D/2)
    z = (
        torch.complex(q[..., : d // 2], q[..., d // 2 :])
        * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    )
    torch.testing.assert_close(rq, torch.cat([z.real, z.imag], dim=-1), atol=1e-5, rtol=1e-5)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cos_s, sin_s = rotary_cos_sin(128, 2, 500000.0, scaling)
    cos, sin = rotary_cos_sin(128, 2, 500000.0)
    angle_s, angle = torch.atan2(sin_s[1], cos_s[1]), torch.atan2(sin[1], cos[1])
    assert torch.allclose(angle_s[:8], angle[:8])  # highest frequencies unchanged
    torch.testing.assert_close(angle_s[-8:], angle[-8:] / 8)  # lowest divided by factor


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_fp32_fast_path_matches_the_explicit_formula(rows):
    x, res, w = torch.randn(rows, 512), torch.randn(rows, 512), torch.randn(512)
    s = x + res
    want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rms_norm(x, w, 1e-5, res)[0], want, atol=1e-6, rtol=1e-6)
