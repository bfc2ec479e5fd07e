"""SiLU-and-multiply over ``[gate | up]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * d + cols, silu * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`lamina.kernels.reference.silu_and_mul`."""
    d = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * d).contiguous()
    out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](x, out, d, BLOCK=block)
    return out.view(*gate_up.shape[:-1], d)
