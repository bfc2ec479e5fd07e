"""Linear layers, with their weights prepared once at load.

On GPUs (and for dtypes other than fp32) a linear is ``F.linear``. On x86 CPUs in fp32:

* ``onednn``: each weight is packed for oneDNN at load and oneDNN's matmul runs on it. On
  the small-batch shapes that decoding makes, ``F.linear`` goes to MKL's sgemm, which on
  the AMD EPYC this project is measured on slows down sharply for a few rows; oneDNN's
  packed matmul is 1.15-1.9x faster from 1 to 2048 rows (``benchmarks/cpu_linear.py``).
* ``native`` (the default with the ``cpu`` kernel backend, :class:`CpuLinear`): oneDNN as
  above, except that up to :data:`SKINNY_ROWS` rows go to the native skinny kernel
  (``kernels/cpu/skinny_linear.cpp``), which streams the weight once at close to the
  machine's read bandwidth where oneDNN reaches about 80% of it, and small weights stay
  on ``F.linear``. It keeps the plain weight next to the packed one: twice the weight
  memory.

``LAMINA_CPU_LINEAR=native|onednn|torch`` overrides the choice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lamina.kernels.cpu.linear import skinny_linear

log = logging.getLogger("lamina.kernels")

_PACK_ROWS = 512
"""The row count oneDNN packs for: measured best across 1-2048 rows of all hints tried."""

SKINNY_ROWS = 4
"""Up to this many rows the native skinny kernel beats oneDNN's packed matmul (measured
with ``benchmarks/cpu_linear.py``; past it the kernel turns compute-bound)."""

ONEDNN_MIN_ELEMENTS = 1 << 18
"""Weights smaller than this (1 MiB in fp32) stay on ``F.linear`` in :class:`CpuLinear`:
oneDNN costs ~40 us more per call, and MKL was faster below ~130K elements at 16-512 rows
and slower from 262K up (measured per shape, weights hot in cache)."""

CHOICES = ("native", "onednn", "torch")


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


class CpuLinear:
    """The fastest of three on an fp32 CPU: ``F.linear`` for small weights (under
    :data:`ONEDNN_MIN_ELEMENTS`, where oneDNN's fixed cost per call outweighs its speed),
    otherwise the native skinny kernel for up to :data:`SKINNY_ROWS` rows and oneDNN's
    packed matmul for more (the plain weight kept as well as the packed one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight.contiguous(), bias
        self.packed = OneDnnLinear(weight, bias) if weight.numel() >= ONEDNN_MIN_ELEMENTS else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] <= SKINNY_ROWS:
            return skinny_linear(x, self.weight, self.bias)
        return self.packed(x)


Linear = TorchLinear | OneDnnLinear | CpuLinear
_logged: set[str] = set()


def linear_factory(
    device: torch.device, dtype: torch.dtype, backend: str = "reference"
) -> Callable[[torch.Tensor, torch.Tensor | None], Linear]:
    """The linear implementation for weights of ``dtype`` on ``device`` next to the kernel
    ``backend`` (see :mod:`lamina.kernels.dispatch`); logged once."""
    requested = os.environ.get("LAMINA_CPU_LINEAR", "").strip().lower()
    if requested and requested not in CHOICES:
        raise ValueError(f"LAMINA_CPU_LINEAR={requested!r}: choose one of {', '.join(CHOICES)}")
    onednn = (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
    if requested == "native" and not (onednn and backend == "cpu"):
        raise ValueError("LAMINA_CPU_LINEAR=native needs fp32 on the CPU with the cpu kernels")
    if requested == "torch" or not onednn:
        choice, cls = "torch", TorchLinear
    elif requested == "onednn" or backend != "cpu":
        choice, cls = "onednn", OneDnnLinear
    else:
        choice, cls = "native", CpuLinear
    if choice not in _logged:
        _logged.add(choice)
        log.info("linear layers: %s (%s, %s)", choice, device.type, dtype)
    return cls
