"""The CPU backend's native decode step (``kernels/cpu/decode.cpp``: a decode-only step's
layers in one call) against the same model's layer-by-layer forward and against
``transformers``, and where it applies."""

from __future__ import annotations

import pytest
import torch

from lamina.kernels.cpu import bf16_linear
from tests.conftest import FAMILIES
from tests.engine.helpers import (
    greedy,
    hf_greedy,
    make_engine,
    run_to_completion,
    teacher_forced_logits,
)
from tests.engine.test_hf_parity import assert_logits_match, hf_model, sequences

PROMPTS = [5, 37, 16]


def _logits(engine, native: bool) -> list[torch.Tensor]:
    engine.runner.model.native_decode = native
    seqs = sequences(256, [p + 12 for p in PROMPTS])
    return teacher_forced_logits(engine, seqs, PROMPTS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_native_decode_steps_equal_the_layer_by_layer_forward(
    family, quantization, make_checkpoint, monkeypatch
):
    """Every family (Qwen2's q/k/v biases, Qwen3's per-head norms, Llama's attention and
    MLP biases, a 72-wide MLP that leaves a partial panel), fp32 and int8 weights: three
    sequences decoding together for 12 steps, logits equal to the Python forward's, and
    (fp32) to ``transformers``'."""
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "native")
    monkeypatch.setattr("lamina.kernels.linear.NATIVE_MIN_ELEMENTS", 0)  # pack every weight
    biases = dict(attention_bias=True, mlp_bias=True) if family == "llama" else {}
    path = make_checkpoint(family, intermediate_size=72, **biases)
    engine = make_engine(path, quantization=quantization)
    native = _logits(engine, True)
    assert engine.runner.model._native[1] is not None  # the native step ran
    python = _logits(make_engine(path, quantization=quantization), False)
    for got, want in zip(native, python, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if quantization is None:
        engine.runner.model.native_decode = True
        assert_logits_match(engine, hf_model(path))


@pytest.mark.skipif(not bf16_linear.available(), reason="the bf16 matmul needs AVX-512 BF16")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_native_decode_steps_equal_the_layer_by_layer_forward(family, make_checkpoint):
    """A bf16 model's native step rounds where its Python forward's ops round (the native
    bf16 matmul, norms, rotary, activation and attention in both): logits bit for bit
    equal, with Qwen2's q/k/v biases and Llama's attention and MLP biases. Qwen3's
    per-head norms keep the Python forward in bf16 (they are fp32-only in the step)."""
    biases = dict(attention_bias=True, mlp_bias=True) if family == "llama" else {}
    path = make_checkpoint(family, intermediate_size=72, **biases)
    engine = make_engine(path, dtype="bfloat16")
    native = _logits(engine, True)
    if family == "qwen3":
        assert engine.runner.model._native[1] is None
        return
    assert engine.runner.model._native[1] is not None
    python = _logits(make_engine(path, dtype="bfloat16"), False)
    for got, want in zip(native, python, strict=True):
        assert torch.equal(got, want)


def test_long_native_greedy_decoding_matches_transformers(stories):
    """200 greedy tokens per sequence on the trained checkpoint, every weight packed."""
    import transformers

    prompts = {"a": [1, 400, 261, 403], "b": [1, 306, 323, 283, 272, 260, 389]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lamina.kernels.linear.NATIVE_MIN_ELEMENTS", 0)
        patch.setenv("LAMINA_CPU_LINEAR", "native")
        engine = make_engine(stories, max_num_batched_tokens=64)
    ours = run_to_completion(engine, prompts, greedy(200))
    assert engine.runner.model._native[1] is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
    for request_id, prompt in prompts.items():
        want = hf_greedy(hf, prompt, 200)
        assert ours[request_id] == want, request_id


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_the_layer_by_layer_forward_runs_where_the_native_step_does_not_apply(
    kv_cache_dtype, tiny_model, monkeypatch
):
    """A quantized KV cache, and small fp32 weights left on ``F.linear`` (the default
    model's), keep the Python forward."""
    engine = make_engine(tiny_model, kv_cache_dtype=kv_cache_dtype, quantization="int8")
    run_to_completion(engine, {"a": [5, 6, 7]}, greedy(4))
    assert engine.runner.model._native[1] is None
    fp32 = make_engine(tiny_model)
    run_to_completion(fp32, {"a": [5, 6, 7]}, greedy(4))
    assert fp32.runner.model._native[1] is None


def _one_decode(make_checkpoint, monkeypatch):
    """A Llama with every weight packed, and one decode's arguments for its native step
    (a token, its position, its slot and context all 0, one block): (model, arguments)."""
    import numpy as np

    monkeypatch.setenv("LAMINA_CPU_LINEAR", "native")
    monkeypatch.setattr("lamina.kernels.linear.NATIVE_MIN_ELEMENTS", 0)
    engine = make_engine(make_checkpoint("llama"))
    one = np.zeros(1, dtype=np.int64)
    table = np.zeros((1, 1), dtype=np.int64)
    return engine.runner.model, (one, one, one, table, one, engine.runner.kv_caches)


def test_the_native_step_refuses_a_token_or_position_outside_its_tables(
    make_checkpoint, monkeypatch
):
    """The embedding and rotary lookups are bounds-checked in the native call: an id past
    the vocabulary or a position past the rotary table is an error, not a read past them."""
    import numpy as np

    model, arguments = _one_decode(make_checkpoint, monkeypatch)
    assert model.decode_logits(*arguments).shape == (1, model.embed.shape[0])
    vocab, positions = model.embed.shape[0], model.cos.shape[0]
    for ids, position in (([vocab], [0]), ([-1], [0]), ([0], [positions])):
        with pytest.raises(ValueError, match="outside the model's tables"):
            model.decode_logits(np.array(ids), np.array(position), *arguments[2:])


def test_the_native_step_refuses_a_linear_not_in_its_dtypes_format(make_checkpoint, monkeypatch):
    """``decode.cpp`` checks each linear's format against the step's dtype before it runs
    anything (a bf16 pair-packed weight in an fp32 step would be read as fp32 panels)."""
    from lamina.kernels.cpu.bf16_linear import NATIVE_FORMAT

    model, arguments = _one_decode(make_checkpoint, monkeypatch)
    model.decode_logits(*arguments)  # makes the step
    with torch.inference_mode():  # (the table was made in it)
        model._native[1]._table[0, 1] = NATIVE_FORMAT  # layer 0's Q/K/V format field
    with pytest.raises(ValueError, match="does not fit"):
        model.decode_logits(*arguments)
