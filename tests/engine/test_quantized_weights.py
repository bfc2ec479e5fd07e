"""The engine with weights quantized at load (``--quantization int8|fp8``) against
Hugging Face ``transformers`` running the same dequantized weights: the engine's quantized
matmuls must compute exactly what the dequantized model does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lamina.kernels.weight_quant import WEIGHT_FORMATS, quantize
from lamina.services.engine_worker.errors import ModelLoadError
from tests.engine.helpers import greedy, make_engine, run_to_completion, teacher_forced_logits
from tests.engine.test_hf_parity import hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 400, 261, 403], [1, 306, 323, 283, 272, 260, 389], [1, 73, 87, 316]]


def dequantized_checkpoint(source: Path, target: Path, fmt: str) -> Path:
    """``source`` with every linear's weight replaced by its ``fmt``-quantized values
    (the LM head too: untied from the embedding, which the engine keeps unquantized)."""
    if target.exists():
        return target
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            tensors[name] = quantize(tensors[name], fmt).dequantize()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = quantize(head, fmt).dequantize()
    config["tie_word_embeddings"] = False
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_quantized_engine_matches_transformers_on_the_dequantized_weights(
    stories, tmp_path_factory, fmt
):
    """On the trained stories260K: teacher-forced logits within fp32 rounding of the
    dequantized model's, and 200 greedy tokens per prompt equal to its ``generate``."""
    reference = hf_model(dequantized_checkpoint(stories, tmp_path_factory.mktemp(fmt) / "m", fmt))
    engine = make_engine(stories, quantization=fmt, max_num_batched_tokens=64)
    layer = engine.runner.model.layers[0]
    assert engine.runner.model.weight_dtype == fmt
    assert layer.qkv.__class__.__name__ == "PackedQuantLinear"  # every linear, small ones too
    ours = run_to_completion(engine, dict(enumerate(PROMPTS)), greedy(200))
    for i, prompt in enumerate(PROMPTS):
        want = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=200,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert ours[i] == want, i
    sequences = [p + ours[i][:40] for i, p in enumerate(PROMPTS)]
    lens = [len(p) for p in PROMPTS]
    got = teacher_forced_logits(
        make_engine(stories, quantization=fmt, max_num_batched_tokens=64), sequences, lens
    )
    for seq, n, logits in zip(sequences, lens, got, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0, n - 1 :].float()
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


# Stated tolerance: the quantized logits' relative (L2) error against the fp32 model's.
# Measured on the default model: int8 1.3-1.7%, fp8 6.3% (e4m3 keeps 3 mantissa bits).
RELATIVE_ERROR = {"int8": 0.03, "fp8": 0.10}


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_quantized_engine_tracks_the_unquantized_model(tiny_model, fmt):
    """On the default model, quantized logits stay near the fp32 ones (random weights:
    near-tied logits, so only the size of the error is checked, not the argmax)."""
    sequences, lens = [list(range(5, 40)), list(range(60, 70))], [20, 4]
    want = teacher_forced_logits(make_engine(tiny_model), sequences, lens)
    got = teacher_forced_logits(make_engine(tiny_model, quantization=fmt), sequences, lens)
    for w, g in zip(want, got, strict=True):
        assert 0 < (w - g).norm() / w.norm() < RELATIVE_ERROR[fmt]


def test_a_pre_quantized_checkpoint_fails_at_load_naming_its_method(tiny_model, tmp_path):
    path = tmp_path / "gptq"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'gptq'"):
        make_engine(path)


def test_an_unknown_quantization_is_refused():
    from lamina.services.engine_worker.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
