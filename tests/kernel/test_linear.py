"""Linear layers: oneDNN's packed matmul and the native choice against ``F.linear``, and
which one runs where (the native matmul itself: ``test_cpu_kernels.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.kernels import reference
from lamina.kernels.cpu import PackedLinear, PackedQuantLinear, PackedQuantSiluMul, PackedSiluMul
from lamina.kernels.linear import (
    NATIVE_MIN_ELEMENTS,
    DequantLinear,
    OneDnnLinear,
    SiluMulLinear,
    TorchLinear,
    gated_linear_factory,
    linear_factory,
    native_linear,
    onednn_bf16,
)
from lamina.kernels.weight_quant import quantize

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 3, 64, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_matches_f_linear(rows, with_bias):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(rows, 80)
    bias = torch.randn(96) if with_bias else None
    got = OneDnnLinear(weight, bias)(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bf16 matmul on this CPU")
@pytest.mark.parametrize("rows", [1, 64, 700])
def test_onednn_linear_in_bf16_is_f_linear_on_a_packed_weight(rows):
    """Packing changes where the weight's bytes lie, not the arithmetic: bf16 products
    accumulated in fp32 either way (equal to the bit on the AMX VM; another CPU's oneDNN
    may block the two calls differently, so within bf16's rounding of the output)."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80, dtype=torch.bfloat16), torch.randn(rows, 80).bfloat16()
    bias = torch.randn(96, dtype=torch.bfloat16)
    got = OneDnnLinear(weight, bias)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("out_features", [96, NATIVE_MIN_ELEMENTS // 128])
def test_native_linear_matches_f_linear_on_both_paths(rows, out_features):
    torch.manual_seed(0)
    weight, x, bias = (
        torch.randn(out_features, 128),
        torch.randn(rows, 128),
        torch.randn(out_features),
    )
    linear = native_linear(weight, bias)
    small = weight.numel() < NATIVE_MIN_ELEMENTS
    assert isinstance(linear, TorchLinear if small else PackedLinear)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def _built(device, dtype, backend, quantization=None) -> type:
    """The type of linear the factory makes for a weight above the native minimum."""
    weight = torch.randn(NATIVE_MIN_ELEMENTS // 128, 128, dtype=dtype)
    return type(linear_factory(device, dtype, backend, quantization)(weight, None))


def test_which_linear_runs_where(monkeypatch):
    monkeypatch.delenv("LAMINA_CPU_LINEAR", raising=False)
    cuda = torch.device("cuda")
    assert _built(CPU, torch.float32, "cpu") is PackedLinear
    assert _built(CPU, torch.float32, "cpu", "int8") is PackedQuantLinear
    assert _built(CPU, torch.float32, "cpu", "fp8") is PackedQuantLinear
    with monkeypatch.context() as patch:  # no AVX2 (the matmul's micro-kernel): oneDNN
        patch.setattr("lamina.kernels.linear.vectorized", lambda: False)
        assert _built(CPU, torch.float32, "cpu") is OneDnnLinear
        assert _built(CPU, torch.float32, "cpu", "int8") is DequantLinear
    assert _built(CPU, torch.float32, "reference") is OneDnnLinear
    assert _built(CPU, torch.float32, "reference", "int8") is DequantLinear
    bf16 = OneDnnLinear if onednn_bf16() else TorchLinear
    assert _built(CPU, torch.bfloat16, "reference") is bf16
    assert _built(CPU, torch.float16, "reference") is TorchLinear
    with monkeypatch.context() as patch:  # a CPU where oneDNN has no bf16 (AVX2 alone)
        patch.setattr("lamina.kernels.linear.onednn_bf16", lambda: False)
        assert _built(CPU, torch.bfloat16, "reference") is TorchLinear
    assert _built(cuda, torch.float32, "triton") is TorchLinear
    assert _built(cuda, torch.bfloat16, "triton", "fp8").__name__ == "TritonQuantLinear"
    assert _built(cuda, torch.bfloat16, "reference", "fp8") is DequantLinear
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "onednn")
    assert _built(CPU, torch.float32, "cpu") is OneDnnLinear
    assert _built(CPU, torch.float32, "cpu", "int8") is DequantLinear
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "native")
    with pytest.raises(ValueError, match="native"):
        linear_factory(CPU, torch.float32, "reference")
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "torch")
    assert _built(CPU, torch.float32, "cpu") is TorchLinear
    assert _built(CPU, torch.bfloat16, "reference") is TorchLinear
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="LAMINA_CPU_LINEAR"):
        linear_factory(CPU, torch.float32)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("rows", [1, 64])
def test_gated_linear_is_fused_only_on_the_native_matmul(monkeypatch, backend, rows):
    """With the native linears a big gate/up is one fused matmul; a small one, and every
    gate/up with other linears, is the linear then ``silu_and_mul``: all agree."""
    monkeypatch.delenv("LAMINA_CPU_LINEAR", raising=False)
    monkeypatch.setattr("lamina.kernels.linear.vectorized", lambda: True)
    torch.manual_seed(0)
    make = gated_linear_factory(CPU, torch.float32, backend, reference.silu_and_mul)
    x = torch.randn(rows, 128)
    for width in (48, NATIVE_MIN_ELEMENTS // 128):
        gate_up, bias = torch.randn(width, 128) / 128**0.5, torch.randn(width)
        gated = make(gate_up, bias)
        fused = backend == "cpu" and gate_up.numel() >= NATIVE_MIN_ELEMENTS
        assert isinstance(gated, PackedSiluMul if fused else SiluMulLinear)
        want = reference.silu_and_mul(F.linear(x, gate_up, bias))
        torch.testing.assert_close(gated(x), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_linears_quantize_every_weight_and_fuse_on_the_native_matmul(backend, fmt):
    """With a quantization, every linear (small ones too) and gate/up runs on the quantized
    weight: the native matmul (gate/up fused) with the ``cpu`` kernels, else the
    dequantizing reference; both give dequantize-then-matmul."""
    torch.manual_seed(0)
    linear = linear_factory(CPU, torch.float32, backend, fmt)
    gated = gated_linear_factory(CPU, torch.float32, backend, reference.silu_and_mul, fmt)
    native = backend == "cpu"
    x = torch.randn(3, 128)
    weight, bias = torch.randn(48, 128), torch.randn(48)
    made = linear(weight, bias)
    assert isinstance(made, PackedQuantLinear if native else DequantLinear)
    dequantized = quantize(weight, fmt).dequantize()
    torch.testing.assert_close(made(x), F.linear(x, dequantized, bias), atol=1e-4, rtol=1e-5)
    fused = gated(weight, bias)
    assert isinstance(fused, PackedQuantSiluMul if native else SiluMulLinear)
    want = reference.silu_and_mul(F.linear(x, dequantized, bias))
    torch.testing.assert_close(fused(x), want, atol=1e-4, rtol=1e-5)
    already = quantize(weight, "int8")  # a quantized checkpoint's weight runs as it is
    plain = linear_factory(CPU, torch.float32, backend)
    torch.testing.assert_close(plain(already, None)(x), F.linear(x, already.dequantize()))
