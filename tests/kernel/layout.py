"""Paged-cache layouts for kernel tests: sequences given as (context, new tokens)."""

from __future__ import annotations

import numpy as np
import torch

from lamina.kernels.reference import AttentionMetadata


def paged_layout(
    seqs: list[tuple[int, int]],
    num_blocks: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, torch.Tensor]:
    """Distinct random blocks for each sequence: the block table (rows padded with 0, as
    the runner pads them) and the cache slot of every new token, in batch order."""
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, slots = [], []
    for ctx, n in seqs:
        tables.append([perm.pop() for _ in range(-(-(ctx + n) // block_size))])
        slots += [
            tables[-1][p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)
        ]
    width = max(len(t) for t in tables)
    return np.array([t + [0] * (width - len(t)) for t in tables]), torch.tensor(slots)


def metadata(
    seqs: list[tuple[int, int]],
    table: np.ndarray,
    slots: torch.Tensor,
    block_size: int,
    device: torch.device,
    **options,
) -> AttentionMetadata:
    """The step's metadata for ``seqs`` (single-token sequences first count as decodes)."""
    return AttentionMetadata.build(
        [n for _, n in seqs],
        [c for c, _ in seqs],
        table,
        sum(1 for _, n in seqs if n == 1),
        block_size,
        slots.to(device),
        device,
        **options,
    )
