"""Weight-only quantized linears for CUDA: ``x @ dequantize(W).T + bias`` with 16-bit (or
fp32) activations and int8, fp8 (a scale per output channel: W8A16) or int4 (codes with a
scale and a zero point per output channel and group of inputs, as GPTQ and AWQ store
them: W4A16) weights. Each tile of the weight is loaded in its stored width and widened
in registers to the activations' dtype just before the ``tl.dot``, so the weight crosses
memory once, at its quantized size; int8 and fp8 apply their column's scale to the
finished sums, int4 dequantizes each tile with its group's scale and zero point.

A decode batch has a few rows, so its grid of output tiles can be smaller than the GPU: a
4096-wide layer at one row is 64 tiles of 64 columns for 132 multiprocessors, each
reading its columns' whole K alone. Such a grid is split along K (:class:`Launch`'s
``programs_per_sm``): each program sums its slice of K into an fp32 partial, and a second
kernel adds a tile's partials in split order (the same order on every call: a greedy
stream does not depend on timing), then applies the scales and the bias. Not yet run on
a GPU: the defaults are a starting point for ``benchmarks/kernels.py --parts
linear-sweep``, not a measurement. Tested against the dequantize-then-matmul reference on
CPU under ``TRITON_INTERPRET=1``, every path (split or not) in every format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lamina.kernels.triton.attention import multiprocessors
from lamina.kernels.weight_quant import QuantizedWeight

FORMATS = {"int8": 1, "fp8": 2, "int4": 3}
"""The kernel's ``FORMAT`` switch, by weight format."""

BLOCK_M = 16
"""Rows per tile: the fewest ``tl.dot`` takes on a GPU (decode batches are a few rows)."""


@dataclass(frozen=True)
class Launch:
    """How the kernel is cut up: ``block_n`` output columns and ``block_k`` inputs per tile
    (powers of two, at least 16), ``num_warps`` / ``num_stages`` per program, and the
    programs per multiprocessor a grid too small for the GPU is split along K to reach
    (0: never split). ``benchmarks/kernels.py --parts linear-sweep`` times the
    alternatives."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


DEFAULT_LAUNCH = Launch()
MIN_TILES_PER_SPLIT = 2
"""K tiles each split sums at least (fewer make the partials a larger share of the work)."""


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    num_groups,
    group_size,
    k_per_split,
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``(BLOCK_M, BLOCK_N)`` output tile over the inputs ``[k_begin, k_end)`` of
    split ``program_id(2)``; ``SPLIT``: its unscaled fp32 sums go to ``out_ptr`` as
    partial ``program_id(2)`` of ``(splits, M, N)``, for :func:`_split_sum_kernel`.
    ``ONE_GROUP`` (int4): ``group_size`` is a multiple of ``BLOCK_K``, so each tile (which
    starts at a multiple of ``BLOCK_K``) lies in one group, whose scales and zero points
    are loaded once per column rather than once per weight."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        tile_ok = k_ok[:, None] & col_ok[None, :]
        if FORMAT == 3:  # int4: two codes per byte along K, the even input in the low nibble
            packed = tl.load(
                w_ptr + cols[None, :] * (K // 2) + ks[:, None] // 2, mask=tile_ok, other=0
            ).to(tl.int32)
            codes = ((packed >> ((ks[:, None] % 2) * 4)) & 0xF).to(tl.float32)
            if ONE_GROUP:  # the tile is in one group: a scale and zero point per column
                groups = cols[None, :] * num_groups + k0 // group_size
                scale = tl.load(scale_ptr + groups, mask=col_ok[None, :], other=0.0)
                zero = tl.load(zero_ptr + groups, mask=col_ok[None, :], other=0.0)
            else:  # groups narrower than the tile (or not aligned with it): per weight
                groups = cols[None, :] * num_groups + ks[:, None] // group_size
                scale = tl.load(scale_ptr + groups, mask=tile_ok, other=0.0)
                zero = tl.load(zero_ptr + groups, mask=tile_ok, other=0.0)
            w = ((codes - zero) * scale).to(x.dtype)
        else:  # one byte per weight, (N, K)
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=tile_ok, other=0)
            if FORMAT == 2:  # e4m3 bits in fp16's places: 2^-8 times the value, exactly
                b = w.to(tl.int32)
                half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16)
                w = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            else:
                w = w.to(tl.float32)
            w = w.to(x.dtype)
        acc += tl.dot(x, w, input_precision="ieee")
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        partial = out_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(partial + rows[:, None] * N + cols[None, :], acc, mask=out_ok)
    else:
        if FORMAT != 3:
            acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * N + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=out_ok,
        )


@triton.jit
def _split_sum_kernel(
    partial_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    size,
    N,
    splits,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = sum of the splits' partials (in split order) * scale + bias``, over the
    ``size = M * N`` outputs; ``SCALED``: a scale per column (int8, fp8; int4 scaled its
    groups already)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        acc += tl.load(partial_ptr + split * size + offs, mask=ok, other=0.0)
    cols = offs % N
    if SCALED:
        acc *= tl.load(scale_ptr + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024
"""Outputs per program of the partials' sum."""


def k_splits(rows: int, n: int, k: int, multiprocessors: int, launch: Launch) -> int:
    """Into how many slices of K a ``rows x n`` output is cut: none when its tiles give
    every multiprocessor one (the partials would be traffic for nothing), else enough
    slices for ``launch.programs_per_sm`` programs per multiprocessor, each at least
    :data:`MIN_TILES_PER_SPLIT` tiles of K long."""
    tiles = triton.cdiv(rows, BLOCK_M) * triton.cdiv(n, launch.block_n)
    if launch.programs_per_sm == 0 or tiles >= multiprocessors:
        return 1
    by_work = triton.cdiv(k, launch.block_k) // MIN_TILES_PER_SPLIT
    return max(1, min(by_work, triton.cdiv(multiprocessors * launch.programs_per_sm, tiles)))


class TritonQuantLinear:
    """``x @ weight.dequantize().T + bias`` on a quantized weight kept at its size (int4:
    two codes per byte), for the Triton backend."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        if weight.format not in FORMATS:
            raise ValueError(f"{type(self).__name__} takes int8, fp8 or int4, not {weight.format}")
        self.out_features, self.in_features = weight.shape
        self.format = FORMATS[weight.format]
        self.group = weight.group_size or self.in_features
        codes = weight.qweight
        if weight.format == "int4":
            if self.in_features % 2:
                raise ValueError(
                    f"int4 weights need an even number of inputs, not {self.in_features}"
                )
            pairs = codes.to(torch.uint8).view(self.out_features, -1, 2)
            codes = pairs[..., 0] | (pairs[..., 1] << 4)  # (N, K / 2)
        elif weight.format == "fp8":
            codes = codes.view(torch.uint8)  # the kernel widens the bits through fp16
        self.weight = codes.contiguous()
        self.scale = weight.scale.to(torch.float32).contiguous()
        self.zero = None if weight.zero is None else weight.zero.to(torch.float32).contiguous()
        self.bias = bias
        self.input_order = weight.input_order

    def __call__(
        self, x: torch.Tensor, launch: Launch = DEFAULT_LAUNCH, splits: int | None = None
    ) -> torch.Tensor:
        """``splits`` forces the number of K slices (tests); by default :func:`k_splits`."""
        if self.input_order is not None:  # the weight's inputs are stored reordered
            x = x.index_select(-1, self.input_order)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m, n, k = x2.shape[0], self.out_features, self.in_features
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if splits is None:
            splits = k_splits(m, n, k, multiprocessors(x.device), launch)
        tiles_per_split = triton.cdiv(triton.cdiv(k, launch.block_k), splits)
        k_per_split = tiles_per_split * launch.block_k
        splits = triton.cdiv(k, k_per_split)  # none empty
        partials = out
        if splits > 1:
            partials = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        placeholder = self.scale  # for pointers a launch does not read
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, launch.block_n), splits)
        _quant_linear_kernel[grid](
            x2,
            self.weight,
            self.scale,
            self.zero if self.zero is not None else placeholder,
            self.bias if self.bias is not None else placeholder,
            partials,
            m,
            n,
            k,
            x2.stride(0),
            k // self.group,
            self.group,
            k_per_split,
            FORMAT=self.format,
            HAS_BIAS=self.bias is not None,
            SPLIT=splits > 1,
            ONE_GROUP=self.format == FORMATS["int4"] and self.group % launch.block_k == 0,
            BLOCK_M=BLOCK_M,
            BLOCK_N=launch.block_n,
            BLOCK_K=launch.block_k,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )
        if splits > 1:
            _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
                partials,
                self.scale,
                self.bias if self.bias is not None else placeholder,
                out,
                m * n,
                n,
                splits,
                SCALED=self.format != FORMATS["int4"],
                HAS_BIAS=self.bias is not None,
                BLOCK=SUM_BLOCK,
            )
        return out.view(*lead, n)
