"""The batched LoRA product of one step, for every adapter in it at once.

A step mixes tokens of several adapters and of the base model. Per fused linear, the
slots' ``A`` matrices are stacked as ``a`` ``(S × W, K)`` and their ``B`` matrices,
transposed, as ``b`` ``(S × W, N)`` (``W`` rows of slot ``s`` from ``s × W`` in each: a
kernel's expand then runs along contiguous outputs). Two ways to add
each row's ``B[s] @ (A[s] @ x)``, chosen per step (:class:`LoraBatch`):

* grouped (Punica's SGMV): per run of consecutive rows of one adapter (a prefill chunk,
  or the whole step), that run through its ``A`` and ``B`` in place, two matmuls on views;
  where the runs are many (decode rows of interleaved adapters), per adapter present, its
  rows gathered, multiplied and scattered back. Few, large products: prefill chunks, or
  one adapter.
* dense (one BGMV-like product for all): every row through the stacked ``A`` of the slots
  up to the highest used, the columns of other slots masked to zero, then through the
  stacked ``B``: three calls per linear however many adapters. Many small products cost
  more in calls than in arithmetic on a decode step's few rows, so a step of at most
  :data:`DENSE_MAX_ROWS` rows with several adapters runs this way.

The grouping is computed once per step and reused by every layer's linears.
:func:`lamina.kernels.reference.lora.add_lora_reference` is the per-token reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

DENSE_MAX_ROWS = 256
"""Steps of at most this many rows with several adapters run the dense product."""
MAX_RUNS = 64
"""At most this many runs of consecutive rows are multiplied run by run (views, no
copies); a step of more gathers each adapter's rows instead."""


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """A step's tokens by adapter slot: ``(slot, rows)`` per run of consecutive rows of
    one slot (``rows`` a slice), or per slot present, in ascending order (``rows`` its row
    indices); for the dense product, each row's slot."""

    groups: tuple[tuple[int, torch.Tensor | slice], ...]
    token_slots: torch.Tensor | None = None
    """``(T,)`` each row's slot (-1: none), where the step runs the dense product."""
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """The dense product's column mask by slot width (made on first use)."""

    @classmethod
    def of(cls, token_slots: np.ndarray, device: torch.device) -> LoraBatch | None:
        """The grouping of ``token_slots`` ``(T,)`` (-1: the base model); None when no
        token has an adapter."""
        present = np.unique(token_slots)
        present = present[present >= 0]
        if not len(present):
            return None
        dense = len(present) > 1 and len(token_slots) <= DENSE_MAX_ROWS
        if not dense:
            starts = (np.flatnonzero(np.diff(token_slots)) + 1).tolist()
            bounds = zip([0, *starts], [*starts, len(token_slots)], strict=True)
            runs = [(int(token_slots[s]), slice(s, e)) for s, e in bounds if token_slots[s] >= 0]
            if len(runs) <= MAX_RUNS:
                return cls(tuple(runs))
        groups = tuple(
            (int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device))
            for slot in present
        )
        return cls(groups, torch.from_numpy(token_slots).to(device) if dense else None)

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``(T, (highest slot + 1) × width)``: 1 where a column is the row's slot's."""
        found = self._masks.get(width)
        if found is None:
            assert self.token_slots is not None
            columns = (self.groups[-1][0] + 1) * width
            owner = torch.arange(columns, device=self.token_slots.device) // width
            found = (owner[None, :] == self.token_slots[:, None]).to(dtype)
            self._masks[width] = found
        return found


def add_lora(
    out: torch.Tensor,  # (T, N), updated in place
    x: torch.Tensor,  # (T, K)
    a: torch.Tensor,  # (S * W, K)
    b: torch.Tensor,  # (S * W, N): B transposed
    width: int,  # W: rows of a slot in ``a``, columns in ``b``
    batch: LoraBatch,
) -> torch.Tensor:
    """``out`` plus each row's adapter product (see the module's docstring)."""
    if batch.token_slots is not None:
        columns = (batch.groups[-1][0] + 1) * width  # the slots up to the highest used
        shrunk = x @ a[:columns].T
        shrunk *= batch.mask(width, shrunk.dtype)
        return out.addmm_(shrunk, b[:columns])
    for slot, rows in batch.groups:
        span = slice(slot * width, (slot + 1) * width)
        if isinstance(rows, slice):  # a view of ``out``: added in place
            out[rows].addmm_(x[rows] @ a[span].T, b[span])
        else:
            delta = (x.index_select(0, rows) @ a[span].T) @ b[span]
            out.index_add_(0, rows, delta)
    return out
