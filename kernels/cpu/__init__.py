"""Native CPU kernels (C++, compiled on first use): what the engine runs on CPU where a
torch reference op leaves real speed behind. Each keeps its reference op's signature."""

from lamina.kernels.cpu.attention import decode_attention, paged_attention
from lamina.kernels.cpu.build import BuildError, load_library

__all__ = ["BuildError", "decode_attention", "load_library", "paged_attention"]
