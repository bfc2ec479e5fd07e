"""The engine with quantized KV caches: pool sizing, the checkpoint's fp8 scales, and
outputs close to the unquantized cache's on a real trained checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lamina.services.engine_worker.engine.errors import ModelLoadError
from tests.engine.helpers import greedy, make_engine, run_to_completion, teacher_forced_logits


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_pool_holds_four_times_the_fp32_blocks(tiny_model, kv_cache_dtype):
    budget = dict(num_kv_blocks=None, kv_cache_memory_bytes=8 << 20)
    fp32 = make_engine(tiny_model, **budget).blocks.num_blocks
    engine = make_engine(tiny_model, kv_cache_dtype=kv_cache_dtype, **budget)
    quantized = engine.blocks.num_blocks
    if kv_cache_dtype == "fp8":
        assert quantized == 4 * fp32
    else:  # int8 pays one fp32 scale per (block, KV head) for keys and values
        assert 3.9 * fp32 < quantized < 4 * fp32
    cache = engine.runner.kv_caches[0]
    assert cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    assert cache.shape[1] == quantized


def test_unknown_kv_cache_dtype_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(tiny_model, kv_cache_dtype="fp4")


def _with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file(weights | extra, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_fp8_scales_come_from_the_checkpoint_per_tensor_or_per_head(tiny_model, tmp_path):
    k_scale = torch.tensor(0.25)  # per tensor
    v_scale = torch.tensor([0.5, 2.0])  # per KV head (the tiny model has 2)
    extra = {"model.layers.1.self_attn.k_scale": k_scale}
    extra["model.layers.1.self_attn.v_scale"] = v_scale
    model = _with_tensors(tiny_model, tmp_path / "scaled", extra)
    engine = make_engine(model, kv_cache_dtype="fp8")
    scales = engine.runner.kv_scales
    assert torch.equal(scales[1], torch.tensor([[0.25, 0.25], [0.5, 2.0]]))
    assert torch.equal(scales[0], torch.ones(2, 2))  # no scales in the checkpoint: 1.0
    out = run_to_completion(engine, {"a": list(range(5, 40))}, greedy(4))
    assert len(out["a"]) == 4


def test_fp8_scale_of_the_wrong_shape_names_the_tensor(tiny_model, tmp_path):
    extra = {
        "model.layers.0.self_attn.k_scale": torch.ones(3),
        "model.layers.0.self_attn.v_scale": torch.ones(1),
    }
    model = _with_tensors(tiny_model, tmp_path / "bad", extra)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_scale"):
        make_engine(model, kv_cache_dtype="fp8")


# Stated tolerances on stories260K (head_dim 8: few dimensions to average rounding over,
# so a harder case than usual models): over 200 teacher-forced positions per sequence,
# the largest logit error and the share of positions whose argmax is unchanged.
TOLERANCE = {"int8": (2.0, 0.9), "fp8": (8.0, 0.75)}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache_logits_stay_close_on_a_trained_model(stories, kv_cache_dtype):
    prompts = [[1, 400, 261, 403], [1, 306, 323, 283, 272, 260, 389], [1, 73, 87, 316]]
    engine = make_engine(stories, max_num_batched_tokens=64)
    outputs = run_to_completion(engine, dict(enumerate(map(list, prompts))), greedy(200))
    sequences = [p + outputs[i] for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    want = teacher_forced_logits(make_engine(stories), sequences, lens)
    got = teacher_forced_logits(
        make_engine(stories, kv_cache_dtype=kv_cache_dtype), sequences, lens
    )
    max_error, min_agreement = TOLERANCE[kv_cache_dtype]
    for w, g in zip(want, got, strict=True):
        assert (w - g).abs().max() < max_error
        assert (w.argmax(-1) == g.argmax(-1)).float().mean() >= min_agreement
