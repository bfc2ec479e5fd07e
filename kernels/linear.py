"""Linear layers, with their weights prepared once at load.

On GPUs (and for dtypes other than fp32) a linear is ``F.linear``. On x86 CPUs in fp32 the
engine packs each weight for oneDNN at load and calls oneDNN's matmul on it: on the
small-batch shapes that decoding makes, ``F.linear`` goes to MKL's sgemm, which on the
AMD EPYC this project is measured on streams a 38M-parameter model's weights at 5-8 GB/s
for one row and slows down sharply for a few; oneDNN's packed matmul is 1.15-1.9x faster
from 1 to 2048 rows (``benchmarks/cpu_linear.py``, ``docs/performance.md``).
``LAMINA_CPU_LINEAR=torch`` turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("lamina.kernels")

_PACK_ROWS = 512
"""The row count oneDNN packs for: measured best across 1-2048 rows of all hints tried."""


class TorchLinear:
    """``x @ weight.T + bias`` by ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDnnLinear:
    """``x @ weight.T + bias`` by oneDNN, on a weight packed into its blocked layout (the
    plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


Linear = TorchLinear | OneDnnLinear
_logged: set[str] = set()


def linear_factory(
    device: torch.device, dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor | None], Linear]:
    """The linear implementation for weights of ``dtype`` on ``device`` (logged once)."""
    requested = os.environ.get("LAMINA_CPU_LINEAR", "").strip().lower()
    if requested not in ("", "onednn", "torch"):
        raise ValueError(f"LAMINA_CPU_LINEAR={requested!r}: choose onednn or torch")
    onednn = (
        device.type == "cpu"
        and dtype == torch.float32
        and requested != "torch"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
    choice = "onednn" if onednn else "torch"
    if choice not in _logged:
        _logged.add(choice)
        log.info("linear layers: %s (%s, %s)", choice, device.type, dtype)
    return OneDnnLinear if onednn else TorchLinear
