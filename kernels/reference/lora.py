"""The torch reference of the batched LoRA product: every token through its own adapter.

For token ``t`` of a step with adapter slot ``s = slots[t]``: ``out[t] += b[s] @ (a[s] @
x[t])``, nothing where ``s`` is -1 (the base model). ``a`` ``(S, R, K)`` holds each slot's
down projections (``lora_A``), ``b`` ``(S, N, R)`` its up projections (``lora_B``) with
the adapter's scaling folded in. Punica's BGMV (one gathered matrix-vector product per
token) is this computation; :func:`lamina.kernels.lora.add_lora` computes it grouped.
"""

from __future__ import annotations

import torch


def add_lora_reference(
    out: torch.Tensor,  # (T, N), updated in place
    x: torch.Tensor,  # (T, K)
    a: torch.Tensor,  # (S, R, K)
    b: torch.Tensor,  # (S, N, R)
    slots: torch.Tensor,  # (T,) int64, -1: no adapter
) -> torch.Tensor:
    """``out`` plus each token's adapter product (see the module's docstring)."""
    rows = torch.nonzero(slots >= 0).flatten()
    if not len(rows):
        return out
    picked = slots[rows]
    shrunk = torch.bmm(a[picked], x[rows].unsqueeze(-1))  # (T', R, 1)
    out[rows] += torch.bmm(b[picked], shrunk).squeeze(-1).to(out.dtype)
    return out
