"""Checkpoint loading: every failure names the file, tensor or field at fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.model_config import ModelConfig
from tests.engine.helpers import make_engine


@pytest.fixture
def checkpoint(make_checkpoint, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama"), path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture_is_named(checkpoint):
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"architectures.*GPT2LMHeadModel.*supported"):
        make_engine(checkpoint)


def test_missing_config_and_weights_name_the_file(checkpoint, tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        make_engine(tmp_path / "nowhere")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        make_engine(checkpoint)


def test_shape_mismatch_names_file_and_tensor(checkpoint):
    edit_config(checkpoint, intermediate_size=96)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor model\.layers\.0\."
        r"mlp\.gate_proj\.weight.*\(128, 64\).*\(96, 64\)",
    ):
        make_engine(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.post_attention_layernorm.*missing"):
        make_engine(checkpoint)


def test_missing_shard_is_named(make_checkpoint, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(make_checkpoint("llama", max_shard_size="100KB"), path)
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        make_engine(path)


def test_bad_fields_are_named():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        ModelConfig.from_dict(base | {"num_key_value_heads": 3})
    with pytest.raises(ModelLoadError, match=r"rope_type.*yarn"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="vocab_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ModelLoadError, match="hidden_act"):
        ModelConfig.from_dict(base | {"hidden_act": "gelu"})


def test_config_reads_both_rope_spellings_and_generation_eos():
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "eos_token_id": 5,
        "sliding_window": 4096,
    }
    old = ModelConfig.from_dict(base | {"rope_theta": 1e6})
    new = ModelConfig.from_dict(
        base | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        generation={"eos_token_id": [5, 7]},
    )
    assert old.rope_theta == new.rope_theta == 1e6
    assert old.eos_token_ids == (5,) and new.eos_token_ids == (5, 7)
    assert old.qk_norm and old.sliding_window is None  # Qwen: window only if enabled
    assert old.dtype == torch.float32


def test_sliding_window_caps_the_context():
    config = ModelConfig.from_dict(
        {
            "architectures": ["MistralForCausalLM"],
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "sliding_window": 128,
            "max_position_embeddings": 4096,
        }
    )
    assert config.sliding_window == 128
