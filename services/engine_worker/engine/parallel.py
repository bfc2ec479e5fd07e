"""Tensor parallelism across the devices of one host (Megatron-style).

Attention is split by heads and the MLP by its intermediate dimension: Q/K/V and
gate/up are column-parallel (each rank holds a slice of the output rows), O and down are
row-parallel (a slice of the input columns) and their partial outputs are summed with one
all-reduce each per layer. Embeddings, norms and the LM head are replicated. With fewer
KV heads than ranks (grouped-query attention at a high degree), each KV head is
replicated on ``size / num_kv_heads`` ranks, as vLLM does: a rank's query heads all read
one KV head, so it holds that one. With ``size == 1`` every method is the identity. The
ranks are processes (``rank_group.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None
    """The ``torch.distributed`` process group (None: the default group)."""

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """This rank's share: query heads and MLP width divided by ``size``; KV heads
        divided too, or one (replicated) where there are fewer than ranks."""
        if self.size == 1:
            return config
        for field in ("num_heads", "intermediate_size"):
            value = getattr(config, field)
            if value % self.size:
                raise ModelLoadError(
                    f"config: {field}",
                    f"{value} is not divisible by tensor parallel size {self.size}",
                )
        kv = config.num_kv_heads
        if kv % self.size and self.size % kv:
            raise ModelLoadError(
                "config: num_key_value_heads",
                f"{kv} KV heads neither divide across nor replicate evenly over "
                f"{self.size} tensor-parallel ranks",
            )
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=self.kv_heads(kv)[1],
            intermediate_size=config.intermediate_size // self.size,
        )

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first, count)`` of the KV heads this rank holds: its equal share, or the
        one its query heads read when there are fewer KV heads than ranks."""
        return self.rank * num_kv_heads // self.size, max(1, num_kv_heads // self.size)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim``."""
        if self.size == 1:
            return tensor
        n = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * n, n).contiguous()

    def shard_kv(self, tensor: torch.Tensor, dim: int, num_kv_heads: int) -> torch.Tensor:
        """This rank's KV heads of ``tensor``, whose ``dim`` is ``num_kv_heads`` equal
        parts (a K/V projection's rows, its bias, its per-head scales)."""
        if self.size == 1:
            return tensor
        first, count = self.kv_heads(num_kv_heads)
        per_head = tensor.shape[dim] // num_kv_heads
        return tensor.narrow(dim, first * per_head, count * per_head).contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of all ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor


SINGLE = TensorParallel()
