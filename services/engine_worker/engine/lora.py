"""LoRA adapters of the served model: PEFT checkpoints, and the device slots a step reads.

An adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as ``peft`` saves
one) adds ``scaling * B @ A`` to some of the base model's linears. The engine keeps every
adapter it knows on the host (:class:`LoraAdapter`) and up to ``max_loras`` of them in
device slots (:class:`LoraSlots`), least recently used out first; the batch scheduler
keeps the adapters of the running requests within that many, so a step always finds its
adapters resident. The base model's linears are fused (Q/K/V into one, gate/up into one),
so each slot holds, per layer and fused linear, the adapter's ``A`` matrices stacked
(``(parts × max_rank, in)``) and its ``B`` matrices block-diagonal and transposed
(``(parts × max_rank, out)``, ``scaling`` folded in): one grouped product per fused linear
(:func:`lamina.kernels.lora.add_lora`), zero rows for a module the adapter leaves alone.

Across ranks (tensor parallelism, pipeline stages) each rank's slots hold its share of
each adapter (:meth:`LoraAdapter.share`), split as the base model is (``parallel.py``):
a stage's layers only; of a column-parallel projection (Q/K/V, gate/up) the ``B`` rows of
the rank's heads or MLP width, ``A`` whole; of a row-parallel one (O, down) the ``A``
columns of the rank's inputs, ``B`` whole. The rank adds ``x_r A_r B`` to its partial
output before the layer's all-reduce, which sums them to ``x A B`` as it sums the base
linear's parts: no collective of its own, as vLLM's LoRA layers do it. The driver (rank
0) decides which slot holds which adapter and sends each other rank its share when a
slot is written (``rank_group.py``), in order with the steps.
"""

from __future__ import annotations

import collections
import heapq
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from lamina.kernels.lora import DENSE_MAX_ROWS, LoraBatch, add_lora
from lamina.services.engine_worker.engine.errors import InvalidRequestError, ModelLoadError
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import PipelineStage, TensorParallel

TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
"""The modules an adapter may target: the fused linear each is part of, and which part."""

_PREFIX = "base_model.model.model.layers."
_ROW_PARALLEL = ("o_proj", "down_proj")
_KV = ("k_proj", "v_proj")

LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""Per (layer, module): ``A`` ``(r, in)`` and ``B`` ``(out, r)``, ``scaling`` in ``B``."""


class LoraAdapterError(ModelLoadError):
    """An adapter that cannot be loaded (no such directory, a format or a shape this
    engine does not take); ``where`` names the file or field."""


class UnknownLoraError(InvalidRequestError):
    """A request (or an unload) names an adapter the engine does not hold."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} is not loaded on this worker", "model")
        self.name = name


class LoraDisabledError(InvalidRequestError):
    """The engine serves no adapters (``enable_lora`` is off)."""

    def __init__(self) -> None:
        super().__init__("this worker serves no LoRA adapters (enable_lora)", "model")


class LoraExistsError(InvalidRequestError):
    """An adapter of that name is already served."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} has already been loaded", "lora_name")


class LoraInUseError(InvalidRequestError):
    """Requests of the engine use the adapter: it cannot be unloaded now."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} is in use by running requests", "lora_name")


@dataclass(frozen=True)
class LoraModule:
    """One adapter to load at start: the name requests use as their ``model``, and its
    directory."""

    name: str
    path: Path


@dataclass(frozen=True)
class LoraModules:
    """vLLM's ``--lora-modules``: adapters as ``name=path`` items (several after one flag,
    or in one value separated by spaces or commas), or a JSON object (or list of them)
    with ``name`` and ``path``."""

    modules: tuple[LoraModule, ...] = ()
    NARGS: ClassVar[str] = "+"
    """The flag takes several values (``libs/config``), joined by spaces for :meth:`parse`."""

    @classmethod
    def parse(cls, text: str) -> LoraModules:
        text = text.strip()
        if text.startswith(("{", "[")):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: not JSON ({exc})") from exc
            items = parsed if isinstance(parsed, list) else [parsed]
            if not all(isinstance(i, dict) and {"name", "path"} <= i.keys() for i in items):
                raise ValueError('lora_modules: each JSON object needs "name" and "path"')
            return cls(tuple(LoraModule(str(i["name"]), Path(i["path"])) for i in items))
        modules = []
        for item in text.replace(",", " ").split():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            modules.append(LoraModule(name, Path(path)))
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: a name is given twice ({names})")
        return cls(tuple(modules))

    def __str__(self) -> str:
        return " ".join(f"{m.name}={m.path}" for m in self.modules)

    def __iter__(self) -> Iterator[LoraModule]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the host: per (layer, module), ``A`` ``(r, in)`` and ``B`` ``(out,
    r)`` with the adapter's scaling folded into ``B``."""

    name: str
    path: Path
    rank: int
    base_model: str
    """The checkpoint it was trained on, as its config names it (``/v1/models``' parent)."""
    weights: LoraWeights = field(repr=False)

    @classmethod
    def load(cls, name: str, path: Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
        """Read the PEFT adapter in ``path`` for ``model``; raises :class:`LoraAdapterError`
        for what this engine does not take (DoRA, biases, saved modules, targets other
        than the decoder layers' linears, a rank above ``max_rank``, wrong shapes)."""
        path = Path(path)
        config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        for needed in (config_file, weights_file):
            if not needed.is_file():
                raise LoraAdapterError(str(needed), "not found (a PEFT adapter directory has it)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LoraAdapterError(str(config_file), f"unreadable: {exc}") from exc
        rank = _check_config(config, config_file, max_rank)
        rslora = bool(config.get("use_rslora"))
        scaling = config["lora_alpha"] / (rank**0.5 if rslora else rank)
        weights = _read_weights(weights_file, model, rank, scaling)
        return cls(name, path, rank, str(config.get("base_model_name_or_path") or ""), weights)

    def share(self, model: ModelConfig, tp: TensorParallel, pp: PipelineStage) -> LoraWeights:
        """A rank's part of the adapter (see the module's text): its stage's layers,
        numbered from the stage's first, and its tensor-parallel slice of each."""
        layers = pp.layers(model.num_layers)
        shared = {}
        for (layer, module), (a, b) in self.weights.items():
            if layer not in layers:
                continue
            if module in _ROW_PARALLEL:
                a = tp.shard(a, 1)
            elif module in _KV:
                b = tp.shard_kv(b, 0, model.num_kv_heads)
            else:
                b = tp.shard(b, 0)
            shared[(layer - layers.start, module)] = (a, b)
        return shared


def dump_weights(weights: LoraWeights) -> bytes:
    """``weights`` as safetensors bytes (to send a rank its share)."""
    tensors = {}
    for (layer, module), (a, b) in weights.items():
        tensors[f"{layer}.{module}.A"] = a.contiguous()
        tensors[f"{layer}.{module}.B"] = b.contiguous()
    return save_tensors(tensors)


def load_weights(data: bytes) -> LoraWeights:
    """What :func:`dump_weights` wrote."""
    tensors = load_tensors(data)
    weights = {}
    for key, a in tensors.items():
        layer, module, which = key.split(".")
        if which == "A":
            weights[(int(layer), module)] = (a, tensors[f"{layer}.{module}.B"])
    return weights


def _check_config(config: dict, where: Path, max_rank: int) -> int:
    """The adapter's rank, once its config is one this engine runs."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(str(where), f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "adapters that save whole modules",
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "lora_bias": "LoRA biases",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoraAdapterError(f"{where}: {key}", f"{what} are not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias", "adapters that train biases are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise LoraAdapterError(str(where), "r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: r", f"rank {rank} is above --max-lora-rank {max_rank}")
    return rank


def _read_weights(path: Path, model: ModelConfig, rank: int, scaling: float) -> LoraWeights:
    """Each targeted (layer, module)'s ``A`` and scaled ``B``, shapes checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = collections.defaultdict(dict)
    try:
        with safe_open(path, "pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                parsed = _parse_key(key)
                if parsed is None:
                    raise LoraAdapterError(
                        f"{path}: {key}",
                        "only the decoder layers' attention and MLP projections may be adapted",
                    )
                layer, module, which = parsed
                if not 0 <= layer < model.num_layers:
                    layers = model.num_layers
                    raise LoraAdapterError(f"{path}: {key}", f"the model has {layers} layers")
                pairs[(layer, module)][which] = tensors.get_tensor(key).float()
    except LoraAdapterError:
        raise
    except Exception as exc:  # a file safetensors cannot read, whatever its fault
        raise LoraAdapterError(str(path), f"unreadable: {exc}") from exc
    weights = {}
    for (layer, module), pair in pairs.items():
        where = f"{path}: layer {layer} {module}"
        if pair.keys() != {"A", "B"}:
            raise LoraAdapterError(where, "lora_A and lora_B must come together")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = projection_shape(model, module)
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraAdapterError(
                where,
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                f"{(rank, fan_in)} and {(fan_out, rank)}",
            )
        weights[(layer, module)] = (a, b * scaling)
    if not weights:
        raise LoraAdapterError(str(path), "holds no LoRA weights")
    return weights


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """``(layer, module, "A" or "B")`` of a PEFT key such as
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; None otherwise."""
    if not key.startswith(_PREFIX) or not key.endswith(".weight"):
        return None
    parts = key[len(_PREFIX) : -len(".weight")].split(".")
    if len(parts) != 4 or not parts[0].isdigit() or parts[3] not in ("lora_A", "lora_B"):
        return None
    block, module = parts[1], parts[2]
    if module not in TARGETS:
        return None
    if block != ("mlp" if TARGETS[module][0] in ("gate_up", "down") else "self_attn"):
        return None
    return int(parts[0]), module, parts[3][-1]


def projection_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(inputs, outputs) of ``module`` in ``model``."""
    h, i = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (h, model.q_size),
        "k_proj": (h, model.kv_size),
        "v_proj": (h, model.kv_size),
        "o_proj": (model.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def _fused_layout(model: ModelConfig) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """Per fused linear: its inputs, and its parts' modules with their output offsets."""
    q, kv, i = model.q_size, model.kv_size, model.intermediate_size
    return {
        "qkv": (model.hidden_size, [("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)]),
        "o": (q, [("o_proj", 0)]),
        "gate_up": (model.hidden_size, [("gate_proj", 0), ("up_proj", i)]),
        "down": (i, [("down_proj", 0)]),
    }


class LoraSlots:
    """``max_loras`` device slots of adapter weights, per layer and fused linear of
    ``parts`` projections (``W = parts × max_rank``): ``A`` ``(slots × W, in)``, slot
    ``s``'s rows from ``s × W``, and ``B`` transposed, ``(slots × W, out)``, its rows
    likewise (the layout :func:`lamina.kernels.lora.add_lora` takes). ``model`` is the rank's
    share of the model (its layers, heads and MLP width)."""

    def __init__(
        self,
        model: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_rank = max_rank
        self.layout = _fused_layout(model)
        outputs = {
            "qkv": model.q_size + 2 * model.kv_size,
            "o": model.hidden_size,
            "gate_up": 2 * model.intermediate_size,
            "down": model.hidden_size,
        }
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(model.num_layers):
            per_layer = {}
            for fused, (fan_in, parts) in self.layout.items():
                width = len(parts) * max_rank
                a = torch.zeros((max_loras * width, fan_in), dtype=dtype, device=device)
                b = torch.zeros((max_loras * width, outputs[fused]), dtype=dtype, device=device)
                per_layer[fused] = (a, b)
            self.weights.append(per_layer)
        self.resident: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Adapter name → slot, least recently used first."""
        self.free = list(range(max_loras))
        """Free slots, a heap: the lowest is taken first, which keeps the slots a step
        uses low (the dense product covers the slots up to the highest used)."""
        self.kernel_rows = DENSE_MAX_ROWS if dtype == torch.float32 else 0
        """Steps of at most this many rows run the ``cpu`` backend's native kernel (it takes
        fp32: none in another dtype), larger ones the torch forms (``benchmarks/lora.py``
        sets 0 to measure them alone)."""
        self.targets: frozenset[str] = frozenset()
        """The fused linears any adapter loaded so far touches (the others are skipped)."""
        self._native: tuple[frozenset[str], torch.Tensor] | None = None

    def native_table(self) -> torch.Tensor:
        """The slots as the native decode step reads them (``kernels/cpu/decode.py``'s
        LoRA table): per layer, per fused linear, ``A`` and ``B``'s addresses and the slot
        width; zeros for a linear no adapter touches. Made again only when
        :attr:`targets` changes (the tensors stay where they are)."""
        if self._native is None or self._native[0] != self.targets:
            rows = []
            for per_layer in self.weights:
                row = []
                for fused, (a, b) in per_layer.items():
                    if fused in self.targets:
                        row += [a.data_ptr(), b.data_ptr(), self.width(fused)]
                    else:
                        row += [0, 0, 0]
                rows.append(row)
            self._native = (self.targets, torch.tensor(rows, dtype=torch.int64))
        return self._native[1]

    def width(self, fused: str) -> int:
        """Rows of ``A`` and of ``B``'s transpose that one slot of ``fused`` takes."""
        return len(self.layout[fused][1]) * self.max_rank

    def slots_for(self, names: set[str], write: Callable[[int, str], None]) -> dict[str, int]:
        """A slot per adapter in ``names`` (at most ``max_loras`` of them), those not
        resident put in free slots or over the least recently used others by ``write``
        (slot, name: the caller writes every rank's share, this one's by :meth:`write`)."""
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in sorted(names):
            if name in self.resident:
                continue
            if not self.free:
                victim = next(n for n in self.resident if n not in names)
                heapq.heappush(self.free, self.resident.pop(victim))
            slot = heapq.heappop(self.free)
            write(slot, name)
            self.resident[name] = slot
        return {name: self.resident[name] for name in names}

    def evict(self, name: str) -> None:
        """Forget ``name``'s slot (an unloaded adapter)."""
        slot = self.resident.pop(name, None)
        if slot is not None:
            heapq.heappush(self.free, slot)

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Slot ``slot`` holds ``weights`` (this rank's share of an adapter)."""
        r = self.max_rank
        touched = set()
        for layer, per_layer in enumerate(self.weights):
            for fused, (a, b) in per_layer.items():
                width = self.width(fused)
                base = slot * width
                a[base : base + width].zero_()
                b[base : base + width].zero_()
                for part, (module, offset) in enumerate(self.layout[fused][1]):
                    pair = weights.get((layer, module))
                    if pair is None:
                        continue
                    touched.add(fused)
                    lora_a, lora_b = pair
                    rank, start = lora_a.shape[0], base + part * r
                    a[start : start + rank] = lora_a.to(a.dtype)
                    columns = slice(offset, offset + lora_b.shape[0])
                    b[start : start + rank, columns] = lora_b.T.to(b.dtype)
        self.targets |= touched


@dataclass(frozen=True, slots=True)
class LoraStep:
    """What a step's model call needs to add its adapters' products: each row's slot for
    a one-call kernel (Punica's BGMV: ``kernels/triton/lora.py`` on the ``triton``
    backend, ``kernels/cpu/lora.py`` on the ``cpu`` one for a step of at most
    :attr:`LoraSlots.kernel_rows` rows), else the step's grouping for the
    torch forms (``kernels/lora.py``: a prefill chunk's rows per adapter, as matmuls)."""

    slots: LoraSlots
    batch: LoraBatch | None
    """The torch forms' grouping (None where a kernel runs)."""
    kernel_slots: torch.Tensor | None = None
    """``(T,)`` each row's slot on the device, where a kernel runs."""
    kernel: Callable[..., torch.Tensor] | None = None

    @classmethod
    def of(
        cls, token_slots: np.ndarray, slots: LoraSlots, device: torch.device, backend: str
    ) -> LoraStep | None:
        """For a step whose tokens use ``token_slots`` (-1: the base model) on the kernel
        ``backend``; None when none uses an adapter."""
        if not (token_slots >= 0).any():
            return None
        # (imported here: each backend's kernels are not needed elsewhere)
        if backend == "triton":
            from lamina.kernels.triton.lora import add_lora as kernel
        elif backend == "cpu" and len(token_slots) <= slots.kernel_rows:
            from lamina.kernels.cpu.lora import add_lora as kernel
        else:
            return cls(slots, LoraBatch.of(token_slots, device))
        return cls(slots, None, torch.from_numpy(token_slots).to(device), kernel)

    def add(self, fused: str, layer: int, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (fused linear ``fused`` of ``layer`` on ``x``) plus the adapters'
        products."""
        if fused in self.slots.targets:
            a, b = self.slots.weights[layer][fused]
            width = self.slots.width(fused)
            if self.kernel is not None:
                self.kernel(out, x, a, b, width, self.kernel_slots)
            else:
                add_lora(out, x, a, b, width, self.batch)  # type: ignore[arg-type]
        return out
