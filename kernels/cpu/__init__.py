"""Native CPU kernels (C++, compiled on first use): what the engine runs on CPU where a
torch reference op leaves real speed behind. Each keeps its reference op's signature."""

from lamina.kernels.cpu.attention import decode_attention, paged_attention
from lamina.kernels.cpu.build import BuildError, load_library
from lamina.kernels.cpu.elementwise import apply_rotary, rms_norm, silu_and_mul
from lamina.kernels.cpu.linear import (
    PackedLinear,
    PackedQuantLinear,
    PackedQuantSiluMul,
    PackedSiluMul,
)
from lamina.kernels.reference import write_kv_cache  # the reference's scatter is enough

__all__ = [
    "BuildError",
    "PackedLinear",
    "PackedQuantLinear",
    "PackedQuantSiluMul",
    "PackedSiluMul",
    "apply_rotary",
    "decode_attention",
    "load_library",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
