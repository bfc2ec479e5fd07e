"""Rotary embedding (half-split layout) for ``(T, H, D)`` queries and keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, half, stride_xt, stride_xh, BLOCK: tl.constexpr
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < half
    base = x_ptr + tok * stride_xt + head * stride_xh
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + half + i, mask=mask, other=0.0)
    c = tl.load(cos_ptr + tok * half + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + tok * half + i, mask=mask, other=0.0)
    o = out_ptr + (tok * num_heads + head) * 2 * half
    tl.store(o + i, x1 * c - x2 * s, mask=mask)
    tl.store(o + half + i, x2 * c + x1 * s, mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.apply_rotary` (``cos``/``sin``: ``(T, 1, D/2)``,
    already in ``x``'s dtype)."""
    t, h, d = x.shape
    assert x.stride(2) == 1, "the head dimension must be contiguous"
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    half = d // 2
    _rotary_kernel[(t, h)](
        x,
        cos.reshape(t, half).contiguous(),
        sin.reshape(t, half).contiguous(),
        out,
        h,
        half,
        x.stride(0),
        x.stride(1),
        BLOCK=triton.next_power_of_2(half),
    )
    return out
