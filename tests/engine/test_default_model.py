"""The default model is made locally, deterministically, and loads in both engines."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from lamina.services.engine_worker.default_model import ensure_default_model
from tests.engine.helpers import greedy, make_engine, run_to_completion


def test_default_model_is_a_complete_hf_checkpoint(tiny_model):
    names = {p.name for p in tiny_model.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    config = json.loads((tiny_model / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    text = "The engine reads a prompt. Unicode too: déjà vu 🙂"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    template = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template


def test_default_model_is_deterministic(tiny_model, tmp_path):
    again = ensure_default_model("tiny", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_default_model_runs_and_matches_transformers(tiny_model):
    import torch
    import transformers

    prompt = list(range(40, 60))
    ours = run_to_completion(make_engine(tiny_model), {"a": prompt}, greedy(8))["a"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
    assert ours[0] == want


def test_the_gateways_tokenizer_files_are_the_models(tiny_model, tmp_path):
    """The gateway makes the default tokenizer without torch; the files are the same ones
    the worker makes with the weights, so either may create them first."""
    from lamina.libs.default_tokenizer import ensure_default_tokenizer

    ensure_default_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_the_gateway_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, lamina.services.gateway.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
