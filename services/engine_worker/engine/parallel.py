"""How a model splits across ranks: tensor parallelism (Megatron-style) within a
pipeline stage, and pipeline stages of contiguous layers.

Attention is split by heads and the MLP by its intermediate dimension: Q/K/V and
gate/up are column-parallel (each rank holds a slice of the output rows), O and down are
row-parallel (a slice of the input columns) and their partial outputs are summed with one
all-reduce each per layer. Embeddings, norms and the LM head are replicated. With fewer
KV heads than ranks (grouped-query attention at a high degree), each KV head is
replicated on ``size / num_kv_heads`` ranks, as vLLM does: a rank's query heads all read
one KV head, so it holds that one. With ``size == 1`` every method is the identity.

Pipeline parallelism splits the layers into stages (:func:`stage_layers`): the first
stage also holds the embedding, the last the final norm and the LM head. A stage passes
its hidden states and residual, whole, to the same tensor-parallel rank of the next
stage. A worker of ``T`` × ``P`` ranks numbers them stage by stage: global rank
``stage * T + tensor-parallel rank``. The ranks are processes (``rank_group.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    shm: Callable[[torch.Tensor], bool] | None = None
    """An all-reduce through shared memory for ranks of one host, tried first (a
    ``ShmAllReduce``: False for a tensor it does not take, which goes to ``group``)."""

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
        if self.size > 1 and not (self.shm is not None and self.shm(tensor)):
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(..., n)`` slice, in rank order: ``(..., size * n)``. Each rank
        places its slice in zeros and the ranks sum them (:meth:`all_reduce`): exact,
        since adding zeros rounds nothing, and as fast as the all-reduce is."""
        if self.size == 1:
            return tensor
        n = tensor.shape[-1]
        whole = tensor.new_zeros(*tensor.shape[:-1], self.size * n)
        whole[..., self.rank * n : (self.rank + 1) * n] = tensor
        return self.all_reduce(whole)


@dataclass(frozen=True)
class GatheredInput:
    """A row-parallel linear that reads the inputs of every rank, not only this rank's
    slice (act-order GPTQ: see ``rank_weights.reads_every_rank``): gathers them first."""

    linear: Callable[[torch.Tensor], torch.Tensor]
    tp: TensorParallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.tp.gather(x))


SINGLE = TensorParallel()


def stage_layers(num_layers: int, size: int) -> list[range]:
    """Each of ``size`` pipeline stages' layers: contiguous and as even as they divide,
    the first stages one more each when they do not."""
    if num_layers < size:
        raise ModelLoadError(
            "config: num_hidden_layers",
            f"{num_layers} layers cannot fill {size} pipeline stages",
        )
    base, extra = divmod(num_layers, size)
    stages, start = [], 0
    for stage in range(size):
        count = base + (stage < extra)
        stages.append(range(start, start + count))
        start += count
    return stages


@dataclass(frozen=True)
class PipelineStage:
    """One rank's place in the pipeline: its stage, and the ranks it passes hidden states
    between (global ranks; None at either end)."""

    stage: int = 0
    size: int = 1
    prev: int | None = None
    """Where this stage's input comes from (None: the first stage embeds the tokens)."""
    next: int | None = None
    """Where its output goes (None: the last stage computes the logits)."""

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int) -> PipelineStage:
        """Global rank ``rank``'s stage in a worker of ``tp_size`` × ``pp_size`` ranks."""
        stage = rank // tp_size
        return cls(
            stage=stage,
            size=pp_size,
            prev=rank - tp_size if stage > 0 else None,
            next=rank + tp_size if stage < pp_size - 1 else None,
        )

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def layers(self, num_layers: int) -> range:
        """This stage's layers of a model of ``num_layers``."""
        return stage_layers(num_layers, self.size)[self.stage]

    def receive(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual."""
        hidden = torch.empty(shape, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        torch.distributed.recv(hidden, self.prev)
        torch.distributed.recv(residual, self.prev)
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """This stage's hidden states and residual, to the next stage."""
        torch.distributed.send(hidden.contiguous(), self.next)
        torch.distributed.send(residual.contiguous(), self.next)


WHOLE = PipelineStage()
"""One stage: every layer, the embedding and the head."""
