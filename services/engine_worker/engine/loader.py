"""Read checkpoint tensors from one or many ``*.safetensors`` files with exact shape checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lamina.kernels.weight_quant import QuantizedWeight
from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.model_config import CheckpointQuantization

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
"""Bit offsets of the eight 4-bit codes packed in an int32, lowest first."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which of eight consecutive output columns each nibble of an AWQ int32 holds, lowest
nibble first (AutoAWQ's GEMM packing)."""


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` ``(..., C)`` int32 as ``(..., C, 8)`` codes, lowest nibble first."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def _input_order(
    where: str, g_idx: torch.Tensor | None, inputs: int, group: int
) -> torch.Tensor | None:
    """For a GPTQ ``g_idx`` (each input's group) that is not in order (act-order /
    ``desc_act``), the order of inputs that makes every group contiguous; None when the
    groups already are. A ``g_idx`` whose groups are not ``group`` inputs each is refused."""
    in_order = torch.arange(inputs) // group
    if g_idx is None or torch.equal(g_idx.to(torch.int64), in_order):
        return None
    g_idx = g_idx.to(torch.int64)
    order = torch.sort(g_idx, stable=True).indices
    if g_idx.shape != (inputs,) or not torch.equal(g_idx[order], in_order):
        raise ModelLoadError(where, f"g_idx does not give every group {group} inputs")
    return order


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's int4 layout: ``qweight`` ``(K / 8, N)`` int32, eight inputs per int32 (input
    ``8r + i`` in nibble ``i``); ``qzeros`` ``(G, N / 8)``, eight output columns per int32.
    Returns codes ``(K, N)`` and zero points ``(G, N)`` as stored."""
    codes = _nibbles(qweight).transpose(1, 2).reshape(-1, qweight.shape[1])
    return codes, _nibbles(qzeros).reshape(qzeros.shape[0], -1)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's GEMM layout: ``qweight`` ``(K, N / 8)`` and ``qzeros`` ``(G, N / 8)`` int32,
    eight output columns per int32 in :data:`AWQ_ORDER`. Returns codes ``(K, N)`` and zero
    points ``(G, N)``."""
    column = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j's nibble

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return _nibbles(packed)[..., column].reshape(packed.shape[0], -1)

    return unpack(qweight), unpack(qzeros)


class CheckpointTensors:
    """Every tensor of a Hugging Face checkpoint directory, taken one by one by name.

    Sharded checkpoints are read through ``model.safetensors.index.json``; a single file
    needs no index. Errors name the file and tensor at fault.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tensors = _Lazy()
        for file in self._files():
            try:
                self._tensors.open(file)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelLoadError(str(file), f"cannot read safetensors: {exc}") from exc
        self._source = self._tensors.source

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
        self,
        prefix: str,
        shape: tuple[int, int],
        dtype: torch.dtype,
        quantization: CheckpointQuantization | None = None,
    ) -> torch.Tensor | QuantizedWeight:
        """Remove and return the linear ``prefix``'s ``(N, K)`` weight: cast to ``dtype``;
        or, stored as fp8 (e4m3) with its ``weight_scale`` (one per tensor or per output
        row), as that :class:`QuantizedWeight`; or, in an int4 checkpoint, unpacked from
        its GPTQ or AWQ tensors (:func:`unpack_gptq`, :func:`unpack_awq`). A checkpoint's
        ``input_scale`` (static activation scales) is removed unused: activations stay in
        the model's dtype. A linear a quantized checkpoint left unquantized (commonly the
        LM head) loads as a plain weight."""
        if quantization is not None and prefix + "qweight" in self._tensors:
            return self._take_int4(prefix, shape, quantization)
        name = prefix + "weight"
        if self._tensors.stored_dtype(name) != "F8_E4M3":
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

    def _take_int4(
        self, prefix: str, shape: tuple[int, int], quantization: CheckpointQuantization
    ) -> QuantizedWeight:
        where = f"{self._source[prefix + 'qweight']}: {prefix}"
        names = ("qweight", "qzeros", "scales")
        if quantization.weight_format != "int4" or not all(
            prefix + n in self._tensors for n in names
        ):
            raise ModelLoadError(where, f"needs {', '.join(names)} for {quantization.method}")
        qweight, qzeros, scales = (self._tensors.pop(prefix + n) for n in names)
        g_idx = self._tensors.pop(prefix + "g_idx", None)
        rows, inputs = shape
        group = quantization.group_size or inputs
        if inputs % group or inputs % 8 or rows % 8:
            raise ModelLoadError(where, f"{shape} does not split into int4 groups of {group}")
        order = _input_order(where, g_idx, inputs, group)
        unpack = unpack_gptq if quantization.method == "gptq" else unpack_awq
        try:
            codes, zeros = unpack(qweight, qzeros)
        except RuntimeError as exc:
            raise ModelLoadError(where, f"cannot unpack {quantization.method}: {exc}") from exc
        expected = {"codes": (inputs, rows), "zeros": (inputs // group, rows)}
        expected["scales"] = expected["zeros"]
        got = {"codes": codes.shape, "zeros": zeros.shape, "scales": scales.shape}
        for part, want in expected.items():
            if tuple(got[part]) != want:
                raise ModelLoadError(
                    where, f"{part} unpack to {tuple(got[part])}, not {want} for {shape}"
                )
        zeros = zeros + quantization.zero_offset
        if order is not None:
            codes = codes[order]  # stored so that each group's inputs are together
        return QuantizedWeight(
            "int4",
            codes.T.to(torch.uint8).contiguous(),
            scales.T.to(torch.float32).contiguous(),
            zeros.T.to(torch.float32).contiguous(),
            group,
            order,
        )

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
        return self._tensors.remaining()


_MISSING = object()


class _Lazy:
    """A checkpoint's tensors by name, each read from its file only when taken (a rank
    reads its share: a pipeline stage never reads another stage's layers) and not kept."""

    def __init__(self) -> None:
        self.source: dict[str, Path] = {}
        """Every tensor's file, taken or not (for messages)."""
        self._handles: dict[Path, Any] = {}
        self._left: set[str] = set()

    def open(self, file: Path) -> None:
        handle = safe_open(str(file), framework="pt")
        self._handles[file] = handle
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            self.source[name] = file
            self._left.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._left

    def remaining(self) -> list[str]:
        return sorted(self._left)

    def stored_dtype(self, name: str) -> str | None:
        """An untaken tensor's dtype as safetensors names it (``F8_E4M3``), unread."""
        if name not in self._left:
            return None
        return self._handles[self.source[name]].get_slice(name).get_dtype()

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        """Read and take ``name`` (``default`` if it is not there or taken)."""
        if name not in self._left:
            if default is _MISSING:
                raise KeyError(name)
            return default
        self._left.discard(name)
        file = self.source[name]
        try:
            return self._handles[file].get_tensor(name)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{file}: tensor {name}", f"cannot read it: {exc}") from exc
