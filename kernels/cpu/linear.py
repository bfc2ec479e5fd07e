"""``x @ weight.T + bias`` for a few fp32 rows by the native kernel of
``skinny_linear.cpp``, which streams the weight once at close to the machine's read
bandwidth (see :class:`lamina.kernels.linear.CpuLinear` for when it runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.cpu.build import load_library, ptr


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D fp32 ``x`` with unit stride along its rows and
    a contiguous ``weight`` ``(N, K)``; other inputs go to ``F.linear``."""
    if not (
        x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
    ):
        return F.linear(x, weight, bias)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype)
    load_library().lamina_skinny_linear(
        ptr(x),
        x.stride(0),
        ptr(weight),
        ptr(bias),
        rows,
        n,
        k,
        ptr(out),
    )
    return out
