"""The batched LoRA product in one native call (``lora.cpp``): Punica's BGMV on fp32
rows, each row through its own slot's ``A`` and ``B`` only. Same arguments as
:func:`lamina.kernels.triton.lora.add_lora`; the layout is :mod:`lamina.kernels.lora`'s,
the reference :func:`lamina.kernels.reference.lora.add_lora_reference`."""

from __future__ import annotations

import torch

from lamina.kernels.cpu.build import load_library, ptr


def add_lora(
    out: torch.Tensor,  # (T, N), updated in place
    x: torch.Tensor,  # (T, K)
    a: torch.Tensor,  # (S * W, K)
    b: torch.Tensor,  # (S * W, N)
    width: int,  # W
    token_slots: torch.Tensor,  # (T,) int64, -1: no adapter
) -> torch.Tensor:
    """``out`` plus each row's adapter product; fp32 on the CPU, ``out`` and ``x``
    row-major (their rows may be strided views), ``a``, ``b`` and ``token_slots``
    contiguous."""
    rows, k = x.shape
    if not rows:
        return out
    assert out.dtype == x.dtype == a.dtype == b.dtype == torch.float32
    assert out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert token_slots.dtype == torch.int64 and token_slots.is_contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    load_library().lamina_lora_bgmv(
        ptr(out),
        out.stride(0),
        ptr(x),
        x.stride(0),
        rows,
        k,
        ptr(a),
        ptr(b),
        out.shape[1],
        width,
        ptr(token_slots),
    )
    return out
