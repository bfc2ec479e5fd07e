"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from lamina.kernels.reference.kv_quant import KvCacheDtype
from lamina.kernels.weight_quant import WeightFormat
from lamina.services.engine_worker.engine.lora import LoraModules
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and size its batches and KV pool."""

    model: Path | None = None
    """Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``). ``None``:
    Lamina's default model, made on first use (or by ``lamina model init``) in
    ``$LAMINA_HOME/models/lamina-tiny`` (``LAMINA_HOME``: ``~/.cache/lamina``); the worker
    resolves it before it builds the engine, which needs a directory."""
    dtype: Dtype = "auto"
    """Weight/activation dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``: on CUDA
    the checkpoint's own; on the CPU what its kernels run fast, fp32 for quantized, fp16
    and fp32 weights, bf16 for bf16 weights where the CPU has a bf16 matmul (AMX or
    AVX-512 BF16), else fp32 with the weights kept in bf16 (``auto_dtype.py``)."""
    quantization: WeightFormat | None = None
    """Quantize every linear's weight at load (weight-only: activations keep ``dtype``):
    ``int8`` or ``fp8`` (e4m3), each with a scale per output channel, or ``bf16`` (on the
    CPU with ``dtype="float32"``: half the bytes of fp32 weights, exact for a bf16
    checkpoint) (:mod:`lamina.kernels.weight_quant`). ``None``: the checkpoint's weights as
    they are."""
    device: str = "cpu"
    """Torch device the model and KV pool live on (with several ranks, rank 0's: rank
    ``r`` takes the ``r``-th CUDA device after it)."""
    tensor_parallel_size: int = 1
    """Processes (ranks) the model is split across, by attention heads and MLP columns
    (``parallel.py``): this process is rank 0, and starts the others
    (``rank_group.py``). The KV heads must divide evenly across the ranks, or the ranks
    evenly across them (each KV head is then replicated)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split across, contiguous and as even as they divide, each of
    ``tensor_parallel_size`` ranks: the worker has their product of processes (rank 0,
    this one, starts the others). Decode steps then run eagerly (no CUDA graphs)."""
    remote_pipeline_stages: int = 0
    """Of the pipeline stages, how many of the last run on other hosts instead of as this
    worker's processes: their ranks join it over the rendezvous the worker publishes on
    the bus (``lamina node --pipeline-stage <worker id>:<stage>``; ``remote_ranks.py``)."""
    distributed_address: str = ""
    """This host's address that ranks on other hosts reach the worker at (its
    ``torch.distributed`` store and step channel); empty: the loopback address, every
    rank on this host. ``lamina node`` sets it to its ``--address``."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Memory budget for the KV pool (per tensor-parallel rank); the number of blocks is
    derived from it. ``None``:
    256 MiB on CPU; on CUDA, what is free after loading the weights, less the headroom
    that ``gpu_memory_utilization`` leaves for activations."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """KV cache storage: ``auto`` (the model's dtype), ``fp8`` (e4m3 with the checkpoint's
    per-tensor or per-head ``k_scale``/``v_scale``, else 1.0) or ``int8`` (a scale per
    block and KV head). Quantized caches hold 2-4x the tokens in the same memory."""
    gpu_memory_utilization: float = 0.9
    """On CUDA with no explicit budget: the fraction of device memory the engine may use."""
    kv_offload_bytes: int = 0
    """Host memory for a second KV tier, per rank (``kv_tier.py``; pinned on CUDA):
    prefix blocks evicted from the device pool are saved there, and a prefix found there
    is loaded back instead of computed. 0: no host tier."""
    kv_offload_disk_bytes: int = 0
    """Local disk for a third KV tier below the host tier, per rank: a file under
    ``kv_offload_dir`` (mapped: the OS pages it to disk) that takes the blocks the host
    tier evicts (the device pool's, with no host tier). 0: no disk tier (with neither
    tier, an evicted block is gone)."""
    kv_offload_dir: str = ""
    """The directory the disk tier's file is made in (and unlinked from at once: it
    lives while the worker maps it). Required with ``kv_offload_disk_bytes``."""
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
    cuda_graphs: bool | None = None
    """Replay decode-only steps from CUDA graphs captured per batch-size bucket
    (``cuda_graphs.py``). ``None``: on CUDA with the Triton kernels, unless the KV cache is
    int8. ``False``: always eager. ``True`` also on other devices, where the same padded
    static-buffer decode path runs eagerly (tests)."""
    seed: int = 0
    """Seed of the generator used by requests that carry no seed of their own."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (``speculative.py``), as vLLM's flag takes it: a JSON object,
    e.g. ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` or
    ``{"model": "/models/small", "num_speculative_tokens": 4}``. Drafts by prompt lookup
    or by a draft model (``draft_model.py``, on rank 0's device), verified in the
    target's step. None: off."""
    enable_lora: bool = False
    """Serve LoRA adapters of the model (``lora.py``): a request names one as its
    ``model``. On by itself with ``lora_modules``. Not with tensor parallelism or
    pipeline stages yet."""
    lora_modules: LoraModules = field(default_factory=LoraModules)
    """Adapters to load at start, as vLLM's flag takes them: ``name=path`` items (PEFT
    directories), e.g. ``--lora-modules sql=/adapters/sql chat=/adapters/chat``."""
    max_loras: int = 1
    """Adapters one step may use (device slots; the least recently used is replaced)."""
    max_lora_rank: int = 16
    """The highest adapter rank taken (the slots are sized for it)."""

    def max_len_for(self, model: ModelConfig) -> int:
        """The longest sequence this engine runs: the least of the model's positions,
        ``max_model_len`` and the model's sliding window. Raises if a prompt that long
        could not be prefilled at all."""
        limits = (model.max_position_embeddings, self.max_model_len, model.sliding_window)
        longest = min(n for n in limits if n)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < longest:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({longest}) and chunked prefill is off"
            )
        return longest

    def graphs_for(self, device: torch.device, kernels: str) -> bool:
        """Whether decode steps replay CUDA graphs (see ``cuda_graphs``): never across
        pipeline stages, whose steps pass hidden states between processes."""
        if self.pipeline_parallel_size > 1:
            return False
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return device.type == "cuda" and kernels == "triton" and self.kv_cache_dtype != "int8"

    def kv_budget_bytes(self, device: torch.device) -> int:
        """The KV pool's memory budget on ``device`` (call after the weights are loaded)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return max(0, int(free - (1 - self.gpu_memory_utilization) * total))
        return 256 << 20

    def __post_init__(self) -> None:
        if self.model is not None:
            object.__setattr__(self, "model", Path(self.model))
        for name, kind in (
            ("dtype", Dtype),
            ("kv_cache_dtype", KvCacheDtype),
            ("quantization", WeightFormat),  # or None
        ):
            if (value := getattr(self, name)) is not None and value not in typing.get_args(kind):
                choices = ", ".join(typing.get_args(kind))
                raise ValueError(f"{name} ({value!r}) must be one of {choices}")
        if self.quantization == "bf16" and torch.device(self.device).type != "cpu":
            raise ValueError(
                "quantization bf16 (bf16 weights, fp32 activations) is a CPU format: on "
                f"{self.device} run the model in bf16 (dtype bfloat16)"
            )
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs")
        for name in (*positive, "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if not 0 <= self.remote_pipeline_stages < self.pipeline_parallel_size:
            raise ValueError(
                f"remote_pipeline_stages ({self.remote_pipeline_stages}) must be less than "
                f"pipeline_parallel_size ({self.pipeline_parallel_size}): the first stage is "
                "this worker's"
            )
        for name in ("kv_offload_bytes", "kv_offload_disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be 0 or more")
        if bool(self.kv_offload_disk_bytes) != bool(self.kv_offload_dir):
            raise ValueError(
                "kv_offload_disk_bytes and kv_offload_dir go together: the disk tier's size "
                "and the directory its file is made in (the host tier, kv_offload_bytes, "
                "is in memory)"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization ({self.gpu_memory_utilization}) must be in (0, 1]"
            )
        if self.lora_modules and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if self.max_loras <= 0 or self.max_lora_rank <= 0:
            raise ValueError(
                f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}) "
                "must be positive"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be positive")
