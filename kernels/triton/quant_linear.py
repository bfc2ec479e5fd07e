"""Weight-only quantized linears for CUDA: ``x @ dequantize(W).T + bias`` with 16-bit (or
fp32) activations and int8, fp8 (a scale per output channel: W8A16) or int4 (codes with a
scale and a zero point per output channel and group of inputs, as GPTQ and AWQ store
them: W4A16) weights. Each tile of the weight is loaded in its stored width and widened
in registers to the activations' dtype just before the ``tl.dot``, so the weight crosses
memory once, at its quantized size; int8 and fp8 apply their column's scale to the
finished sums, int4 dequantizes each tile with its group's scale and zero point.

Correctness first: one tile shape for every size, no split-K and no autotuning (a decode
batch leaves most of the GPU idle on large weights). Measured on a GPU when one is lent;
tested against the dequantize-then-matmul reference on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.weight_quant import QuantizedWeight

FORMATS = {"int8": 1, "fp8": 2, "int4": 3}
"""The kernel's ``FORMAT`` switch, by weight format."""

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


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
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
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
    if FORMAT != 3:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:  # the weight's inputs are stored reordered
            x = x.index_select(-1, self.input_order)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m, n = x2.shape[0], self.out_features
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _quant_linear_kernel[grid](
            x2,
            self.weight,
            self.scale,
            self.zero if self.zero is not None else self.scale,
            self.bias if self.bias is not None else self.scale,
            out,
            m,
            n,
            self.in_features,
            x2.stride(0),
            self.in_features // self.group,
            self.group,
            FORMAT=self.format,
            HAS_BIAS=self.bias is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
        return out.view(*lead, n)
