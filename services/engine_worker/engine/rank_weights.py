"""One tensor-parallel rank's share of a checkpoint's tensors, on its device.

What a model's constructor asks for by name and full shape (checked against the
checkpoint); what it gets is this rank's slice: a column-parallel weight's output rows,
a row-parallel weight's input columns (``parallel.py``), plain or as the checkpoint
quantized it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lamina.kernels.linear import Weight
from lamina.kernels.weight_quant import QuantizedWeight, WeightFormat, quantize
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
        quantization: WeightFormat | None = None,
    ) -> None:
        self.weights, self.config = weights, config
        self.quantization = quantization
        """Quantize plain weights at load (``EngineConfig.quantization``): a split one is
        quantized whole, then split, so each rank's rows keep the scales one process
        would use (the same numbers as tensor parallel size 1)."""
        self.dtype, self.device, self.tp = dtype, device, tp
        self.bytes = 0
        """Bytes of every tensor handed out so far: this rank's share of the weights."""

    def take(
        self, name: str, *shape: int, shard_dim: int | None = None, kv: bool = False
    ) -> torch.Tensor:
        """``name`` (checked against its full shape); with ``shard_dim``, this rank's slice
        (``kv``: of KV heads, see :meth:`TensorParallel.shard_kv`)."""
        tensor = self.weights.take(name, shape, self.dtype)
        return self._held(tensor if shard_dim is None else self._split(kv)(tensor, shard_dim))

    def rows(self, name: str, *shape: int, kv: bool = False) -> torch.Tensor:
        """A column-parallel tensor's output rows (a fused projection's bias)."""
        return self.take(name, *shape, shard_dim=0, kv=kv)

    def weight(
        self, prefix: str, *shape: int, shard_dim: int | None = None, kv: bool = False
    ) -> Weight:
        """A linear's weight, plain or as the checkpoint quantized it; with ``shard_dim``
        this rank's output rows (0: column-parallel; ``kv``: a K/V projection's, by KV
        head) or input columns (1)."""
        loaded = self.weights.take_linear(
            prefix, (shape[0], shape[1]), self.dtype, self.config.quantization
        )
        split = shard_dim is not None and self.tp.size > 1
        if isinstance(loaded, torch.Tensor) and split and self.quantization is not None:
            loaded = quantize(loaded, self.quantization)
        if isinstance(loaded, torch.Tensor):
            return self._held(loaded if shard_dim is None else self._split(kv)(loaded, shard_dim))
        placed = _placed(loaded, self._split(kv), shard_dim, self.tp.size, self.device)
        parts = (placed.qweight, placed.scale, placed.zero, placed.input_order)
        self.bytes += sum(t.nbytes for t in parts if t is not None)
        return placed

    def rank0_bias(self, name: str, *shape: int) -> torch.Tensor | None:
        """A row-parallel linear's bias: added once, on rank 0, before the all-reduce sums
        the ranks' partial outputs."""
        if self.tp.rank != 0:
            self.weights.take(name, shape, self.dtype)  # taken: not left over
            return None
        return self.take(name, *shape)

    def kv_scales(self, prefix: str, num_kv_heads: int) -> torch.Tensor | None:
        """``k_scale``/``v_scale`` (vLLM's names for fp8 KV scales), per tensor or per KV
        head, as ``(2, this rank's KV heads)``; None when the checkpoint has none."""
        names = (prefix + "k_scale", prefix + "v_scale")
        if not all(name in self.weights for name in names):
            return None
        scales = torch.stack([self.weights.take_per_head(name, num_kv_heads) for name in names])
        return self.tp.shard_kv(scales, 1, num_kv_heads).to(self.device)

    def _split(self, kv: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """How this rank takes its share along a dimension: by KV head, or evenly."""
        if kv:
            return lambda t, dim: self.tp.shard_kv(t, dim, self.config.num_kv_heads)
        return self.tp.shard

    def _held(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this rank's device, counted in :attr:`bytes`."""
        self.bytes += tensor.nbytes
        return tensor.to(self.device)


def _placed(
    weight: QuantizedWeight,
    split: Callable[[torch.Tensor, int], torch.Tensor],
    dim: int | None,
    size: int,
    device: torch.device,
) -> QuantizedWeight:
    """This rank's share of a quantized weight (its rows for ``dim`` 0, its inputs for 1,
    with their scales and zero points, each taken by ``split``), on ``device``.

    A row-parallel weight whose inputs are stored reordered (act-order GPTQ) is split in
    its stored order, so each rank holds whole groups, and its ``input_order`` says which
    of the layer's inputs they are: inputs of every rank, gathered first
    (:meth:`TensorParallel.gather`, see :func:`reads_every_rank`)."""

    def share(t: torch.Tensor | None, along: int | None) -> torch.Tensor | None:
        if t is None:
            return None
        if along is not None and t.dim() > along:
            if along == 1 and t.shape[1] % size:
                raise ModelLoadError(
                    "quantized weight", f"{t.shape[1]} groups do not split across {size} ranks"
                )
            t = split(t, along)
        return t.to(device)

    return dataclasses.replace(
        weight,
        qweight=share(weight.qweight, dim),
        scale=share(weight.scale, dim),
        zero=share(weight.zero, dim),
        input_order=share(weight.input_order, 0 if dim == 1 else None),
    )


def reads_every_rank(weight: Weight, tp: TensorParallel) -> bool:
    """Whether a row-parallel ``weight`` needs the inputs of every rank, not only this
    rank's slice: its share holds inputs in the stored order of act-order GPTQ, which
    are any of the layer's (split in the model's order, a rank's inputs would fall in
    every group, and no group-wise kernel could take them)."""
    return tp.size > 1 and isinstance(weight, QuantizedWeight) and weight.input_order is not None
