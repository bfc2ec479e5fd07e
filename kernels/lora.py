"""The batched LoRA product of one step, grouped by adapter.

A step mixes tokens of several adapters and of the base model. For each linear the
adapters touch, every adapter's tokens go through its ``lora_A`` and ``lora_B`` as two
matmuls over all of that adapter's rows at once (Punica's SGMV: one segment per adapter),
however many requests the rows belong to; base-model rows cost nothing. The grouping is
computed once per step (:class:`LoraBatch`) and reused by every layer's linears.
:func:`lamina.kernels.reference.lora.add_lora_reference` is the per-token reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """A step's tokens by adapter slot: ``(slot, rows)`` per slot present, ``rows`` the
    token rows of that slot (None: every row of the step)."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def of(cls, token_slots: np.ndarray, device: torch.device) -> LoraBatch | None:
        """The grouping of ``token_slots`` ``(T,)`` (-1: the base model); None when no
        token has an adapter."""
        present = np.unique(token_slots)
        present = present[present >= 0]
        if not len(present):
            return None
        if len(present) == 1 and (token_slots == present[0]).all():
            return cls(((int(present[0]), None),))
        groups = tuple(
            (int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device))
            for slot in present
        )
        return cls(groups)


def add_lora(
    out: torch.Tensor,  # (T, N), updated in place
    x: torch.Tensor,  # (T, K)
    a: torch.Tensor,  # (S, R, K)
    b: torch.Tensor,  # (S, N, R)
    batch: LoraBatch,
) -> torch.Tensor:
    """``out`` plus each row's adapter product, ``b[s] @ (a[s] @ x)`` for the rows of
    slot ``s``, grouped by slot."""
    for slot, rows in batch.groups:
        if rows is None:
            out.addmm_(x @ a[slot].T, b[slot].T)
        else:
            delta = (x.index_select(0, rows) @ a[slot].T) @ b[slot].T
            out.index_add_(0, rows, delta)
    return out
