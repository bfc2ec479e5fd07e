"""Linear layers, with their weights prepared once at load.

On GPUs a linear is ``F.linear``. On CPUs in bf16 with AVX-512 BF16 and the ``cpu``
kernels, it is ``native``: :class:`~lamina.kernels.cpu.bf16_linear.PackedBf16Linear`, on
one pair-interleaved layout, AMX tiles from 8 rows where there is AMX and ``vdpbf16ps``
below (~1.5x oneDNN's packed bf16 matmul at 1 and 32 rows, as fast from 128,
``benchmarks/cpu_linear.py --bf16``). Elsewhere in bf16 where oneDNN has bf16 matmuls
(:func:`onednn_bf16`), it is ``onednn`` below: ``F.linear`` in bf16 hands oneDNN the plain
weight, which it reorders into its blocked layout on every call (1.4-1.7x the packed
matmul's time up to 128 rows on AMX). On x86 CPUs in fp32:

* ``onednn``: each weight is packed for oneDNN at load and oneDNN's matmul runs on it. On
  the small-batch shapes that decoding makes, ``F.linear`` goes to MKL's sgemm, which on
  the AMD EPYC this project is measured on slows down sharply for a few rows; oneDNN's
  packed matmul is faster at every row count (``benchmarks/cpu_linear.py``).
* ``native`` (the default with the ``cpu`` kernel backend on AVX2, :func:`native_linear`): the
  blocked matmul on a weight packed once at load (``kernels/cpu/gemm.cpp``), at every row
  count: faster than oneDNN's from 64 rows up and as fast as a matrix-vector kernel at
  one row (figures in ``docs/performance.md``). Small weights stay on ``F.linear``.

``LAMINA_CPU_LINEAR=native|onednn|torch`` overrides the choice.

Quantized weights (int8, fp8, int4: :mod:`lamina.kernels.weight_quant`) run on the native
matmul for fp32 on an AVX2 CPU with the ``cpu`` kernels (:class:`~lamina.kernels.cpu.linear.
PackedQuantLinear`, every size: a quantized model's linears are all quantized), on the
Triton W8A16 / W4A16 kernel with the ``triton`` backend on CUDA
(:class:`~lamina.kernels.triton.quant_linear.TritonQuantLinear`), and elsewhere on
:class:`DequantLinear`, the reference, which dequantizes on every call.

The MLP's gate and up projections are one :data:`GatedLinear`, ``silu(x @ gate.T) * (x @
up.T)`` (:func:`gated_linear_factory`): with the native fp32 matmul, one fused call
(:class:`~lamina.kernels.cpu.linear.PackedSiluMul`) that never makes the ``(T, 2I)``
intermediate, and likewise with the native bf16 matmul
(:class:`~lamina.kernels.cpu.bf16_linear.PackedBf16SiluMul`, which ``decode.cpp`` runs
too); elsewhere the linear followed by the backend's ``silu_and_mul``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lamina.kernels.cpu import bf16_linear
from lamina.kernels.cpu.bf16_linear import PackedBf16Linear, PackedBf16SiluMul
from lamina.kernels.cpu.build import vectorized
from lamina.kernels.cpu.linear import (
    PackedLinear,
    PackedQuantLinear,
    PackedQuantSiluMul,
    PackedSiluMul,
)
from lamina.kernels.weight_quant import QuantizedWeight, quantize
from lamina.libs.config import process_env

log = logging.getLogger("lamina.kernels")

_PACK_ROWS = 512
"""The row count oneDNN packs for: measured best across 1-2048 rows of all hints tried."""

NATIVE_MIN_ELEMENTS = 1 << 17
"""Weights smaller than this (512 KiB in fp32) stay on ``F.linear`` in :func:`native_linear`:
below it the native matmul's fixed cost per call outweighs its speed at one row (measured
per shape, 16K-524K elements at 1-512 rows)."""

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


class DequantLinear:
    """``x @ weight.dequantize().T + bias`` by ``F.linear`` on the weight dequantized to
    ``x``'s dtype on every call: the reference for quantized weights (it keeps only the
    quantized weight, and pays for that with a full-size temporary per call)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        order = self.weight.input_order
        if order is not None:  # the weight's inputs are stored reordered
            x = x.index_select(-1, order)
        return F.linear(x, self.weight.dequantize_stored(x.dtype), self.bias)


def native_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> TorchLinear | PackedLinear:
    """The faster of two on an fp32 CPU: ``F.linear`` for a small weight (under
    :data:`NATIVE_MIN_ELEMENTS`), otherwise the native blocked matmul on a packed copy
    (:class:`~lamina.kernels.cpu.linear.PackedLinear`; the plain weight is not kept)."""
    if weight.numel() < NATIVE_MIN_ELEMENTS:
        return TorchLinear(weight, bias)
    return PackedLinear(weight, bias)


Linear = TorchLinear | OneDnnLinear | PackedLinear | PackedBf16Linear | DequantLinear


class SiluMulLinear:
    """``silu_and_mul(linear(x))`` for a ``linear`` over ``[gate; up]``: the gated MLP input
    as two kernels."""

    def __init__(self, linear: Linear, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]):
        self.linear, self.silu_and_mul = linear, silu_and_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x))

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """``[gate; up]`` before the activation (what a LoRA adds to)."""
        return self.linear(x)


GatedLinear = SiluMulLinear | PackedSiluMul | PackedBf16SiluMul

Weight = torch.Tensor | QuantizedWeight
"""A linear's weight as the model hands it over: plain, or already quantized."""

_logged: set[str] = set()


def linear_factory(
    device: torch.device,
    dtype: torch.dtype,
    backend: str = "reference",
    quantization: str | None = None,
) -> Callable[[Weight, torch.Tensor | None], Linear]:
    """The linear implementation for weights of ``dtype`` on ``device`` next to the kernel
    ``backend`` (see :mod:`lamina.kernels.dispatch`); logged once. With ``quantization``
    (a format of :mod:`lamina.kernels.weight_quant`), each plain weight is quantized to
    it first and every linear runs on the quantized weight; a weight that comes quantized
    (a quantized checkpoint) runs as it is either way."""
    plain = _plain_linear(device, dtype, backend)
    quantized = _quantized_linear(device, dtype, backend)
    if quantization is not None:
        _log_once(f"{quantized.__name__} ({quantization} weights, {device.type}, {dtype})")

    def make(weight: Weight, bias: torch.Tensor | None) -> Linear:
        if isinstance(weight, torch.Tensor) and quantization is not None:
            weight = quantize(weight, quantization)
        if isinstance(weight, QuantizedWeight):
            return quantized(weight, bias)
        return plain(weight, bias)

    return make


def _quantized_linear(device: torch.device, dtype: torch.dtype, backend: str) -> type:
    """What runs a quantized weight (see the module's docstring)."""
    if _native_quantized(device, dtype, backend):
        return PackedQuantLinear
    if device.type == "cuda" and backend == "triton":
        from lamina.kernels.triton.quant_linear import TritonQuantLinear

        return TritonQuantLinear
    return DequantLinear


def _native_quantized(device: torch.device, dtype: torch.dtype, backend: str) -> bool:
    """Whether quantized weights run on the native matmul: fp32 on an AVX2 CPU with the
    ``cpu`` kernels, unless ``LAMINA_CPU_LINEAR`` asks for another fp32 linear."""
    requested = process_env().cpu_linear.lower()
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and backend == "cpu"
        and vectorized()
        and requested in ("", "native")
    )


def _plain_linear(
    device: torch.device, dtype: torch.dtype, backend: str
) -> Callable[[torch.Tensor, torch.Tensor | None], Linear]:
    """What runs an unquantized weight (see the module's docstring)."""
    requested = process_env().cpu_linear.lower()
    if requested and requested not in CHOICES:
        raise ValueError(f"LAMINA_CPU_LINEAR={requested!r}: choose one of {', '.join(CHOICES)}")
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and bf16_linear.available()
    onednn = (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16()))
    )
    if requested == "native" and not ((cpu_fp32 or cpu_bf16) and backend == "cpu"):
        raise ValueError(
            "LAMINA_CPU_LINEAR=native needs fp32 (or bf16 on a CPU with AVX-512 BF16) on the "
            "CPU with the cpu kernels"
        )
    make: Callable[[torch.Tensor, torch.Tensor | None], Linear]
    # The matmul's micro-kernel is AVX2; without it (e.g. on ARM) oneDNN is the default.
    default_native = ((cpu_fp32 and vectorized()) or cpu_bf16) and backend == "cpu"
    if requested == "native" or (not requested and default_native):
        choice, make = "native", PackedBf16Linear if cpu_bf16 else native_linear
    elif onednn and requested != "torch":
        choice, make = "onednn", OneDnnLinear
    else:
        choice, make = "torch", TorchLinear
    _log_once(f"{choice} ({device.type}, {dtype})")
    return make


def onednn_bf16() -> bool:
    """Whether oneDNN has bf16 matmuls on this CPU: AVX-512 (with AMX or AVX-512 BF16 in
    hardware, else emulated) or ARM's BF16; on AVX2 alone it has none."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _log_once(choice: str) -> None:
    if choice not in _logged:
        _logged.add(choice)
        log.info("linear layers: %s", choice)


def gated_linear_factory(
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    quantization: str | None = None,
) -> Callable[[Weight, torch.Tensor | None], GatedLinear]:
    """What makes the MLP's gated input projection from ``gate_up`` ``(2I, K)`` (``[gate;
    up]``) and its bias: the fused native matmul where :func:`linear_factory` chooses a
    native linear (for an fp32 weight, one that is not small), else that linear and
    ``silu_and_mul``. ``quantization`` as for :func:`linear_factory`."""
    make = linear_factory(device, dtype, backend, quantization)
    plain = _plain_linear(device, dtype, backend)
    plain_native = plain is native_linear
    quantized_native = _native_quantized(device, dtype, backend)

    def gated(gate_up: Weight, bias: torch.Tensor | None) -> GatedLinear:
        if isinstance(gate_up, torch.Tensor) and quantization is not None:
            gate_up = quantize(gate_up, quantization)
        if isinstance(gate_up, QuantizedWeight):
            if quantized_native:
                return PackedQuantSiluMul(gate_up, bias)
        elif plain_native and gate_up.numel() >= NATIVE_MIN_ELEMENTS:
            return PackedSiluMul(gate_up, bias)
        elif plain is PackedBf16Linear:
            return PackedBf16SiluMul(gate_up, bias)
        return SiluMulLinear(make(gate_up, bias), silu_and_mul)

    return gated
