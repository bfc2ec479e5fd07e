"""Tensor parallelism across the devices of one host (Megatron-style).

Attention is split by heads and the MLP by its intermediate dimension: Q/K/V and
gate/up are column-parallel (each rank holds a slice of the output rows), O and down are
row-parallel (a slice of the input columns) and their partial outputs are summed with one
all-reduce each per layer. Embeddings, norms and the LM head are replicated. With
``size == 1`` every method is the identity, which is what the engine runs today; the
model-level split is tested with two CPU processes over gloo.
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
        """This rank's share: heads and MLP width divided by ``size``."""
        if self.size == 1:
            return config
        for field in ("num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(config, field)
            if value % self.size:
                raise ModelLoadError(
                    f"config: {field}",
                    f"{value} is not divisible by tensor parallel size {self.size}",
                )
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=config.num_kv_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
        )

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim``."""
        if self.size == 1:
            return tensor
        n = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * n, n).contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of all ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor


SINGLE = TensorParallel()
