"""Which implementation of the device ops the engine runs.

* ``triton`` on CUDA (on CPU only under ``TRITON_INTERPRET=1``: slow, for tests).
* ``cpu`` on CPU for fp32 and bf16 models: the native kernels of
  :mod:`lamina.kernels.cpu` (decode attention, fused RMSNorm, SiLU-and-mul, rotary;
  compiled on first use; if that fails, the reason is logged and the engine runs
  ``reference``), the reference for the rest.
* ``reference``: the torch reference ops, everywhere else.

``LAMINA_KERNELS=triton|cpu|reference`` overrides the choice. It is logged once per
process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lamina.libs.config import process_env

log = logging.getLogger("lamina.kernels")
_logged: set[str] = set()
BACKENDS = ("triton", "cpu", "reference")
CPU_DTYPES = (torch.float32, torch.bfloat16)
"""What the ``cpu`` backend's kernels take (its fused decode step: fp32 only)."""


def _cpu_kernels_build() -> str | None:
    """None if the native CPU kernels load, else why not."""
    from lamina.kernels.cpu import BuildError, load_library

    try:
        load_library()
    except BuildError as exc:
        return str(exc)
    return None


def choose_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    requested = process_env().kernels.lower()
    if requested and requested not in BACKENDS:
        raise ValueError(f"LAMINA_KERNELS={requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested:
        backend, reason = requested, "LAMINA_KERNELS"
    elif device.type == "cuda":
        backend, reason = "triton", "device cuda"
    elif dtype not in CPU_DTYPES:
        backend, reason = "reference", f"device {device.type}, {dtype}"
    else:
        backend, reason = "cpu", f"device {device.type}, {dtype}"
    if backend == "cpu":
        if device.type != "cpu" or dtype not in CPU_DTYPES:
            raise ValueError(
                f"the cpu kernels run fp32 or bf16 on the CPU, not {dtype} on {device}"
            )
        failure = _cpu_kernels_build()
        if failure is not None:
            if requested:
                raise RuntimeError(f"LAMINA_KERNELS=cpu: {failure}")
            backend, reason = "reference", f"native CPU kernels unavailable: {failure}"
    key = f"{backend} ({reason})"
    if key not in _logged:
        _logged.add(key)
        log.info("kernels: %s", key)
    return backend


@dataclass(frozen=True)
class KernelOps:
    """The ops of one kernel backend, as the model calls them; each backend module
    (``reference``, ``cpu``, ``triton``) has a function of each name with the same
    signature."""

    backend: str
    """``reference``, ``cpu`` or ``triton``."""
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    write_kv_cache: Callable
    paged_attention: Callable
    dense_decodes: bool
    """Whether attention reads decodes through the padded dense view of
    :class:`~lamina.kernels.reference.AttentionMetadata` (the reference gathers blocks)."""
    dense_prefill: bool
    """Whether attention reads prefill chunks through the padded dense view."""


def load_ops(device: torch.device, dtype: torch.dtype = torch.float32) -> KernelOps:
    """The ops of the backend chosen for ``device`` and the model's ``dtype``."""
    from lamina.kernels import reference

    backend = choose_backend(device, dtype)
    if backend == "triton":
        from lamina.kernels import triton as impl
    elif backend == "cpu":
        from lamina.kernels import cpu as impl
    else:
        impl = reference
    return KernelOps(
        backend=backend,
        rms_norm=impl.rms_norm,
        apply_rotary=impl.apply_rotary,
        silu_and_mul=impl.silu_and_mul,
        write_kv_cache=impl.write_kv_cache,
        paged_attention=impl.paged_attention,
        dense_decodes=backend == "reference",
        dense_prefill=backend != "triton",
    )
