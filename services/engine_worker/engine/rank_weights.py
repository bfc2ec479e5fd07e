"""One tensor-parallel rank's share of a checkpoint's tensors, on its device.

What a model's constructor asks for by name and full shape (checked against the
checkpoint); what it gets is this rank's slice: a column-parallel weight's output rows,
a row-parallel weight's input columns (``parallel.py``), plain or as the checkpoint
quantized it."""

from __future__ import annotations

import dataclasses

import torch

from lamina.kernels.linear import Weight
from lamina.kernels.weight_quant import QuantizedWeight
from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.loader import CheckpointTensors
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import TensorParallel


class RankWeights:
    """A checkpoint's tensors as rank ``tp.rank`` of ``tp.size`` holds them."""

    def __init__(
        self,
        weights: CheckpointTensors,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel,
    ) -> None:
        self.weights, self.config = weights, config
        self.dtype, self.device, self.tp = dtype, device, tp

    def take(self, name: str, *shape: int, shard_dim: int | None = None) -> torch.Tensor:
        """``name`` (checked against its full shape); with ``shard_dim``, this rank's slice."""
        tensor = self.weights.take(name, shape, self.dtype)
        return (tensor if shard_dim is None else self.tp.shard(tensor, shard_dim)).to(self.device)

    def rows(self, name: str, *shape: int) -> torch.Tensor:
        """A column-parallel tensor's output rows (a fused projection's bias)."""
        return self.take(name, *shape, shard_dim=0)

    def weight(self, prefix: str, *shape: int, shard_dim: int | None = None) -> Weight:
        """A linear's weight, plain or as the checkpoint quantized it; with ``shard_dim``
        this rank's output rows (0: column-parallel) or input columns (1)."""
        loaded = self.weights.take_linear(
            prefix, (shape[0], shape[1]), self.dtype, self.config.quantization
        )
        if isinstance(loaded, torch.Tensor):
            return (loaded if shard_dim is None else self.tp.shard(loaded, shard_dim)).to(
                self.device
            )
        return _placed(loaded, self.tp, shard_dim, self.device)

    def rank0_bias(self, name: str, *shape: int) -> torch.Tensor | None:
        """A row-parallel linear's bias: added once, on rank 0, before the all-reduce sums
        the ranks' partial outputs."""
        bias = self.take(name, *shape)
        return bias if self.tp.rank == 0 else None

    def kv_scales(self, prefix: str, num_kv_heads: int) -> torch.Tensor | None:
        """``k_scale``/``v_scale`` (vLLM's names for fp8 KV scales), per tensor or per KV
        head, as ``(2, this rank's KV heads)``; None when the checkpoint has none."""
        names = (prefix + "k_scale", prefix + "v_scale")
        if not all(name in self.weights for name in names):
            return None
        scales = torch.stack([self.weights.take_per_head(name, num_kv_heads) for name in names])
        return self.tp.shard(scales, 1).to(self.device)


def _placed(
    weight: QuantizedWeight, tp: TensorParallel, dim: int | None, device: torch.device
) -> QuantizedWeight:
    """This rank's share of a quantized weight (its rows for ``dim`` 0, its inputs for 1,
    with their scales and zero points), on ``device``."""

    if weight.input_order is not None and dim == 1 and tp.size > 1:
        raise ModelLoadError(
            "quantized weight", "act-order (reordered) inputs do not split across ranks"
        )

    def share(t: torch.Tensor | None, along: int | None) -> torch.Tensor | None:
        if t is None:
            return None
        if along is not None and t.dim() > along:
            if t.shape[along] % tp.size:
                raise ModelLoadError(
                    "quantized weight",
                    f"{t.shape[along]} groups do not split across {tp.size} ranks",
                )
            t = tp.shard(t, along)
        return t.to(device)

    return dataclasses.replace(
        weight,
        qweight=share(weight.qweight, dim),
        scale=share(weight.scale, dim),
        zero=share(weight.zero, dim),
    )
