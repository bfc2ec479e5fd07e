"""The engine against Hugging Face ``transformers`` on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAMILIES
from tests.engine.helpers import (
    greedy,
    hf_greedy,
    make_engine,
    run_to_completion,
    teacher_forced_logits,
)


def hf_model(path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_teacher_forced_decode_logits_match(family, make_checkpoint):
    path = make_checkpoint(family)
    assert_logits_match(make_engine(path), hf_model(path))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_match_on_the_native_matmul(family, make_checkpoint, monkeypatch):
    """The test checkpoints' weights are all below ``NATIVE_MIN_ELEMENTS``, so the tests
    above run ``F.linear``; here every linear is the native matmul and the MLP's gate/up
    the fused gated one, with an MLP width of 72 (a partial 16-column panel) and biases
    (Qwen2's q/k/v; Llama's attention and MLP)."""
    from lamina.kernels.cpu import PackedLinear, PackedSiluMul

    monkeypatch.setenv("LAMINA_CPU_LINEAR", "native")  # the default only with AVX2
    monkeypatch.setattr("lamina.kernels.linear.NATIVE_MIN_ELEMENTS", 0)
    biases = dict(attention_bias=True, mlp_bias=True) if family == "llama" else {}
    path = make_checkpoint(family, intermediate_size=72, **biases)
    engine = make_engine(path)
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.qkv, PackedLinear) and isinstance(layer.gate_up, PackedSiluMul)
    assert_logits_match(engine, hf_model(path))


def assert_logits_match(engine, hf) -> None:
    # Different prompt lengths (one spans several blocks, one ends mid-block), then 12
    # teacher-forced decode steps with all three sequences in the same batch.
    prompt_lens = [5, 37, 16]
    seqs = sequences(256, [p + 12 for p in prompt_lens])
    ours = teacher_forced_logits(engine, seqs, prompt_lens)
    for seq, p, got in zip(seqs, prompt_lens, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, p - 1 :].float()
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_tokens_match_hf_generate(family, make_checkpoint):
    path = make_checkpoint(family)
    engine = make_engine(path)
    hf = hf_model(path)
    prompts = dict(zip("abcd", sequences(256, [3, 19, 40, 8], seed=1), strict=True))
    ours = run_to_completion(engine, prompts, greedy(20))
    for request_id, prompt in prompts.items():
        assert ours[request_id] == hf_greedy(hf, prompt, 20), request_id


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_and_track_hf(dtype, make_checkpoint):
    path = make_checkpoint("qwen2", dtype=dtype)
    engine = make_engine(path, dtype=str(dtype).removeprefix("torch."))  # auto: fp32 on CPUs
    assert engine.runner.model.dtype == dtype
    hf = hf_model(path, dtype=dtype)
    seq = sequences(256, [24])[0]
    got = teacher_forced_logits(engine, [seq], [20])[0]
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0, 19:].float()
    # Half precision: same computation, different rounding order; compare directions.
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.995, cos


def test_half_checkpoint_can_run_in_fp32(make_checkpoint):
    engine = make_engine(make_checkpoint("llama", dtype=torch.bfloat16), dtype="float32")
    assert engine.runner.model.dtype == torch.float32
    assert engine.runner.kv_caches[0].dtype == torch.float32


def test_sharded_checkpoint_with_index(make_checkpoint):
    sharded = make_checkpoint("llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    seqs = sequences(256, [21])
    got = teacher_forced_logits(make_engine(sharded), seqs, [21])[0]
    with torch.no_grad():
        want = hf_model(sharded)(torch.tensor(seqs)).logits[0, 20:]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
