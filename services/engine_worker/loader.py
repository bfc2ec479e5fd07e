"""Read checkpoint tensors from one or many ``*.safetensors`` files with exact shape checks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lamina.kernels.weight_quant import QuantizedWeight
from lamina.services.engine_worker.errors import ModelLoadError


class CheckpointTensors:
    """Every tensor of a Hugging Face checkpoint directory, taken one by one by name.

    Sharded checkpoints are read through ``model.safetensors.index.json``; a single file
    needs no index. Errors name the file and tensor at fault.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] = {}
        self._source: dict[str, Path] = {}
        for file in self._files():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        self._tensors[name] = handle.get_tensor(name)
                        self._source[name] = file
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelLoadError(str(file), f"cannot read safetensors: {exc}") from exc

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(str(index), f"no readable weight_map: {exc}") from exc
            files = [self.path / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.exists():
                    raise ModelLoadError(str(file), f"shard listed in {index.name} is missing")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(str(self.path), "no *.safetensors file in the model directory")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Remove and return tensor ``name``, checked against ``shape`` and cast to ``dtype``."""
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name}", "missing from the checkpoint")
        tensor = self._tensors.pop(name)
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{self._source[name]}: tensor {name}",
                f"shape {tuple(tensor.shape)} does not match the config's {shape}",
            )
        return tensor.to(dtype)

    def take_linear(
        self, prefix: str, shape: tuple[int, int], dtype: torch.dtype
    ) -> torch.Tensor | QuantizedWeight:
        """Remove and return the linear ``prefix``'s weight: cast to ``dtype``, or, stored as
        fp8 (e4m3) with its ``weight_scale`` (one per tensor or per output row), as that
        :class:`QuantizedWeight`. A checkpoint's ``input_scale`` (static activation
        scales) is removed unused: activations stay in the model's dtype."""
        name = prefix + "weight"
        stored = self._tensors.get(name)
        if stored is None or stored.dtype != torch.float8_e4m3fn:
            return self.take(name, shape, dtype)
        scale_name = prefix + "weight_scale"
        if scale_name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {scale_name}", "an fp8 weight needs it")
        qweight = self.take(name, shape, torch.float8_e4m3fn)
        scale = self._tensors.pop(scale_name).to(torch.float32)
        self._tensors.pop(prefix + "input_scale", None)
        rows = shape[0]
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows).contiguous()
        elif scale.numel() == rows and scale.dim() <= 2 and scale.shape[0] == rows:
            scale = scale.reshape(rows).contiguous()
        else:
            raise ModelLoadError(
                f"{self._source[scale_name]}: tensor {scale_name}",
                f"shape {tuple(scale.shape)}: expected a scalar or one per row ({rows})",
            )
        return QuantizedWeight("fp8", qweight, scale)

    def take_per_head(self, name: str, num_heads: int) -> torch.Tensor:
        """Remove and return ``name``, a scalar or one value per head, as ``(num_heads,)``
        float32 (a scalar is repeated: per-tensor scales such as fp8 ``k_scale``)."""
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name}", "missing from the checkpoint")
        tensor = self._tensors.pop(name).to(torch.float32)
        if tensor.numel() == 1:
            return tensor.reshape(1).expand(num_heads).clone()
        if tuple(tensor.shape) != (num_heads,):
            raise ModelLoadError(
                f"{self._source[name]}: tensor {name}",
                f"shape {tuple(tensor.shape)}: expected a scalar or ({num_heads},)",
            )
        return tensor

    def remaining(self) -> list[str]:
        return sorted(self._tensors)
