"""Quantized KV caches (fp8 e4m3 with per-head scales, int8 with per-block scales): the
reference's storage rules, its attention against the unquantized one within a stated
tolerance, and the Triton kernels against the reference (the same bytes, the same
attention) on CPU under TRITON_INTERPRET=1, on CUDA when present."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lamina.kernels import reference as ref
from lamina.kernels.reference import kv_quant
from tests.kernel.layout import metadata, paged_layout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 16
# (context, query) per sequence, decodes first: partial blocks, exact block ends, a chunk
# crossing a block boundary, a prefill from zero and one on cached context.
SEQS = [(0, 1), (15, 1), (16, 1), (12, 5), (0, 9), (33, 20)]


def test_block_writes_lists_each_touched_block_in_batch_order():
    rows = [[30], [7], [17, 3], [1, 8], [5], [4, 6, 23, 16]]
    table = np.array([r + [0] * (4 - len(r)) for r in rows])  # padded like the runner's
    writes = kv_quant.block_writes([1, 1, 1, 5, 9, 20], [0, 15, 16, 12, 0, 33], table, BS)
    assert writes.tolist() == [
        [30, 0, 1, 0],  # block, first new offset, new tokens, first token in the batch
        [7, 15, 1, 1],
        [3, 0, 1, 2],  # position 16 opens the sequence's second block
        [1, 12, 4, 3],  # positions 12..15
        [8, 0, 1, 7],  # position 16
        [5, 0, 9, 8],
        [23, 1, 15, 17],  # positions 33..47
        [16, 0, 5, 32],  # positions 48..52
    ]


def _layout(num_blocks: int, seed: int = 0):
    """Random block tables and slots for SEQS."""
    return paged_layout(SEQS, num_blocks, BS, torch.Generator().manual_seed(seed))


def _meta(table, slots, device, seqs=SEQS):
    return metadata(seqs, table, slots, BS, device, with_block_writes=True)


def _filled(kind, num_blocks, hkv, d, base):
    """A cache of ``kind`` holding ``base`` ``(2, num_blocks, BS, Hkv, D)`` (written by the
    reference), with distinct per-head fp8 scales."""
    dtype = kv_quant.cache_torch_dtype(kind, torch.float32)
    cache = torch.zeros(2, num_blocks, BS, hkv, d, dtype=dtype)
    scales = kv_quant.new_scales(kind, num_blocks, hkv, torch.device("cpu"))
    if kind == "fp8":
        scales.copy_(torch.linspace(0.5, 2.0, 2 * hkv).view(2, hkv))
    every = torch.tensor([[b, 0, BS, b * BS] for b in range(num_blocks)])
    k, v = (base[i].reshape(-1, hkv, d) for i in range(2))
    ref.write_kv_cache(k, v, cache, torch.arange(num_blocks * BS), scales, every)
    return cache, scales


def test_fp8_stores_the_e4m3_value_of_x_over_the_head_scale():
    k, v = torch.randn(5, 2, 8) * 3, torch.randn(5, 2, 8)
    k[0, 0, 0] = 1e4  # saturates at 448 * scale instead of overflowing to NaN
    cache = torch.zeros(2, 1, BS, 2, 8, dtype=torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 2.0], [1.0, 4.0]])
    slots = torch.tensor([0, 3, 4, 9, 15])
    ref.write_kv_cache(k, v, cache, slots, scales)
    for which, x in enumerate((k, v)):
        want = (x / scales[which][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(cache[which, 0, slots].view(torch.uint8), want.view(torch.uint8))
    assert cache[0, 0, 0, 0, 0].float() == 448


def test_int8_rescales_a_block_as_tokens_raise_its_maximum():
    torch.manual_seed(0)
    hkv, d = 2, 8
    x = torch.randn(BS, hkv, d) * torch.linspace(0.1, 3.0, BS)[:, None, None]  # growing
    cache = torch.zeros(2, 3, BS, hkv, d, dtype=torch.int8)
    scales = kv_quant.new_scales("int8", 3, hkv, torch.device("cpu"))
    rounding = torch.zeros(hkv)  # worst case: half a step each time the block is rounded
    for pos in range(BS):  # one decode token at a time into block 1
        writes = torch.tensor([[1, pos, 1, 0]])
        ref.write_kv_cache(x[pos : pos + 1], -x[pos : pos + 1], cache, None, scales, writes)
        rounding += scales[0, 1] / 2
    step = scales[:, 1]  # (2, Hkv)
    assert torch.allclose(step[0], x.abs().amax(dim=(0, 2)) / 127)
    assert torch.equal(step[0], step[1])  # values are -keys: the same magnitudes
    error = (cache[0, 1].float() * step[0][None, :, None] - x).abs().amax(dim=(0, 2))
    assert (error <= rounding).all()
    assert (error <= 2 * step[0]).all(), error / step[0]  # in practice: within two steps
    assert cache[0, 1].abs().amax(dim=(0, 2)).tolist() == [127, 127]  # the max maps to 127
    assert (cache[:, 0] == 0).all() and (cache[:, 2] == 0).all()  # other blocks untouched


@pytest.mark.parametrize("kind,atol", [("int8", 0.05), ("fp8", 0.25)])
def test_quantized_attention_is_close_to_unquantized(kind, atol):
    """The stated tolerance on unit-variance keys and values, 64-dim heads: int8 (127
    levels per block) within 0.05, fp8 e4m3 (3 mantissa bits) within 0.25."""
    torch.manual_seed(0)
    num_blocks, hq, hkv, d = 32, 8, 2, 64
    table, slots = _layout(num_blocks)
    base = torch.randn(2, num_blocks, BS, hkv, d)
    total = sum(n for _, n in SEQS)
    q, k, v = (torch.randn(total, h, d) for h in (hq, hkv, hkv))
    meta = _meta(table, slots, torch.device("cpu"))
    exact = base.clone()
    ref.write_kv_cache(k, v, exact, slots)
    want = ref.paged_attention(q, k, v, exact, meta, d**-0.5)
    cache, scales = _filled(kind, num_blocks, hkv, d, base)
    ref.write_kv_cache(k, v, cache, slots, scales, meta.block_writes)
    got = ref.paged_attention(q, k, v, cache, meta, d**-0.5, kv_scales=scales)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("fp16_dot", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 80), (8, 1, 64)])
def test_triton_quantized_cache_matches_reference(kind, hq, hkv, d, fp16_dot):
    """Prefill and decode (one pass and split-K) on a quantized cache, the dots in the
    queries' dtype or in fp16 (``Launch.fp16_dot``: fp16 rounding of the queries and the
    probabilities, ~1e-3)."""
    pytest.importorskip("triton")
    from lamina.kernels import triton as tri
    from lamina.kernels.triton.attention import default_launch

    launch = dataclasses.replace(default_launch(kind), fp16_dot=fp16_dot)
    tol = dict(atol=2e-3, rtol=2e-3) if fp16_dot else dict(atol=2e-5, rtol=2e-5)

    torch.manual_seed(1)
    num_blocks = 16
    table, slots = _layout(num_blocks, seed=1)
    base = torch.randn(2, num_blocks, BS, hkv, d)
    total = sum(n for _, n in SEQS)
    q, k, v = (torch.randn(total, h, d) for h in (hq, hkv, hkv))

    meta = _meta(table, slots, torch.device("cpu"))
    want_cache, want_scales = _filled(kind, num_blocks, hkv, d, base)
    cache, scales = want_cache.clone().to(DEVICE), want_scales.clone().to(DEVICE)
    ref.write_kv_cache(k, v, want_cache, slots, want_scales, meta.block_writes)
    want = ref.paged_attention(q, k, v, want_cache, meta, d**-0.5, kv_scales=want_scales)

    dev = _meta(table, slots, DEVICE)
    qd, kd, vd = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    tri.write_kv_cache(kd, vd, cache, dev.slot_mapping, scales, dev.block_writes)
    assert torch.equal(cache.cpu().view(torch.uint8), want_cache.view(torch.uint8))
    torch.testing.assert_close(scales.cpu(), want_scales, atol=0, rtol=0)
    got = tri.paged_attention(qd, kd, vd, cache, dev, d**-0.5, kv_scales=scales, launch=launch)
    torch.testing.assert_close(got.cpu(), want, **tol)

    # Decodes alone on the split-K path read the same quantized blocks.
    decodes = [s for s in SEQS if s[1] == 1]
    n = len(decodes)
    want = ref.paged_attention(
        q[:n], k[:n], v[:n], want_cache, _meta(table[:n], slots[:n], "cpu", decodes),
        d**-0.5, kv_scales=want_scales,
    )  # fmt: skip
    got = tri.paged_attention(
        qd[:n], kd[:n], vd[:n], cache, _meta(table[:n], slots[:n], DEVICE, decodes),
        d**-0.5, kv_scales=scales, num_splits=2, launch=launch,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **tol)
