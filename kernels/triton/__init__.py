"""Triton kernels: drop-in replacements of ``lamina.kernels.reference`` with the same
signatures. They run natively on CUDA and on CPU under ``TRITON_INTERPRET=1`` (tests)."""

from lamina.kernels.triton.activation import silu_and_mul
from lamina.kernels.triton.attention import paged_attention, write_kv_cache
from lamina.kernels.triton.norm import rms_norm
from lamina.kernels.triton.rotary import apply_rotary

__all__ = ["apply_rotary", "paged_attention", "rms_norm", "silu_and_mul", "write_kv_cache"]
