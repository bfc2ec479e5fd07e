"""Weight quantization at load (``kernels/weight_quant.py``): what each format stores and
how far its dequantized values may be from the weight."""

from __future__ import annotations

import pytest
import torch

from lamina.kernels.weight_quant import QuantizedWeight, concat, quantize, quantize_int4


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 100, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    weight[7] = 0  # a row of zeros
    return weight


def test_int8_is_symmetric_per_row_within_half_a_step():
    weight = _weight()
    q = quantize(weight, "int8")
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (24,)
    peak = weight.abs().amax(dim=1)
    assert q.qweight.abs().amax(dim=1)[peak > 0].eq(127).all()  # each row's range used
    assert q.scale[7] == 1 and q.qweight[7].eq(0).all()
    error = (q.dequantize() - weight).abs()
    assert (error <= q.scale[:, None] / 2 * (1 + 1e-6)).all()


def test_fp8_maps_each_rows_peak_to_448_within_e4m3_rounding():
    weight = _weight()
    q = quantize(weight, "fp8")
    assert q.qweight.dtype == torch.float8_e4m3fn
    rows = weight.abs().amax(dim=1) > 0
    assert q.qweight.to(torch.float32).abs().amax(dim=1)[rows].eq(448).all()
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; a subnormal
    # (below 2^-6 before scaling) within half its step, 2^-10.
    error = (q.dequantize() - weight).abs()
    bound = torch.maximum(weight.abs() * 2**-4, q.scale[:, None] * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()


def test_rows_stack_exactly_and_formats_do_not_mix():
    weight = _weight()
    parts = [quantize(weight[:10], "int8"), quantize(weight[10:], "int8")]
    stacked = concat(parts)
    assert torch.equal(stacked.dequantize(), quantize(weight, "int8").dequantize())
    with pytest.raises(ValueError, match="formats"):
        concat([parts[0], quantize(weight, "fp8")])


def test_int4_groups_span_their_range_with_integer_zero_points():
    weight = _weight()
    q = quantize_int4(weight, 25)
    assert q.qweight.dtype == torch.uint8 and int(q.qweight.max()) <= 15
    assert q.scale.shape == q.zero.shape == (24, 4)
    assert torch.equal(q.zero, q.zero.round()) and q.scale[7].eq(1).all()
    error = (q.dequantize() - weight).abs()
    step = q.scale.repeat_interleave(25, dim=1)
    assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all()  # half a step, or the clamped edge
    stacked = concat([quantize_int4(weight[:10], 25), quantize_int4(weight[10:], 25)])
    assert torch.equal(stacked.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="formats"):
        concat([q, quantize_int4(weight, 50)])
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(weight, 30)


def test_reordered_inputs_dequantize_in_the_models_order_and_stack_only_alike():
    weight = _weight()
    order = torch.randperm(100)
    stored = quantize_int4(weight[:, order], 25)  # quantized in the stored order
    q = QuantizedWeight("int4", stored.qweight, stored.scale, stored.zero, 25, order)
    torch.testing.assert_close(q.dequantize()[:, order], stored.dequantize())
    assert torch.equal(concat([q, q]).input_order, order)
    with pytest.raises(ValueError, match="orders"):
        concat([q, stored])


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="int8, fp8"):
        quantize(torch.ones(2, 2), "int4")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(2, 2, 2), "int8")
    assert isinstance(quantize(torch.ones(2, 2, dtype=torch.bfloat16), "fp8"), QuantizedWeight)
