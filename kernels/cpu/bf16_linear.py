"""``x @ weight.T + bias`` for a bf16 model on a CPU that multiplies bf16 pairs in hardware
(AVX-512 BF16, and AMX where there is one): ``bf16_linear.cpp`` on a weight packed once,
pair-interleaved, a layout that serves one row (``vdpbf16ps``) and many (AMX tiles)
alike. See :func:`lamina.kernels.linear.linear_factory` for when it runs."""

from __future__ import annotations

import torch

from lamina.kernels.cpu import hugepages
from lamina.kernels.cpu.build import load_library, ptr, vectorized
from lamina.kernels.cpu.linear import gated_rows, ungated

BLOCK = 512
"""bf16 elements in one packed block: 16 output columns by 32 of K (1 KB)."""

NATIVE_FORMAT = 16
"""This layout's format in ``decode.cpp``'s ``Linear`` (``kBf16Pairs``)."""


def available() -> bool:
    """Whether this CPU runs :class:`PackedBf16Linear` (AVX-512 BF16, and the kernels are
    built with their SIMD paths)."""
    return vectorized() and torch.cpu._is_avx512_bf16_supported()


def packed_size(out_features: int, in_features: int) -> int:
    """bf16 elements of a packed ``(out_features, in_features)`` weight: whole pairs of
    16-column panels by whole 32-deep blocks of K."""
    return -(-out_features // 32) * 2 * -(-in_features // 32) * BLOCK


class PackedBf16Linear:
    """``x @ weight.T + bias`` for bf16 ``x`` and ``weight`` ``(N, K)`` on the CPU, the sums
    in fp32 and the result rounded to bf16 once, as oneDNN's bf16 matmul computes it (the
    sums in another order). The weight is packed once (the plain weight is not kept); the
    bias is kept in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"{type(self).__name__} takes a 2-D bf16 weight, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.packed = hugepages.weights.empty(packed_size(*weight.shape), torch.bfloat16)
        self.packed.zero_()  # the padding past N and K multiplies as zeros
        library = load_library()
        library.lamina_pack_weight_pairs(
            ptr(weight.contiguous()), self.out_features, self.in_features, ptr(self.packed)
        )
        self.bias = None if bias is None else bias.float().contiguous()
        self._matmul = library.lamina_bf16_linear
        self._after_x = (self.in_features, ptr(self.packed), self.out_features, ptr(self.bias))
        self._tiles = int(torch.cpu._is_amx_tile_supported())
        """Whether the kernel may use AMX (from 8 rows); else AVX-512 BF16 alone."""
        self._gated = 0
        """Whether the panels alternate gate's and up's and the kernel writes silu(gate) *
        up (:class:`PackedBf16SiluMul`)."""

    def native_fields(self) -> tuple[int, ...]:
        """This linear as ``decode.cpp``'s ``Linear`` reads it: format, packed weight, no
        scales or zero points, whether AMX may run (its group field), bias (0: none),
        outputs, inputs, no input order."""
        k, packed, n, bias = self._after_x
        return (NATIVE_FORMAT, packed, 0, 0, self._tiles, bias or 0, n, k, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., K)`` bf16; returns ``(..., N)`` bf16."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{type(self).__name__} takes bf16 inputs, not {x.dtype}")
        if x.dim() != 2 or x.stride(1) != 1:
            lead = x.shape[:-1]
            flat = x.reshape(-1, self.in_features).contiguous()
            return self(flat).view(*lead, self.out_features)
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        self._matmul(
            x.data_ptr(),
            x.stride(0),
            rows,
            *self._after_x,
            out.data_ptr(),
            self._tiles,
            self._gated,
        )
        return out


class PackedBf16SiluMul(PackedBf16Linear):
    """The MLP's gated input projection for a bf16 model in one native matmul: for
    ``gate_up`` ``(2I, K)`` holding ``[gate; up]`` (and a bias ``(2I,)`` likewise),
    ``silu_and_mul(x @ gate_up.T + bias)``, ``(..., I)``, rounded where the reference's
    bf16 ops round (each sum with its bias, the activation, the product), without making
    the ``(..., 2I)`` intermediate: the packed panels alternate 16 of gate's columns and
    the same 16 of up's, and the kernel writes each pair's outputs from its two sums."""

    def __init__(self, gate_up: torch.Tensor, bias: torch.Tensor | None) -> None:
        half = gate_up.shape[0] // 2
        arranged_bias = None if bias is None else gated_rows(bias)
        super().__init__(gated_rows(gate_up), arranged_bias)
        self._plain = self._after_x  # the arranged weight's whole matmul
        self.out_features = half
        self._after_x = (*self._after_x[:2], half, self._after_x[3])
        self._gated = 1

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """``[gate; up]`` ``(T, 2I)`` before the activation (what a LoRA adds to): the plain
        matmul on the same packed weight, its interleaved panels put back in order."""
        x = x.reshape(-1, self.in_features)
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((x.shape[0], self._plain[2]), dtype=torch.bfloat16)
        self._matmul(
            x.data_ptr(), x.stride(0), x.shape[0], *self._plain, out.data_ptr(), self._tiles, 0
        )
        return ungated(out, self.out_features)
