"""Fused RMSNorm (with the residual add), SiLU-and-mul and rotary embedding on CPU, in
fp32 or bf16, by the native kernels of ``elementwise.cpp``: one pass over the data each,
where the torch reference makes several. In bf16 they round where the reference's bf16
ops round, so they compute what it computes. Same signatures as the reference ops;
inputs these kernels do not take (other dtypes, mixed ones, per-head norm weights, strided
rows) go to the reference."""

from __future__ import annotations

import torch

from lamina.kernels import reference
from lamina.kernels.cpu.build import load_library, ptr

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The element types the kernels take, by their ``dtype`` argument."""


def _rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """2-D rows of ``dtype`` with unit stride along the row: what the kernels index."""
    return t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`lamina.kernels.reference.rms_norm`."""
    dtype = x.dtype
    if not (
        dtype in DTYPES
        and _rows(x, dtype)
        and weight.dim() == 1
        and weight.dtype == dtype
        and (residual is None or _rows(residual, dtype))
    ):
        return reference.rms_norm(x, weight, eps, residual)
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=dtype)
    new_residual = x if residual is None else torch.empty((rows, dim), dtype=dtype)
    load_library().lamina_rms_norm(
        ptr(x),
        x.stride(0),
        ptr(residual),
        0 if residual is None else residual.stride(0),
        ptr(weight.contiguous()),
        eps,
        rows,
        dim,
        ptr(out),
        ptr(None if residual is None else new_residual),
        DTYPES[dtype],
    )
    return out, new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.silu_and_mul`."""
    dtype = gate_up.dtype
    if not (
        dtype in DTYPES
        and _rows(gate_up, dtype)
        and gate_up.is_contiguous()
        and gate_up.shape[1] % 2 == 0
    ):
        return reference.silu_and_mul(gate_up)
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, half), dtype=dtype)
    load_library().lamina_silu_and_mul(ptr(gate_up), rows, half, ptr(out), DTYPES[dtype])
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.apply_rotary` (``cos``/``sin`` ``(T, 1, D/2)``)."""
    tokens, heads, dim = x.shape
    if not (
        x.dtype in DTYPES
        and x.dtype == cos.dtype == sin.dtype
        and x.stride(2) == 1
        and x.stride(1) == dim
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == (tokens, 1, dim // 2)
    ):
        return reference.apply_rotary(x, cos, sin)
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    load_library().lamina_rotary(
        ptr(x),
        x.stride(0),
        ptr(cos),
        ptr(sin),
        tokens,
        heads,
        dim,
        ptr(out),
        DTYPES[x.dtype],
    )
    return out
