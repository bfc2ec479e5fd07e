"""The parts of a Hugging Face ``config.json`` the engine runs on, validated at load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lamina.services.engine_worker.engine.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    """What distinguishes one supported architecture from plain Llama."""

    qkv_bias: bool | None  # None: the checkpoint's ``attention_bias`` decides
    o_bias: bool | None
    qk_norm: bool


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm=False),
    "MistralForCausalLM": Family(qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm=True),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    quantization: CheckpointQuantization | None = None
    """How the checkpoint's weights are quantized, when they are (see
    :func:`checkpoint_quantization`)."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_dir(path: Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from ``path``."""
        config_path = path / "config.json"
        raw = _read_json(config_path, required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        return ModelConfig.from_dict(raw, generation, where=str(config_path))

    @staticmethod
    def from_dict(
        raw: dict[str, Any], generation: dict[str, Any] | None = None, where: str = "config.json"
    ) -> ModelConfig:
        def need(key: str) -> Any:
            if key not in raw:
                raise ModelLoadError(f"{where}: {key}", "required field is missing")
            return raw[key]

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ModelLoadError(
                f"{where}: architectures",
                f"{archs!r} is not supported; supported: {', '.join(FAMILIES)}",
            )
        family = FAMILIES[arch]
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{where}: hidden_act", f"{raw['hidden_act']!r} is not silu")

        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        hidden = int(need("hidden_size"))
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{where}: num_key_value_heads",
                f"{num_kv_heads} does not divide num_attention_heads ({num_heads})",
            )
        head_dim = int(raw.get("head_dim") or hidden // num_heads)

        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"{where}: rope_scaling.rope_type",
                f"{rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}",
            )
        rope_theta = float(rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0))
        rope["rope_type"] = rope_type

        dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        if dtype_name not in DTYPES:
            raise ModelLoadError(f"{where}: dtype", f"{dtype_name!r} is not fp32, bf16 or fp16")

        quantization = checkpoint_quantization(where, raw.get("quantization_config"))

        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = raw.get("sliding_window")
        if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
            window = None
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            dtype=DTYPES[dtype_name],
            eos_token_ids=tuple(int(e) for e in eos_ids),
            sliding_window=int(window) if window else None,
            quantization=quantization,
        )


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its linears' weights."""

    method: str
    """``quantization_config.quant_method``: ``fp8``, ``compressed-tensors``, ``gptq``,
    ``awq``."""
    weight_format: str
    """The :class:`~lamina.kernels.weight_quant.QuantizedWeight` format it loads as:
    ``fp8`` or ``int4``."""
    group_size: int = 0
    """int4: inputs per scale and zero point (0: a row's all)."""
    zero_offset: int = 0
    """What to add to each stored zero point: GPTQ's original format stores them one
    less than they are (``checkpoint_format`` ``gptq``; ``gptq_v2`` does not)."""


def checkpoint_quantization(where: str, config: Any) -> CheckpointQuantization | None:
    """How a pre-quantized checkpoint's weights are stored, from its
    ``quantization_config`` (None for an unquantized checkpoint):

    * fp8 (e4m3) weights with a scale per tensor or per output channel, as vLLM's ``fp8``
      and llm-compressor's ``compressed-tensors`` (``float-quantized``) write them;
    * int4 with a scale and a zero point per group of inputs, in GPTQ's layout
      (``gptq``, 4 bits, ``checkpoint_format`` ``gptq`` or ``gptq_v2``) and AWQ's GEMM
      layout (``awq``, 4 bits, with zero points).

    Any other method or scheme (block-wise fp8, 8-bit GPTQ, AWQ's GEMV layout, int4
    compressed-tensors, ...) fails here, naming it. A checkpoint's activation scales
    (W8A8) are not used: the engine runs its weights with activations in the model's
    dtype, as it runs weights it quantizes itself."""
    if config is None:
        return None
    field = f"{where}: quantization_config"
    if not isinstance(config, dict):
        raise ModelLoadError(field, "not a JSON object")
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("weight_block_size"):
            raise ModelLoadError(
                field,
                f"fp8 with block-wise weight scales (weight_block_size "
                f"{config['weight_block_size']}) is not supported; per-tensor and "
                "per-channel scales are",
            )
        return CheckpointQuantization("fp8", "fp8")
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        if not groups:
            raise ModelLoadError(f"{field}.config_groups", "no quantization scheme")
        for name, group in groups.items():
            weights = (group or {}).get("weights") or {}
            scheme = {k: weights.get(k) for k in ("num_bits", "type", "strategy")}
            fp8 = scheme["num_bits"] == 8 and scheme["type"] == "float"
            if not fp8 or scheme["strategy"] not in ("tensor", "channel"):
                raise ModelLoadError(
                    f"{field}.config_groups.{name}.weights",
                    f"{scheme} is not supported: compressed-tensors checkpoints load with "
                    "8-bit float weights, per tensor or per channel",
                )
        return CheckpointQuantization("compressed-tensors", "fp8")
    if method in ("gptq", "awq"):
        if config.get("bits") != 4:
            raise ModelLoadError(f"{field}.bits", f"{config.get('bits')!r}: only 4 is supported")
        group = int(config.get("group_size") or -1)
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm" or not config.get("zero_point", True):
                raise ModelLoadError(
                    field,
                    f"AWQ version {version!r}, zero_point {config.get('zero_point')!r}: only "
                    "the GEMM layout with zero points is supported",
                )
            return CheckpointQuantization("awq", "int4", max(group, 0))
        v1 = config.get("checkpoint_format", "gptq") == "gptq"
        return CheckpointQuantization("gptq", "int4", max(group, 0), zero_offset=int(v1))
    raise ModelLoadError(
        field,
        f"quant_method {method!r} is not supported; supported: fp8, compressed-tensors (fp8 "
        "weights), gptq and awq (4 bits); unquantized checkpoints load with --quantization "
        "int8, fp8 or bf16 to quantize them at load",
    )


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            raise ModelLoadError(str(path), "file not found")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(str(path), f"invalid JSON: {exc}") from exc
