"""The weight arena (:mod:`lamina.kernels.cpu.hugepages`): tensors packed into
huge-page-advised mappings, each on a cache line, alive as long as any tensor in them."""

from __future__ import annotations

import gc

import pytest
import torch

from lamina.kernels.cpu import PackedLinear, PackedQuantLinear
from lamina.kernels.cpu.hugepages import ALIGN, Arena
from lamina.kernels.weight_quant import quantize


def vm_flags(address: int) -> list[str]:
    """The kernel's flags for the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


def test_tensors_are_packed_into_one_advised_mapping_on_cache_lines():
    arena = Arena(chunk=4 << 20)
    a = arena.empty(3, torch.float32)
    b = arena.empty(1000, torch.uint8)
    c = arena.empty(10, torch.int64)
    assert (a.numel(), a.dtype, b.numel(), b.dtype, c.dtype) == (
        3, torch.float32, 1000, torch.uint8, torch.int64
    )  # fmt: skip
    assert b.data_ptr() - a.data_ptr() == ALIGN  # 12 bytes, rounded up to a line
    assert c.data_ptr() - b.data_ptr() == 1024
    assert all(t.data_ptr() % ALIGN == 0 for t in (a, b, c))
    assert "hg" in vm_flags(a.data_ptr())  # MADV_HUGEPAGE


def test_a_full_chunk_starts_another_and_a_large_tensor_gets_its_own_mapping():
    arena = Arena(chunk=4 << 20)
    first = arena.empty(3 << 20, torch.uint8)
    second = arena.empty(2 << 20, torch.uint8)  # does not fit the first chunk's last MiB
    large = arena.empty(5 << 20, torch.uint8)
    after = arena.empty(1 << 20, torch.uint8)  # the second chunk still has room
    assert second.data_ptr() != first.data_ptr() + (3 << 20)
    assert after.data_ptr() == second.data_ptr() + (2 << 20)
    assert "hg" in vm_flags(large.data_ptr())
    for t in (first, second, large, after):
        t.fill_(7)
    assert sum(int(t.sum()) for t in (first, second, large, after)) == 7 * (11 << 20)


def test_a_tensor_outlives_the_arena_and_its_neighbours():
    arena = Arena(chunk=4 << 20)
    kept = arena.empty(100, torch.float32)
    dropped = arena.empty(100, torch.float32)
    kept.fill_(1.5)
    del arena, dropped
    gc.collect()
    assert float(kept.sum()) == 150.0


@pytest.mark.parametrize("quantized", [False, True])
def test_packed_weights_live_on_huge_page_advised_memory(quantized):
    weight = torch.randn(48, 64)
    if quantized:
        q = quantize(weight, "int8")
        linear, weight = PackedQuantLinear(q, None), q.dequantize()
    else:
        linear = PackedLinear(weight, None)
    assert "hg" in vm_flags(linear.packed.data_ptr())
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ weight.T, rtol=1e-5, atol=1e-4)
