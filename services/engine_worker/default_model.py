"""The default model: a small Llama checkpoint made locally, with a fixed seed, no network.

``make up`` and the tests run on it when no model is given. The weights are random (it
produces fluent-looking nonsense), but every file is a real Hugging Face artefact: a
``config.json`` that ``transformers`` loads, ``model.safetensors``, a byte-level BPE
``tokenizer.json`` trained here on a seeded synthetic corpus, and a ChatML chat template.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lamina.libs.default_tokenizer import MODEL_MAX_LENGTH, default_model_dir, write_tokenizer
from lamina.services.engine_worker.engine.config import EngineConfig

SEED = 0


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = MODEL_MAX_LENGTH


PRESETS = {
    # The default: fast enough for tests and `make up` on two CPU cores.
    "tiny": Preset(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384
    ),
    # Tens of millions of parameters: the benchmark model.
    "small": Preset(
        hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=2, intermediate_size=2048
    ),
    # Hundreds of millions (0.7B): enough bytes per token for a GPU's batch-1 decode to be
    # bound by memory, not launches (`benchmarks/kernels.py --parts mbu`); 2.9 GB in fp32.
    "medium": Preset(
        hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, intermediate_size=5632
    ),
}


def ensure_default_model(
    preset: str = "tiny", directory: Path | None = None, force: bool = False
) -> Path:
    """Create the preset's checkpoint unless a complete one is already there."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    directory = directory or default_model_dir(preset)
    if not force and (directory / "model.safetensors").exists():
        return directory
    tokenizer = write_tokenizer(directory)
    vocab_size = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    shape = PRESETS[preset]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos, bos]}, indent=2)
    )
    tmp = directory / "model.safetensors.tmp"
    save_file(_random_weights(config), str(tmp), metadata={"format": "pt"})
    tmp.rename(directory / "model.safetensors")  # last: its presence marks a complete model
    return directory


def _random_weights(config: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    return tensors


def with_default_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model`` set: the default model (created if missing) for None."""
    if config.model is not None:
        return config
    return dataclasses.replace(config, model=ensure_default_model())
