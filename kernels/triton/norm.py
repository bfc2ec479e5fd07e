"""Fused residual-add + RMSNorm: one read of each input row, one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    n_cols,
    weight_rows,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(new_res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + (row % weight_rows) * n_cols + cols, mask=mask, other=0.0)
    # As the reference: normalise in fp32, cast back, then multiply by the weight.
    y = (xf * inv).to(x.dtype) * w
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`lamina.kernels.reference.rms_norm`. ``weight`` is ``(D,)`` or, for
    per-head norms over a ``(T, H, D)`` input, ``(H, D)``."""
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    out = torch.empty_like(x2)
    new_res = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, d).contiguous() if residual is not None else x2
    weight_rows = weight.shape[0] if weight.dim() == 2 else 1
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res,
        weight.contiguous(),
        out,
        new_res,
        d,
        weight_rows,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(d),
    )
    return out.view(shape), new_res.view(shape)
