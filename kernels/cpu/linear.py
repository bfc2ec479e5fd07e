"""Native fp32 linears on the CPU, ``x @ weight.T + bias``: the blocked matmul of
``gemm.cpp`` on a weight packed once at load. See :func:`lamina.kernels.linear.native_linear`
for when it runs."""

from __future__ import annotations

import torch

from lamina.kernels.cpu.build import load_library, ptr

PANEL = 16
"""Output columns per panel of a packed weight (the matmul's micro-kernel width)."""


class PackedLinear:
    """``x @ weight.T + bias`` for fp32 on the CPU by the native blocked matmul, on a copy
    of ``weight`` ``(N, K)`` packed once into panels of :data:`PANEL` output columns (the
    plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PackedLinear takes a 2-D fp32 weight, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // PANEL)
        self.packed = torch.empty(panels * PANEL * self.in_features)  # 64-byte aligned
        library = load_library()
        library.lamina_pack_weight(
            ptr(weight.contiguous()), self.out_features, self.in_features, ptr(self.packed)
        )
        self.bias = None if bias is None else bias.contiguous()
        # Resolved once: a decode step makes a few hundred calls, and each lookup costs.
        self._matmul = library.lamina_packed_linear
        self._pointers = (ptr(self.packed), self.out_features, ptr(self.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., K)`` fp32; returns ``(..., N)``."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32:
            return self._general(x)
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features))
        self._matmul(
            x.data_ptr(), x.stride(0), rows, self.in_features, *self._pointers, out.data_ptr()
        )
        return out

    def _general(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"PackedLinear takes fp32 inputs, not {x.dtype}")
        lead = x.shape[:-1]
        return self(x.reshape(-1, self.in_features).contiguous()).view(*lead, self.out_features)
