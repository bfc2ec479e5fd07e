"""Weight-only quantization: the formats a linear's weight is stored in, quantizing a
weight at load, and the torch reference (dequantize, then matmul).

Activations stay in the model's dtype; only the weights are smaller. Each format keeps a
scale per output channel (row of the ``(N, K)`` weight), so ``x @ W.T`` is ``(x @ Q.T) *
scale``:

* ``int8``: symmetric, ``Q = round(W / s)`` in ``[-127, 127]`` with ``s = max|W_j| / 127``
  (rounded half to even, torch's rule);
* ``fp8``: e4m3 (``torch.float8_e4m3fn``), ``Q = fp8(W / s)`` with ``s = max|W_j| / 448``,
  e4m3's largest value, so each row uses the format's whole range.

A row of zeros gets scale 1 (its values are all 0 either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_FORMATS = ("int8", "fp8")
"""The quantized formats a linear's weight can be stored in."""

_RANGE = {"int8": 127.0, "fp8": 448.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's ``(N, K)`` weight as ``qweight * scale[:, None]``."""

    format: str
    """One of :data:`WEIGHT_FORMATS`."""
    qweight: torch.Tensor
    """``(N, K)`` int8 or float8_e4m3fn."""
    scale: torch.Tensor
    """``(N,)`` float32, one per output channel."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these values stand for, ``(N, K)`` in ``dtype``."""
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)


def quantize(weight: torch.Tensor, format: str) -> QuantizedWeight:
    """``weight`` ``(N, K)`` in ``format`` (one of :data:`WEIGHT_FORMATS`), a scale per row."""
    if format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    if weight.dim() != 2:
        raise ValueError(f"a linear's weight is 2-D, not {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / _RANGE[format], torch.ones_like(peak))
    scaled = w / scale[:, None]
    if format == "int8":
        qweight = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        qweight = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return QuantizedWeight(format, qweight.contiguous(), scale.contiguous())


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row blocks of one format stacked into one weight (a fused Q/K/V or gate/up
    projection): per-row scales make that exact."""
    formats = {part.format for part in parts}
    if len(formats) != 1:
        raise ValueError(f"cannot stack weights of formats {sorted(formats)}")
    return QuantizedWeight(
        parts[0].format,
        torch.cat([part.qweight for part in parts]),
        torch.cat([part.scale for part in parts]),
    )
