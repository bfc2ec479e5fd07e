"""One rank's model and KV pool, built the same way by the engine (rank 0) and by each
of its other ranks (``rank_group.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lamina.services.engine_worker.engine.auto_dtype import resolve_dtype
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.cuda_graphs import DecodeGraphs
from lamina.services.engine_worker.engine.kv_tier import DISK, HOST
from lamina.services.engine_worker.engine.loader import CheckpointTensors
from lamina.services.engine_worker.engine.lora import LoraSlots
from lamina.services.engine_worker.engine.model import CausalLM
from lamina.services.engine_worker.engine.model_config import DTYPES, ModelConfig
from lamina.services.engine_worker.engine.parallel import PipelineStage, TensorParallel
from lamina.services.engine_worker.engine.runner import ModelRunner, kv_block_bytes


@dataclass(frozen=True)
class Shard:
    """A rank's share of the model, loaded on its device, before its KV pool is sized."""

    config: EngineConfig
    model_config: ModelConfig
    model: CausalLM
    device: torch.device
    max_model_len: int

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes on this rank (its KV heads, all layers)."""
        return kv_block_bytes(self.model, self.config.block_size, self.config.kv_cache_dtype)

    @property
    def max_blocks(self) -> int:
        """The KV blocks this rank's budget holds (``kv_cache_memory_bytes`` is per rank)."""
        return self.blocks_in_budget()

    def blocks_in_budget(self, beside: int = 0) -> int:
        """The KV blocks this rank's budget holds when each block also pays ``beside``
        bytes (a draft model's KV for the same tokens), unless ``num_kv_blocks`` says."""
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        return config.kv_budget_bytes(self.device) // (self.block_bytes + beside)

    @property
    def graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (the pool's last block pads them)."""
        return self.config.graphs_for(self.device, self.model.ops.backend)

    def tier_slots(self) -> dict[int, int]:
        """The blocks each lower tier (by number: ``kv_tier.HOST``, ``DISK``) holds in
        this rank's ``kv_offload_bytes`` and ``kv_offload_disk_bytes``; none where 0."""
        budgets = {HOST: self.config.kv_offload_bytes, DISK: self.config.kv_offload_disk_bytes}
        slots = {number: budget // self.block_bytes for number, budget in budgets.items()}
        return {number: n for number, n in slots.items() if n}

    def runner(self, num_blocks: int, tier_slots: dict[int, int] | None = None) -> ModelRunner:
        """The KV pool of ``num_blocks`` blocks and the runner over it (with its decode
        graphs, captured now, where they apply), and lower tiers of ``tier_slots``."""
        config = self.config
        runner = ModelRunner(
            self.model, num_blocks, config.block_size, self.device, config.kv_cache_dtype
        )
        for number, slots in (tier_slots or {}).items():
            runner.add_tier(number, slots, Path(config.kv_offload_dir) if number == DISK else None)
        if self.graphs:
            runner.decode_graphs = DecodeGraphs(
                self.model,
                runner.kv_caches,
                runner.kv_scales,
                config.block_size,
                self.max_model_len,
                config.max_num_seqs,
                pad_block=num_blocks - 1,
                capture=self.device.type == "cuda",
            )
        return runner

    def lora_slots(self) -> LoraSlots | None:
        """This rank's device slots of LoRA adapters (None: LoRA is off)."""
        config = self.config
        if not config.enable_lora:
            return None
        model = self.model
        return LoraSlots(
            model.local, config.max_loras, config.max_lora_rank, model.dtype, self.device
        )


def load_shard(
    config: EngineConfig, tp: TensorParallel, pp: PipelineStage, device: torch.device
) -> Shard:
    """One rank's share of ``config.model`` (its stage's layers, its tensor-parallel
    slice of them) on ``device``."""
    assert config.model is not None, "the worker resolves the default model first"
    model_config = ModelConfig.from_dir(config.model)
    config = resolve_dtype(config, model_config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = CausalLM(
        model_config,
        CheckpointTensors(config.model),
        DTYPES[config.dtype],
        device,
        tp,
        quantization=config.quantization,
        pp=pp,
    )
    _return_freed_memory()
    if device.type == "cpu":
        _keep_step_buffers()
    return Shard(config, model_config, model, device, config.max_len_for(model_config))


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the system. Loading frees a whole tensor per
    weight (read, sliced, packed); glibc's allocator, whose mmap threshold rises after
    such frees, keeps many of those pages, and a rank would keep about half again its
    share of the weights resident (``benchmarks/parallel.py``'s memory part)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_HEAP_LIMIT_BYTES = 1 << 30


def _keep_step_buffers() -> None:
    """Serve a step's large temporaries from the heap, and keep them there when freed.
    glibc maps each allocation above its mmap threshold (at most 32 MB however it adapts)
    afresh, faults it in page by page and unmaps it at free; a prefill chunk's widest
    activation passes that (2,048 tokens of `small`'s gate/up before a LoRA adds to it:
    34 MB), so every layer of every such step paid it: a tenth of the step. Allocations
    above 1 GB (the KV pool) are still mapped of their own. Called after loading, whose
    freed pages :func:`_return_freed_memory` has given back."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_LIMIT_BYTES)
            libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_LIMIT_BYTES)
