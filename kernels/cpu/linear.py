"""Native linears on the CPU, ``x @ weight.T + bias``, and the MLP's gated input
projection, ``silu(x @ gate.T) * (x @ up.T)``: the blocked matmul of ``gemm.cpp`` on a
weight packed once at load, fp32 or stored in a smaller format (int8, fp8, int4, bf16:
see :mod:`lamina.kernels.weight_quant`) with fp32 activations. See
:func:`lamina.kernels.linear.linear_factory` for when they run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.cpu import hugepages
from lamina.kernels.cpu.build import load_library, ptr
from lamina.kernels.weight_quant import QuantizedWeight

FORMATS = {"int8": 1, "fp8": 2, "int4": 3, "bf16": 4}
"""The quantized formats the native matmul takes, by the number ``gemm.cpp``'s ``Format``
gives each."""

PANEL = 16
"""Output columns per panel of a packed weight (the matmul's micro-kernel width)."""


class PackedLinear:
    """``x @ weight.T + bias`` for fp32 on the CPU by the native blocked matmul, on a copy
    of ``weight`` ``(N, K)`` packed once into panels of :data:`PANEL` output columns (the
    plain weight is not kept)."""

    _kernel = "lamina_packed_linear"
    _outputs_at = 1
    """Where the output count sits in ``_pointers``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"{type(self).__name__} takes a 2-D fp32 weight, not {weight.dtype}")
        self.in_features = weight.shape[1]
        self.out_features = self._outputs(weight)
        weight, bias = self._arrange(weight), self._arrange(bias)
        rows = weight.shape[0]
        self.packed = hugepages.weights.empty(-(-rows // PANEL) * PANEL * self.in_features)
        library = load_library()
        library.lamina_pack_weight(
            ptr(weight.contiguous()), rows, self.in_features, ptr(self.packed)
        )
        self.bias = None if bias is None else bias.contiguous()
        # Resolved once: a decode step makes a few hundred calls, and each lookup costs.
        self._matmul = getattr(library, self._kernel)
        self._pointers = (ptr(self.packed), self.out_features, ptr(self.bias))

    def _outputs(self, weight: torch.Tensor) -> int:
        return weight.shape[0]

    def _arrange(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The weight's (or bias's) rows in the order the kernel packs them."""
        return rows

    def native_fields(self) -> tuple[int, ...]:
        """This linear as ``decode.cpp``'s ``Linear`` reads it: format (0: fp32), packed
        weight, scales, zero points (0: none), group size, bias (0: none), outputs, inputs,
        the stored input order (0: the model's)."""
        packed, n, bias = self._pointers
        return (0, packed, 0, 0, self.in_features, bias or 0, n, self.in_features, 0)

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
            raise ValueError(f"{type(self).__name__} takes fp32 inputs, not {x.dtype}")
        lead = x.shape[:-1]
        return self(x.reshape(-1, self.in_features).contiguous()).view(*lead, self.out_features)


class PackedQuantLinear(PackedLinear):
    """``x @ weight.dequantize().T + bias`` on the CPU for fp32 ``x`` and an int8, fp8,
    int4 or bf16 weight, packed once as :class:`PackedLinear` packs fp32 (one byte per
    element, two int4 codes per byte, two bytes per bf16); the kernel widens the codes in
    registers and applies the scales (and int4's zero points, per group of K) to the sums."""

    _kernel = "lamina_packed_linear_q"
    _outputs_at = 5

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        if weight.format not in FORMATS:
            raise ValueError(
                f"{type(self).__name__} takes {', '.join(FORMATS)}, not {weight.format}"
            )
        self.in_features = k = weight.shape[1]
        self.out_features = self._outputs(weight.qweight)
        bf16 = weight.format == "bf16"
        codes = self._arrange(weight.qweight.view(torch.int16 if bf16 else torch.uint8))
        bias = self._arrange(bias)
        rows = codes.shape[0]
        panels = -(-rows // PANEL) * PANEL
        library = load_library()
        if weight.format == "int4":
            self.packed = hugepages.weights.empty(panels * k // 2, torch.uint8)
            pack = library.lamina_pack_weight_int4
        elif bf16:
            self.packed = hugepages.weights.empty(panels * k, torch.int16)
            pack = library.lamina_pack_weight_halves
        else:
            self.packed = hugepages.weights.empty(panels * k, torch.uint8)
            pack = library.lamina_pack_weight_bytes
        pack(ptr(codes.contiguous()), rows, k, ptr(self.packed))
        self.group = weight.group_size or k
        # Scales (and zero points) per packed row and group, [panel][group][16]: the
        # kernel reads a panel's 16 at a time (zero past the last row).
        self.scale = self._by_panel(weight.scale, panels)
        self.zero = None if weight.zero is None else self._by_panel(weight.zero, panels)
        self.bias = None if bias is None else bias.contiguous()
        order = weight.input_order
        self.input_order = None if order is None else order.to(torch.int64).contiguous()
        self._matmul = getattr(library, self._kernel)
        self._pointers = (
            ptr(self.packed),
            FORMATS[weight.format],
            ptr(self.scale),
            ptr(self.zero),
            self.group,
            self.out_features,
            ptr(self.bias),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:  # the weight's inputs are stored reordered
            x = x.index_select(-1, self.input_order)
        return super().__call__(x)

    def _by_panel(self, values: torch.Tensor, panels: int) -> torch.Tensor:
        """Per-row values ``(N,)`` or per row and group ``(N, G)`` in packed row order, as
        ``[panel][group][16]``."""
        arranged = self._arrange(values.reshape(values.shape[0], -1))
        padded = F.pad(arranged, (0, 0, 0, panels - arranged.shape[0]))
        groups = padded.shape[1]
        return padded.view(panels // PANEL, PANEL, groups).transpose(1, 2).contiguous()

    def native_fields(self) -> tuple[int, ...]:
        packed, fmt, scale, zero, group, n, bias = self._pointers
        order = ptr(self.input_order) or 0
        return (fmt, packed, scale, zero or 0, group, bias or 0, n, self.in_features, order)


def gated_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` rows ``(2I, ...)`` (a weight's, a bias's) in a gated packing's order:
    per panel of :data:`PANEL` outputs, gate's rows, then up's same ones (zero rows to a
    whole panel)."""
    if rows.shape[0] % 2:
        raise ValueError(f"gate_up has an odd number of rows ({rows.shape[0]})")
    half = rows.shape[0] // 2
    groups = -(-half // PANEL)
    tail = [0, 0] * (rows.dim() - 1) + [0, groups * PANEL - half]  # zero rows to a panel
    gate, up = (F.pad(part, tail).view(groups, PANEL, -1) for part in (rows[:half], rows[half:]))
    return torch.stack([gate, up], dim=1).reshape(2 * groups * PANEL, *rows.shape[1:])


def ungated(out: torch.Tensor, half: int) -> torch.Tensor:
    """A matmul's outputs ``(T, 2 * panels * PANEL)`` over weight rows in
    :func:`gated_rows` order, put back in order: ``[gate; up]`` ``(T, 2 * half)``."""
    rows, groups = out.shape[0], out.shape[1] // (2 * PANEL)
    out = out.view(rows, groups, 2, PANEL).transpose(1, 2).reshape(rows, 2, -1)
    return out[:, :, :half].reshape(rows, 2 * half)


class _GatedRows:
    """The row order of a packed gated projection (see :class:`PackedSiluMul`)."""

    _plain_kernel: str
    """The ungated matmul over the same packed rows."""

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ [gate; up].T + bias``, ``(T, 2I)``: the projection before the activation
        (what a LoRA adds to), by the plain matmul on the same packed weight, its
        interleaved panels put back in order."""
        x = x.reshape(-1, self.in_features).contiguous()
        order = getattr(self, "input_order", None)
        if order is not None:
            x = x.index_select(-1, order)
        rows, half = x.shape[0], self.out_features
        groups = -(-half // PANEL)
        pointers = list(self._pointers)
        pointers[self._outputs_at] = 2 * groups * PANEL
        out = torch.empty((rows, 2 * groups * PANEL))
        matmul = getattr(load_library(), self._plain_kernel)
        matmul(x.data_ptr(), x.stride(0), rows, self.in_features, *pointers, out.data_ptr())
        return ungated(out, half)

    def _outputs(self, weight: torch.Tensor) -> int:
        return weight.shape[0] // 2  # (an odd count is refused as the rows are arranged)

    def _arrange(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        return None if rows is None else gated_rows(rows)


class PackedSiluMul(_GatedRows, PackedLinear):
    """The MLP's gated input projection in one native matmul: for ``gate_up`` ``(2I, K)``
    holding ``[gate; up]`` (and a bias ``(2I,)`` likewise), ``silu(x @ gate.T + b_gate) *
    (x @ up.T + b_up)``, ``(..., I)``, i.e. ``silu_and_mul(x @ gate_up.T + bias)`` without
    making the ``(..., 2I)`` intermediate. The packed panels alternate 16 of gate's columns
    and the same 16 of up's, so the kernel applies the activation to each output block as
    soon as its two sums are done."""

    _kernel = "lamina_packed_silu_mul"
    _plain_kernel = "lamina_packed_linear"


class PackedQuantSiluMul(_GatedRows, PackedQuantLinear):
    """:class:`PackedSiluMul` on an int8 or fp8 ``gate_up`` (its scales in the same
    order as its rows)."""

    _kernel = "lamina_packed_silu_mul_q"
    _plain_kernel = "lamina_packed_linear_q"
