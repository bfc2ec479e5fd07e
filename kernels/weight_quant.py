"""Weight-only quantization: the formats a linear's weight is stored in, quantizing a
weight at load, and the torch reference (dequantize, then matmul).

Activations stay in the model's dtype; only the weights are smaller. Each format keeps a
scale per output channel (row of the ``(N, K)`` weight), so ``x @ W.T`` is ``(x @ Q.T) *
scale``:

* ``int8``: symmetric, ``Q = round(W / s)`` in ``[-127, 127]`` with ``s = max|W_j| / 127``
  (rounded half to even, torch's rule);
* ``fp8``: e4m3 (``torch.float8_e4m3fn``), ``Q = fp8(W / s)`` with ``s = max|W_j| / 448``,
  e4m3's largest value, so each row uses the format's whole range;
* ``bf16``: each weight rounded to bf16 (to nearest, ties to even), scale 1: bf16 has
  fp32's exponent range, so no scale helps. Half of fp32's bytes with fp32 activations,
  and exact for a bf16 checkpoint run with ``dtype="float32"``: its weights come back to
  the same bf16 values, and the products are fp32 arithmetic, as on the fp32 weights.

A row of zeros gets scale 1 (its values are all 0 either way).

A third format, ``int4``, is what GPTQ and AWQ checkpoints hold: codes ``0..15`` with a
scale and a zero point per row and group of ``group_size`` inputs, ``W = (Q - zero) *
scale``. The loader unpacks those checkpoints into it; :func:`quantize_int4` makes one by
rounding to the nearest code (the grid GPTQ and AWQ use, without their error
compensation), for tests.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch

WeightFormat = Literal["int8", "fp8", "bf16"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = typing.get_args(WeightFormat)
"""The formats a weight can be quantized to at load (``--quantization``)."""

_RANGE = {"int8": 127.0, "fp8": 448.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's ``(N, K)`` weight as ``qweight * scale`` (``int8``, ``fp8``: a scale per
    row), or ``(qweight - zero) * scale`` per row and group of ``group_size`` (``int4``)."""

    format: str
    """``int8``, ``fp8``, ``bf16`` or ``int4``."""
    qweight: torch.Tensor
    """``(N, K)`` int8, float8_e4m3fn, bfloat16, or uint8 codes 0-15 (int4)."""
    scale: torch.Tensor
    """``(N,)`` float32, one per output channel; int4: ``(N, K / group_size)``."""
    zero: torch.Tensor | None = None
    """int4: ``(N, K / group_size)`` float32 zero points, in codes."""
    group_size: int = 0
    """int4: inputs per group (0: none, a scale per row)."""
    input_order: torch.Tensor | None = None
    """``(K,)`` int64 where the stored inputs are not in the model's order (act-order
    GPTQ, whose groups are contiguous only when its inputs are reordered): stored input
    ``j`` is the model's input ``input_order[j]``, so a matmul reads ``x[:, input_order]``.
    A tensor-parallel rank's share of a row-parallel weight stores ``K`` of the layer's
    inputs (whole groups), and ``input_order`` picks them from all of them."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these values stand for, ``(N, K)`` in ``dtype``, its inputs in the
        model's order (``input_order`` must name each of them once)."""
        stored = self.dequantize_stored(torch.float32)
        if self.input_order is None:
            return stored.to(dtype)
        weight = torch.empty_like(stored)
        weight[:, self.input_order] = stored
        return weight.to(dtype)

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``(N, K)`` in ``dtype``, its inputs in the stored order (what
        ``x[:, input_order]`` multiplies)."""
        values = self.qweight.to(torch.float32)
        if self.format != "int4":
            return (values * self.scale[:, None]).to(dtype)
        g = self.group_size
        zero = self.zero.repeat_interleave(g, dim=1)  # type: ignore[union-attr]
        return ((values - zero) * self.scale.repeat_interleave(g, dim=1)).to(dtype)


def quantize(weight: torch.Tensor, format: str) -> QuantizedWeight:
    """``weight`` ``(N, K)`` in ``format`` (one of :data:`WEIGHT_FORMATS`), a scale per row."""
    if format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    if weight.dim() != 2:
        raise ValueError(f"a linear's weight is 2-D, not {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    if format == "bf16":
        ones = torch.ones(w.shape[0])
        return QuantizedWeight(format, w.to(torch.bfloat16).contiguous(), ones)
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / _RANGE[format], torch.ones_like(peak))
    scaled = w / scale[:, None]
    if format == "int8":
        qweight = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        qweight = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return QuantizedWeight(format, qweight.contiguous(), scale.contiguous())


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """``weight`` ``(N, K)`` as int4 codes, each group of ``group_size`` inputs of a row
    spanning its range: ``scale = (max - min) / 15``, ``zero = round(-min / scale)``,
    ``Q = clamp(round(W / scale) + zero, 0, 15)`` (zero and codes are integers, as GPTQ
    and AWQ store them)."""
    rows, inputs = weight.shape
    if group_size <= 0 or inputs % group_size:
        raise ValueError(f"group size {group_size} does not divide {inputs} inputs")
    w = weight.to(torch.float32).reshape(rows, inputs // group_size, group_size)
    low = w.amin(dim=2).clamp(max=0)
    high = w.amax(dim=2).clamp(min=0)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(high))
    zero = (-low / scale).round().clamp(0, 15)
    codes = ((w / scale[..., None]).round() + zero[..., None]).clamp(0, 15)
    return QuantizedWeight(
        "int4",
        codes.reshape(rows, inputs).to(torch.uint8),
        scale.contiguous(),
        zero.contiguous(),
        group_size,
    )


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row blocks of one format stacked into one weight (a fused Q/K/V or gate/up
    projection): per-row scales (and zero points) make that exact."""
    kinds = {(part.format, part.group_size, part.zero is None) for part in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack weights of formats {sorted(k[:2] for k in kinds)}")
    first = parts[0]
    orders = [part.input_order for part in parts]
    if any(o is not None for o in orders) and not all(
        o is not None and torch.equal(o, orders[0])
        for o in orders  # type: ignore[arg-type]
    ):
        raise ValueError("cannot stack weights whose inputs are stored in different orders")
    return QuantizedWeight(
        first.format,
        torch.cat([part.qweight for part in parts]),
        torch.cat([part.scale for part in parts]),
        None if first.zero is None else torch.cat([p.zero for p in parts]),  # type: ignore[misc]
        first.group_size,
        first.input_order,
    )
