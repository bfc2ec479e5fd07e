"""The native bf16 matmul (``bf16_linear.cpp``) against the exact product: one bf16
rounding of fp32 sums, on both of its paths (AMX tiles from 16 rows, ``vdpbf16ps`` below
them or without AMX), across row counts and shapes off its blocks."""

from __future__ import annotations

import pytest
import torch

from lamina.kernels.cpu.bf16_linear import PackedBf16Linear, PackedBf16SiluMul, available
from lamina.kernels.cpu.elementwise import silu_and_mul

pytestmark = pytest.mark.skipif(
    not available(), reason="the bf16 matmul needs a CPU with AVX-512 BF16"
)
TILES = [0, 1] if torch.cpu._is_amx_tile_supported() else [0]


def assert_rounded_product(got: torch.Tensor, x, w, bias) -> None:
    """``got`` is ``x @ w.T + bias`` rounded to bf16, up to one bf16 step of the exact
    value (two roundings' worth where fp32 sums in another order land across a step) plus
    what the fp32 sums' own error can cancel down to."""
    exact = x.double() @ w.double().T
    if bias is not None:
        exact = exact + bias.double()
    step = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7
    sums_error = 2**-20 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.bfloat16
    excess = (got.double() - exact).abs() - (step + sums_error)
    assert excess.max().item() <= 0, excess.max().item()


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 17, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 63), (100, 172), (96, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(tiles, rows, n, k, with_bias):
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    linear = PackedBf16Linear(w, bias)
    linear._tiles = tiles
    assert_rounded_product(linear(x), x, w, bias)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize(("rows", "n", "k"), [(97, 300, 2048), (150, 600, 1000), (40, 1100, 512)])
@pytest.mark.parametrize("gated", [False, True])
def test_pair_groups_cover_every_block(tiles, rows, n, k, gated):
    """Weights past one L2 group of panel pairs (half of a core's L2: with 2 MB, eight
    pairs at K = 2,048, sixteen at 1,000, 32 at 512): every group, the last one partial,
    against every row block, the last one partial."""
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    plain = PackedBf16Linear(w, bias)
    plain._tiles = tiles
    product = plain(x)
    assert_rounded_product(product, x, w, bias)
    if gated:  # gate's and up's panels interleaved: each group's pairs hold both halves
        linear = PackedBf16SiluMul(w, bias)
        linear._tiles = tiles
        assert torch.equal(linear(x), silu_and_mul(product))


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 5, 8, 33, 70])
@pytest.mark.parametrize(("half", "k"), [(16, 32), (40, 63), (100, 172)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_matmul_is_the_matmul_then_the_activation(tiles, rows, half, k, with_bias):
    """With gate's and up's panels interleaved, the kernel writes silu(gate) * up from each
    panel pair's sums: bit for bit what the matmul over ``[gate; up]`` and then the native
    ``silu_and_mul`` give (the same sums, rounded at the same places), partial panels
    included; its pre-activation is that matmul's output, back in ``[gate; up]`` order."""
    torch.manual_seed(rows * 1000 + half + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    gate_up = torch.randn(2 * half, k).to(torch.bfloat16)
    bias = torch.randn(2 * half).to(torch.bfloat16) if with_bias else None
    plain, gated = PackedBf16Linear(gate_up, bias), PackedBf16SiluMul(gate_up, bias)
    plain._tiles = gated._tiles = tiles
    pre = plain(x)
    assert torch.equal(gated.pre_activation(x), pre)
    out = gated(x)
    assert out.shape == (rows, half) and out.dtype == torch.bfloat16
    assert torch.equal(out, silu_and_mul(pre))


def test_leading_dimensions_and_strided_rows():
    torch.manual_seed(3)
    w = torch.randn(48, 64).to(torch.bfloat16)
    linear = PackedBf16Linear(w, None)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    assert linear(x).shape == (2, 5, 48)
    torch.testing.assert_close(linear(x), linear(x.reshape(10, 64)).view(2, 5, 48))
    wide = torch.randn(20, 100).to(torch.bfloat16)
    assert_rounded_product(linear(wide[:, 10:74]), wide[:, 10:74], w, None)  # row stride 100


def test_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bf16 weight"):
        PackedBf16Linear(torch.randn(16, 32), None)
    linear = PackedBf16Linear(torch.randn(16, 32).to(torch.bfloat16), None)
    with pytest.raises(ValueError, match="bf16 inputs"):
        linear(torch.randn(2, 32))
