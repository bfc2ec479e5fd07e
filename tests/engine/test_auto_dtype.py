"""``dtype="auto"``: what a checkpoint runs in, by its dtype, its weights' quantization and
the device (``auto_dtype.py``); on the CPU the choice computes what the explicit dtype
computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lamina.services.engine_worker.engine import auto_dtype
from lamina.services.engine_worker.engine.auto_dtype import resolve_dtype
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.model_config import ModelConfig
from tests.engine.helpers import greedy, make_engine, run_to_completion, saved_in

PROMPTS = {0: [1, 400, 261, 403], 1: [1, 306, 323, 283, 272, 260, 389]}


@pytest.mark.parametrize(
    ("stored", "device", "quantization", "bf16_matmul", "want"),
    [
        (torch.float32, "cpu", None, True, ("float32", None)),
        (torch.float16, "cpu", None, True, ("float32", None)),
        (torch.bfloat16, "cpu", None, True, ("bfloat16", None)),
        (torch.bfloat16, "cpu", None, False, ("float32", "bf16")),
        (torch.bfloat16, "cpu", "int8", True, ("float32", "int8")),
        (torch.bfloat16, "cpu", "bf16", True, ("float32", "bf16")),
        (torch.float16, "cpu", "fp8", False, ("float32", "fp8")),
        (torch.bfloat16, "cuda", None, False, ("bfloat16", None)),
        (torch.float16, "cuda", "int8", False, ("float16", "int8")),
    ],
)
def test_auto_resolves_by_checkpoint_quantization_and_device(
    stories, stored, device, quantization, bf16_matmul, want
):
    model_config = dataclasses.replace(ModelConfig.from_dir(stories), dtype=stored)
    config = EngineConfig(model=stories, device=device, quantization=quantization)
    got = resolve_dtype(config, model_config, bf16_matmul=bf16_matmul)
    assert (got.dtype, got.quantization) == want


def test_an_explicit_dtype_is_run_as_asked(stories):
    model_config = dataclasses.replace(ModelConfig.from_dir(stories), dtype=torch.bfloat16)
    config = EngineConfig(model=stories, dtype="bfloat16", quantization="int8")
    assert resolve_dtype(config, model_config, bf16_matmul=False) is config


def test_a_bf16_checkpoint_quantized_at_load_runs_in_fp32(stories, tmp_path):
    """The native quantized matmul takes fp32 activations: a bf16 checkpoint with
    ``--quantization int8`` runs on it, as with ``--dtype float32``, not on a weight
    dequantized in bf16 on every call."""
    path = saved_in(stories, tmp_path / "bf16")
    engine = make_engine(path, quantization="int8")
    assert engine.config.dtype == "float32" and engine.runner.model.dtype == torch.float32
    assert engine.runner.model.weight_dtype == "int8"
    explicit = make_engine(path, dtype="float32", quantization="int8")
    assert run_to_completion(engine, PROMPTS, greedy(40)) == run_to_completion(
        explicit, PROMPTS, greedy(40)
    )


def test_an_fp16_checkpoint_runs_widened_to_fp32(stories, tmp_path):
    path = saved_in(stories, tmp_path / "fp16", torch.float16)
    engine = make_engine(path)
    assert engine.runner.model.dtype == torch.float32
    assert engine.runner.model.weight_dtype == "float32"
    explicit = make_engine(path, dtype="float32")
    assert run_to_completion(engine, PROMPTS, greedy(40)) == run_to_completion(
        explicit, PROMPTS, greedy(40)
    )


def test_a_bf16_checkpoint_keeps_its_weights_where_the_cpu_has_no_bf16_matmul(
    stories, tmp_path, monkeypatch
):
    path = saved_in(stories, tmp_path / "bf16")
    monkeypatch.setattr(auto_dtype, "cpu_bf16_matmul", lambda: False)
    engine = make_engine(path)
    assert engine.runner.model.dtype == torch.float32
    assert engine.runner.model.weight_dtype == "bf16"
    explicit = make_engine(path, dtype="float32", quantization="bf16")
    assert run_to_completion(engine, PROMPTS, greedy(40)) == run_to_completion(
        explicit, PROMPTS, greedy(40)
    )
    monkeypatch.setattr(auto_dtype, "cpu_bf16_matmul", lambda: True)
    assert make_engine(path).runner.model.dtype == torch.bfloat16
