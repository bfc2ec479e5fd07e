"""What ``dtype="auto"`` runs a checkpoint in: the dtype its activations (and unquantized
weights) take, chosen from the checkpoint and the device.

On CUDA, ``auto`` is the checkpoint's own dtype. On the CPU, the checkpoint's dtype is
often one the CPU cannot compute in fast, and a checkpoint's dtype is no request for
one: most are saved in bf16 or fp16 whatever they will run on. There:

* **Quantized weights** (``--quantization``, or a GPTQ, AWQ or fp8 checkpoint) run in
  fp32: the native quantized matmul takes fp32 activations, and in any other dtype each
  linear dequantizes its whole weight on every call (a bf16 checkpoint with ``int8``:
  ~24x slower a token at batch 1 than in fp32).
* **bf16 weights** run in bf16 where the CPU multiplies bf16 in hardware (AMX or AVX-512
  BF16: oneDNN's bf16 matmul, ~2x fp32's tokens/s at 32 streams); elsewhere in fp32 with
  the weights kept in bf16 (``quantization="bf16"``: exact, half of fp32's memory, and the
  native matmul reads them as they are, where a bf16 model would run emulated or on
  torch's reference kernels).
* **fp16 weights** run in fp32, the weights widened exactly: the CPU kernels have no fp16
  path (fp16 runs torch's reference ops, ~1.75x slower a token at batch 1).
* fp32 weights run in fp32.

An explicit ``dtype`` is always run as asked. The engine resolves ``auto`` once, before
it starts any other rank, so that every rank (on any host) runs the same dtype.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.model_config import ModelConfig

log = logging.getLogger("lamina.engine")


def cpu_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX-512 BF16)."""
    cpu = torch.cpu
    return cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported()


def resolve_dtype(
    config: EngineConfig, model_config: ModelConfig, bf16_matmul: bool | None = None
) -> EngineConfig:
    """``config`` with ``dtype="auto"`` replaced by what the checkpoint runs in on
    ``config.device`` (see the module's docstring), and ``quantization="bf16"`` where a
    bf16 checkpoint keeps its weights under fp32 activations; ``bf16_matmul``: whether the
    CPU multiplies bf16 in hardware (None: this CPU's, :func:`cpu_bf16_matmul`)."""
    if config.dtype != "auto":
        return config
    stored = model_config.dtype
    if torch.device(config.device).type != "cpu":
        return dataclasses.replace(config, dtype=_name(stored))
    quantized = config.quantization is not None or model_config.quantization is not None
    quantization = config.quantization
    if quantized or stored in (torch.float32, torch.float16):
        dtype = torch.float32
    elif bf16_matmul if bf16_matmul is not None else cpu_bf16_matmul():
        dtype = torch.bfloat16
    else:
        dtype, quantization = torch.float32, "bf16"
    if dtype != stored:
        stored_format = model_config.quantization and model_config.quantization.weight_format
        weights = config.quantization or stored_format or _name(stored)
        kept = " (kept in bf16)" if quantization == "bf16" and not quantized else ""
        log.info("dtype auto: %s for %s weights%s on the CPU", _name(dtype), weights, kept)
    return dataclasses.replace(config, dtype=_name(dtype), quantization=quantization)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
