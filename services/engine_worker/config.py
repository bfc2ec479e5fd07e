"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and size its batches and KV pool."""

    model: Path
    """Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``)."""
    dtype: str = "auto"
    """Weight/activation dtype: ``auto`` (the checkpoint's own), ``float32``, ``bfloat16``
    or ``float16``."""
    device: str = "cpu"
    """Torch device the model and KV pool live on."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int = 256 << 20
    """Memory budget for the KV pool; the number of blocks is derived from it."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks, overriding ``kv_cache_memory_bytes`` (tests, tiny pools)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_num_seqs: int = 128
    """Most sequences in one step."""
    max_model_len: int | None = None
    """Longest prompt plus output; defaults to the model's ``max_position_embeddings``."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit one step's budget."""
    seed: int = 0
    """Seed of the generator used by requests that carry no seed of their own."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype ({self.dtype!r}) must be auto, float32, bfloat16 or float16")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be positive")
