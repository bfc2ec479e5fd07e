"""The batched LoRA product on the GPU: each row through its own adapter, in two kernels.

The weights are laid out as :mod:`lamina.kernels.lora` takes them: per fused linear, the
slots' ``A`` stacked ``(S × W, K)`` and their ``B`` transposed ``(S × W, N)``. Punica's
BGMV: a *shrink* kernel computes each row's ``v = A[s] @ x`` ``(W,)`` (one program per row
and block of ``W``, reading its slot's rows of ``A``), an *expand* kernel adds ``B[s] @
v`` to the row's output (one program per row and block of ``N``). Rows of the base model
(slot -1) cost one load each. Rows of one adapter read the same ``A`` and ``B``, which
stay in L2 across them; a decode step's few rows per adapter are what it is for. Both
accumulate in fp32. :func:`lamina.kernels.reference.lora.add_lora_reference` is the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_N = 128


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    v_ptr,
    K,
    W,
    stride_x,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    a_rows = a_ptr + (slot * W + w)[:, None] * K
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=(w[:, None] < W) & (k[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(v_ptr + row * W + w, acc, mask=w < W)


@triton.jit
def _lora_expand_kernel(
    v_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    N,
    W,
    stride_b,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, W, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        v = tl.load(v_ptr + row * W + w, mask=w < W, other=0.0)
        b = tl.load(
            b_ptr + (slot * W + w)[None, :] * stride_b + n[:, None],
            mask=(n[:, None] < N) & (w[None, :] < W),
            other=0.0,
        )
        acc += tl.sum(b.to(tl.float32) * v[None, :], axis=1)
    out = out_ptr + row * stride_out + n
    before = tl.load(out, mask=n < N, other=0.0)
    tl.store(out, (before.to(tl.float32) + acc).to(before.dtype), mask=n < N)


def add_lora(
    out: torch.Tensor,  # (T, N), updated in place
    x: torch.Tensor,  # (T, K)
    a: torch.Tensor,  # (S * W, K)
    b: torch.Tensor,  # (S * W, N)
    width: int,  # W
    token_slots: torch.Tensor,  # (T,) int64, -1: no adapter
) -> torch.Tensor:
    """See the module's docstring; ``out`` and ``x`` row-major (``out``'s rows may be a
    strided view), ``a`` and ``b`` contiguous."""
    rows, k = x.shape
    n = out.shape[1]
    if not rows:
        return out
    assert out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    v = torch.empty((rows, width), dtype=torch.float32, device=x.device)
    block_w = min(64, triton.next_power_of_2(width))
    _lora_shrink_kernel[(rows, triton.cdiv(width, block_w))](
        x, a, token_slots, v, k, width, x.stride(0), BLOCK_W=block_w, BLOCK_K=BLOCK_K
    )
    _lora_expand_kernel[(rows, triton.cdiv(n, BLOCK_N))](
        v,
        b,
        token_slots,
        out,
        n,
        width,
        b.stride(0),
        out.stride(0),
        BLOCK_N=BLOCK_N,
        BLOCK_W=block_w,
    )
    return out
