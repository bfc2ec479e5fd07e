"""Torch reference implementations of Lamina's device ops.

These define the semantics every optimised kernel must reproduce, and they are what the
engine runs on CPU. Each op here has the signature its Triton replacement will keep.
"""

from lamina.kernels.reference.activation import silu_and_mul
from lamina.kernels.reference.attention import AttentionMetadata, paged_attention, write_kv_cache
from lamina.kernels.reference.norm import rms_norm
from lamina.kernels.reference.rotary import apply_rotary, rotary_cos_sin, rotary_for_positions

__all__ = [
    "AttentionMetadata",
    "apply_rotary",
    "paged_attention",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_for_positions",
    "silu_and_mul",
    "write_kv_cache",
]
