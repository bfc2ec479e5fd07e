"""The batched LoRA product, grouped by adapter, against the per-token reference; and
the gated MLP projection before its activation (what a LoRA adds to) on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lamina.kernels.cpu import PackedQuantSiluMul, PackedSiluMul
from lamina.kernels.linear import SiluMulLinear, TorchLinear
from lamina.kernels.lora import DENSE_MAX_ROWS, LoraBatch, add_lora
from lamina.kernels.reference import silu_and_mul
from lamina.kernels.reference.lora import add_lora_reference
from lamina.kernels.weight_quant import quantize

CPU = torch.device("cpu")


CHUNKS = [2] * 200 + [-1] * 7 + [0] * 90 + [2] * 5  # prefill chunks: runs of one slot


@pytest.mark.parametrize(
    ("token_slots", "form"),
    [
        ([0, 0, 0, 0, 0], "runs"),  # one adapter, every row
        ([-1, 2, 2, 0, -1, 2, 1, 1], "dense"),  # adapters and the base model, interleaved
        ([-1, 3, 3], "runs"),  # one adapter, some rows
        (CHUNKS, "runs"),  # too many rows for the dense product, in few runs
        ([1, 0] * (DENSE_MAX_ROWS // 2 + 1), "gathered"),  # too many rows, too many runs
    ],
)
def test_batched_product_matches_the_per_token_reference(token_slots, form):
    torch.manual_seed(0)
    slots, rank, k, n = 4, 6, 40, 24
    a, b = torch.randn(slots, rank, k), torch.randn(slots, n, rank)
    x = torch.randn(len(token_slots), k)
    base = torch.randn(len(token_slots), n)
    indices = np.asarray(token_slots, dtype=np.int64)
    want = add_lora_reference(base.clone(), x, a, b, torch.from_numpy(indices))
    stacked_a = a.reshape(slots * rank, k)  # the slots' layout: rows of A, rows of B^T
    stacked_b = b.transpose(1, 2).reshape(slots * rank, n)
    batch = LoraBatch.of(indices, CPU)
    assert batch is not None
    runs = all(isinstance(rows, slice) for _, rows in batch.groups)
    assert form == ("dense" if batch.token_slots is not None else "runs" if runs else "gathered")
    got = add_lora(base.clone(), x, stacked_a, stacked_b, rank, batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(got, base)
    if form == "dense":  # the gathered product, on the same rows, agrees
        grouped = LoraBatch(batch.groups)
        got = add_lora(base.clone(), x, stacked_a, stacked_b, rank, grouped)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_step_without_adapters_has_no_lora_batch():
    assert LoraBatch.of(np.asarray([-1, -1], dtype=np.int64), CPU) is None


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("intermediate", [32, 172])  # a multiple of the panel, and not
def test_gated_projection_before_activation_on_every_path(rows, intermediate):
    torch.manual_seed(0)
    weight, bias = torch.randn(2 * intermediate, 64), torch.randn(2 * intermediate)
    x = torch.randn(rows, 64)
    want = F.linear(x, weight, bias)
    for gated in (
        PackedSiluMul(weight, bias),
        SiluMulLinear(TorchLinear(weight, bias), silu_and_mul),
    ):
        got = gated.pre_activation(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(silu_and_mul(got), gated(x), atol=1e-4, rtol=1e-4)
    quantized = quantize(weight, "int8")
    got = PackedQuantSiluMul(quantized, bias).pre_activation(x)
    torch.testing.assert_close(
        got, F.linear(x, quantized.dequantize_stored(torch.float32), bias), atol=1e-3, rtol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_product_matches_the_per_token_reference(dtype):
    """Punica's BGMV in Triton (on CPU under the interpreter): slot widths, outputs and
    inputs that are not multiples of the blocks, base-model rows untouched."""
    pytest.importorskip("triton")
    from lamina.kernels.triton.lora import add_lora as triton_add_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    slots, width, k, n = 3, 48, 300, 200
    a = torch.randn(slots, width, k) / k**0.5
    b = torch.randn(slots, n, width) / width**0.5
    token_slots = torch.tensor([2, -1, 0, 2, 1, -1])
    x = torch.randn(len(token_slots), k)
    base = torch.randn(len(token_slots), n)
    want = add_lora_reference(base.clone(), x, a, b, token_slots)
    stacked_a = a.reshape(slots * width, k).to(device, dtype)
    stacked_b = b.transpose(1, 2).reshape(slots * width, n).to(device, dtype)
    got = triton_add_lora(
        base.clone().to(device, dtype),
        x.to(device, dtype),
        stacked_a,
        stacked_b,
        width,
        token_slots.to(device),
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    assert torch.equal(got[1].float().cpu(), base[1].to(dtype).float())  # the base model's row


@pytest.mark.parametrize("n", [200, 600])  # one block of outputs; blocks of uneven spans
@pytest.mark.parametrize(
    "token_slots", [[2, -1, 0, 2, 1, -1], [1], [0] * 40, [1, 1, 1, -1, 0, 0, 0, 0, 0]]
)
def test_native_product_matches_the_per_token_reference(token_slots, n):
    """The native BGMV (``kernels/cpu/lora.cpp``): slot widths and sizes that are not
    multiples of a vector, strided rows of ``out`` and ``x`` (a fused output's columns),
    base-model rows untouched."""
    from lamina.kernels.cpu.lora import add_lora as native_add_lora

    torch.manual_seed(0)
    slots, width, k = 3, 48, 300
    a = torch.randn(slots, width, k) / k**0.5
    b = torch.randn(slots, n, width) / width**0.5
    slots_t = torch.tensor(token_slots)
    x = torch.randn(len(token_slots), k + 5)[:, 5:]  # rows with a stride
    base = torch.randn(len(token_slots), n + 7)
    want = add_lora_reference(base[:, :n].clone(), x, a, b, slots_t)
    stacked_a = a.reshape(slots * width, k)
    stacked_b = b.transpose(1, 2).reshape(slots * width, n).contiguous()
    got = base.clone()
    native_add_lora(got[:, :n], x, stacked_a, stacked_b, width, slots_t)
    torch.testing.assert_close(got[:, :n], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[:, n:], base[:, n:])  # nothing past the view's columns
    base_rows = slots_t < 0
    assert torch.equal(got[base_rows], base[base_rows])
