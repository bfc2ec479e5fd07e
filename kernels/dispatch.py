"""Which implementation of the device ops the engine runs.

Triton on CUDA, the torch reference elsewhere; ``LAMINA_KERNELS=triton|reference``
overrides (``triton`` on CPU needs ``TRITON_INTERPRET=1``: slow, for tests and debugging).
The choice is logged once per process.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import torch

log = logging.getLogger("lamina.kernels")
_logged: set[str] = set()
BACKENDS = ("triton", "reference")


def choose_backend(device: torch.device) -> str:
    requested = os.environ.get("LAMINA_KERNELS", "").strip().lower()
    if requested and requested not in BACKENDS:
        raise ValueError(f"LAMINA_KERNELS={requested!r}: choose one of {', '.join(BACKENDS)}")
    backend = requested or ("triton" if device.type == "cuda" else "reference")
    if backend not in _logged:
        _logged.add(backend)
        reason = "LAMINA_KERNELS" if requested else f"device {device.type}"
        log.info("kernels: %s (%s)", backend, reason)
    return backend


def load_ops(device: torch.device) -> SimpleNamespace:
    """The five ops (``rms_norm``, ``apply_rotary``, ``silu_and_mul``, ``write_kv_cache``,
    ``paged_attention``) of the backend chosen for ``device``."""
    backend = choose_backend(device)
    if backend == "triton":
        from lamina.kernels import triton as impl
    else:
        from lamina.kernels import reference as impl
    return SimpleNamespace(
        backend=backend,
        rms_norm=impl.rms_norm,
        apply_rotary=impl.apply_rotary,
        silu_and_mul=impl.silu_and_mul,
        write_kv_cache=impl.write_kv_cache,
        paged_attention=impl.paged_attention,
    )
