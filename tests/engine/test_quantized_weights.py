"""The engine on quantized weights, quantized at load (``--quantization int8|fp8|bf16``) or
stored so by an fp8 checkpoint (vLLM's ``fp8``, llm-compressor's ``compressed-tensors``),
against Hugging Face ``transformers`` running the same dequantized weights: the engine's
quantized matmuls must compute exactly what the dequantized model does. Checkpoints of
methods the engine does not load fail at load, naming what."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lamina.kernels.weight_quant import WEIGHT_FORMATS, QuantizedWeight, quantize, quantize_int4
from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.loader import AWQ_ORDER
from tests.engine.helpers import (
    greedy,
    hf_greedy,
    make_engine,
    run_to_completion,
    saved_in,
    teacher_forced_logits,
)
from tests.engine.test_hf_parity import assert_logits_match, hf_model, sequences

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
        want = hf_greedy(reference, prompt, 200)
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
# Measured on the default model: int8 1.3-1.7%, fp8 6.3% (e4m3 keeps 3 mantissa bits),
# bf16 ~0.4% (7 mantissa bits).
RELATIVE_ERROR = {"int8": 0.03, "fp8": 0.10, "bf16": 0.01}


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_quantized_engine_tracks_the_unquantized_model(tiny_model, fmt):
    """On the default model, quantized logits stay near the fp32 ones (random weights:
    near-tied logits, so only the size of the error is checked, not the argmax)."""
    sequences, lens = [list(range(5, 40)), list(range(60, 70))], [20, 4]
    want = teacher_forced_logits(make_engine(tiny_model), sequences, lens)
    got = teacher_forced_logits(make_engine(tiny_model, quantization=fmt), sequences, lens)
    for w, g in zip(want, got, strict=True):
        assert 0 < (w - g).norm() / w.norm() < RELATIVE_ERROR[fmt]


def test_a_bf16_checkpoint_on_bf16_weights_runs_as_on_its_fp32_values(stories, tmp_path):
    """``--dtype float32 --quantization bf16`` on a bf16 checkpoint (the trained
    stories260K, saved in bf16) keeps its weights as they are stored (half the bytes of
    fp32) and computes what ``--dtype float32`` computes on them: the same greedy tokens,
    and logits equal up to summation order."""
    path = saved_in(stories, tmp_path / "bf16")
    prompts = dict(enumerate(PROMPTS))
    halves = make_engine(path, dtype="float32", quantization="bf16")
    assert halves.runner.model.weight_dtype == "bf16"
    want = run_to_completion(make_engine(path, dtype="float32"), prompts, greedy(100))
    assert run_to_completion(halves, prompts, greedy(100)) == want
    seqs, lens = [p + want[i][:30] for i, p in prompts.items()], [len(p) for p in PROMPTS]
    expected = teacher_forced_logits(make_engine(path, dtype="float32"), seqs, lens)
    got = teacher_forced_logits(make_engine(path, dtype="float32", quantization="bf16"), seqs, lens)
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


def fp8_checkpoint(source: Path, target: Path, method: str, per_tensor: bool) -> Path:
    """``source`` saved as a pre-quantized fp8 checkpoint in the layout vLLM's ``fp8``
    (a scale per tensor) or llm-compressor's ``compressed-tensors`` (``float-quantized``,
    a ``(N, 1)`` scale per channel) write: each linear's ``weight`` in e4m3 with its
    ``weight_scale`` and a static ``input_scale``; the tied LM head left unquantized."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    for name in list(tensors):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.split(".")[-1] not in LINEARS:
            continue
        weight = tensors[name]
        if per_tensor:
            scale = weight.abs().max() / 448.0
            tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[prefix + ".weight_scale"] = scale.reshape(())
        else:
            quantized = quantize(weight, "fp8")
            tensors[name] = quantized.qweight
            tensors[prefix + ".weight_scale"] = quantized.scale[:, None]
        tensors[prefix + ".input_scale"] = torch.tensor(0.02)
    config = json.loads((source / "config.json").read_text())
    if method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        strategy = "tensor" if per_tensor else "channel"
        scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": scheme,
                    "input_activations": scheme | {"strategy": "tensor", "dynamic": False},
                }
            },
            "ignore": ["lm_head"],
        }
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config))
    return target


def dequantize_fp8_checkpoint(source: Path, target: Path) -> Path:
    """A pre-quantized fp8 checkpoint's weights as the fp32 values they stand for."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        prefix = name.removesuffix("weight_scale")
        scale = tensors.pop(name).to(torch.float32).reshape(-1, 1)
        tensors.pop(prefix + "input_scale")
        tensors[prefix + "weight"] = tensors[prefix + "weight"].to(torch.float32) * scale
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("method", "per_tensor"),
    [("compressed-tensors", False), ("compressed-tensors", True), ("fp8", True)],
)
def test_an_fp8_checkpoint_loads_and_matches_transformers_on_its_dequantized_weights(
    stories, tmp_path, method, per_tensor
):
    """On the trained stories260K saved as fp8 checkpoints: the engine runs the stored
    e4m3 weights on the native matmul (its static activation scales unused) and its
    greedy tokens and logits are those of ``transformers`` on the dequantized weights."""
    path = fp8_checkpoint(stories, tmp_path / "fp8", method, per_tensor)
    reference = hf_model(dequantize_fp8_checkpoint(path, tmp_path / "dequantized"))
    engine = make_engine(path, max_num_batched_tokens=64)
    assert engine.runner.model.weight_dtype == "fp8"
    assert engine.runner.model.layers[0].qkv.__class__.__name__ == "PackedQuantLinear"
    ours = run_to_completion(engine, dict(enumerate(PROMPTS)), greedy(100))
    for i, prompt in enumerate(PROMPTS):
        want = hf_greedy(reference, prompt, 100)
        assert ours[i] == want, i
    sequences, lens = [p + ours[i][:30] for i, p in enumerate(PROMPTS)], [len(p) for p in PROMPTS]
    got = teacher_forced_logits(make_engine(path, max_num_batched_tokens=64), sequences, lens)
    for seq, n, logits in zip(sequences, lens, got, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0, n - 1 :].float()
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="already quantized"):
        make_engine(path, quantization="int8")


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
                },
            },
            "config_groups.group_0.weights",
        ),
    ],
)
def test_an_unsupported_quantized_checkpoint_fails_at_load_naming_what(
    tiny_model, tmp_path, quantization_config, named
):
    path = tmp_path / "quantized"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        make_engine(path)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``(..., 8)`` codes as one int32 each, the first in the lowest nibble."""
    packed = torch.zeros(codes.shape[:-1], dtype=torch.int32)
    for i in range(8):
        packed |= codes[..., i].to(torch.int32) << (4 * i)
    return packed


def gptq_symmetric(weight: torch.Tensor, group: int) -> QuantizedWeight:
    """GPTQ's symmetric 4-bit grid (zero point 8, ``scale = 2 max|w| / 15`` per group),
    rounded to the nearest code: what a ``sym: true`` GPTQ checkpoint holds."""
    rows, inputs = weight.shape
    w = weight.reshape(rows, inputs // group, group)
    scale = (2 * w.abs().amax(dim=2) / 15).clamp(min=1e-8).half().float()
    codes = ((w / scale[..., None]).round() + 8).clamp(0, 15).reshape(rows, inputs)
    zero = torch.full_like(scale, 8.0)
    return QuantizedWeight("int4", codes.to(torch.uint8), scale, zero, group)


SAME_INPUT = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}
"""Projections that read the same input (one act-order input order between them)."""


def int4_checkpoint(
    source: Path, target: Path, method: str, group: int, act_order: bool = False
) -> Path:
    """``source`` written as a 4-bit checkpoint in the published layout of ``method``:
    ``gptq`` (AutoGPTQ's original format: symmetric, zero points stored one less, a
    ``g_idx``), ``gptq_v2`` (asymmetric, zero points as they are) or ``awq`` (AutoAWQ's
    GEMM packing); fp16 scales; the LM head and embeddings left as they are. With
    ``act_order`` (GPTQ's ``desc_act``), each layer's inputs are quantized in a shuffled
    order, shared by the projections that read the same input, and ``g_idx`` says each
    input's group. Also writes ``target``-dequantized: the same model with each linear's
    dequantized values."""
    orders: dict[str, torch.Tensor] = {}
    shutil.copytree(source, target)
    reference = target.with_name(target.name + "-dequantized")
    shutil.copytree(source, reference)
    tensors = load_file(str(source / "model.safetensors"))
    dequantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        prefix = name.removesuffix("weight")
        weight = tensors.pop(name)
        k = weight.shape[1]
        layer, projection = prefix.rstrip(".").rsplit(".", 1)
        reads = layer + "." + SAME_INPUT.get(projection, projection)
        order = orders.setdefault(reads, torch.randperm(k)) if act_order else None
        stored = weight if order is None else weight[:, order]
        if method == "gptq":
            q = gptq_symmetric(stored, group)
        else:
            q = quantize_int4(stored, group)
            q = QuantizedWeight("int4", q.qweight, q.scale.half().float(), q.zero, group)
        q = QuantizedWeight("int4", q.qweight, q.scale, q.zero, group, order)
        dequantized[name] = q.dequantize()
        codes = q.qweight.T.contiguous()  # (K, N) in the stored order
        if order is not None:  # back to the model's order; g_idx names each input's group
            codes = codes[torch.argsort(order)]
            tensors[prefix + "g_idx"] = (torch.argsort(order) // group).to(torch.int32)
        zeros = q.zero.T.to(torch.int32)  # (G, N)
        n = codes.shape[1]
        if method == "awq":
            order = list(AWQ_ORDER)
            tensors[prefix + "qweight"] = _pack_nibbles(codes.view(k, n // 8, 8)[..., order])
            tensors[prefix + "qzeros"] = _pack_nibbles(zeros.view(-1, n // 8, 8)[..., order])
        else:
            stored = (zeros - 1) & 0xF if method == "gptq" else zeros
            tensors[prefix + "qweight"] = _pack_nibbles(codes.view(k // 8, 8, n).transpose(1, 2))
            tensors[prefix + "qzeros"] = _pack_nibbles(stored.view(-1, n // 8, 8))
            tensors.setdefault(prefix + "g_idx", (torch.arange(k) // group).to(torch.int32))
        tensors[prefix + "scales"] = q.scale.T.half().contiguous()
    config = json.loads((source / "config.json").read_text())
    save_file(dequantized, str(reference / "model.safetensors"))
    (reference / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": method == "gptq", "checkpoint_format": method}
    )  # fmt: skip
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gptq_and_awq_checkpoints_load_and_match_their_dequantized_weights(
    make_checkpoint, tmp_path, method, family, monkeypatch
):
    """A 4-bit checkpoint written here in each published layout (groups of 32 inputs,
    Qwen2's q/k/v biases) loads as int4 on the native matmul; its logits, prefill and
    decode, match ``transformers`` on the dequantized weights, and so do its greedy
    tokens."""
    path = int4_checkpoint(make_checkpoint(family), tmp_path / method, method, 32)
    reference = hf_model(path.with_name(path.name + "-dequantized"))
    engine = make_engine(path)
    model = engine.runner.model
    assert model.weight_dtype == "int4" and engine.model_config.quantization.group_size == 32
    assert model.layers[0].gate_up.__class__.__name__ == "PackedQuantSiluMul"
    assert_logits_match(engine, reference)
    prompts = dict(zip("ab", sequences(256, [5, 19], seed=3), strict=True))
    ours = run_to_completion(make_engine(path), prompts, greedy(16))
    for request_id, prompt in prompts.items():
        want = hf_greedy(reference, prompt, 16)
        assert ours[request_id] == want, request_id


@pytest.mark.parametrize("method", ["gptq", "gptq_v2"])
def test_an_act_order_gptq_checkpoint_loads_and_matches_its_dequantized_weights(
    make_checkpoint, tmp_path, method
):
    """``desc_act``: each input's group is in ``g_idx``, out of order. The engine stores the
    inputs so that each group's are together and gathers x in that order before the
    matmul, in the layer-by-layer forward and in the native decode step alike."""
    torch.manual_seed(5)
    path = int4_checkpoint(make_checkpoint("qwen2"), tmp_path / method, method, 32, True)
    reference = hf_model(path.with_name(path.name + "-dequantized"))
    for native in (True, False):
        engine = make_engine(path)
        engine.runner.model.native_decode = native
        assert engine.runner.model.layers[0].qkv.input_order is not None
        assert_logits_match(engine, reference)
        decoded_by = engine.runner.model._native  # (cache, the native step) once it ran
        assert (decoded_by is not None and decoded_by[1] is not None) == native


def test_a_g_idx_whose_groups_are_the_wrong_size_fails_at_load(make_checkpoint, tmp_path):
    path = int4_checkpoint(make_checkpoint("llama"), tmp_path / "gptq", "gptq", 32)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = torch.zeros_like(tensors[name])  # every input in group 0
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="g_idx"):
        make_engine(path)


def test_an_unknown_quantization_is_refused():
    from lamina.services.engine_worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"bf16.*CPU"):  # on a GPU, bf16 is a dtype
        EngineConfig(quantization="bf16", device="cuda")


def test_the_int4_layouts_unpack_as_published():
    """One int32 0x76543210 holds codes 0-7, lowest nibble first: GPTQ's qweight as eight
    consecutive inputs of one column, GPTQ's qzeros as eight consecutive columns, AWQ's
    as columns 0, 2, 4, 6, 1, 3, 5, 7."""
    from lamina.services.engine_worker.engine.loader import unpack_awq, unpack_gptq

    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    codes, zeros = unpack_gptq(word, word)
    assert codes.flatten().tolist() == list(range(8)) and codes.shape == (8, 1)
    assert zeros.tolist() == [list(range(8))]
    codes, zeros = unpack_awq(word, word)
    assert codes.tolist() == zeros.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    negative = torch.tensor([[-1]], dtype=torch.int32)  # 0xFFFFFFFF: every code 15
    assert unpack_gptq(negative, negative)[0].flatten().tolist() == [15] * 8
