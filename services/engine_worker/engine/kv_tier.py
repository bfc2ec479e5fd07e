"""The KV cache's second tier: host memory, or a file on local disk, holding prefix blocks
evicted from the device pool, so that a later request with the same prefix loads them
back instead of computing them again (vLLM's CPU offloading, SGLang's HiCache, LMCache).

Two halves, as with the device pool:

* :class:`TierIndex` is the bookkeeping, on the driver only (the block manager's): which
  block hash each slot holds, least recently used first, and the slots a step is moving.
* :class:`HostPool` is the storage, on every rank: per layer, the same ``(2, slots, block,
  KV heads, head dim)`` layout as the device pool (and int8 caches' per-block scales),
  in host memory (pinned on CUDA, so that copies run on the stream without the host) or,
  with a directory, in a file mapped shared (the OS pages it to local disk).

A step carries what moves (``StepInput.saves``: device block → slot, ``loads``: slot →
device block) and every rank copies its own layers and KV heads before it runs the step:
saves first, since a block the step reuses was saved from; then loads. The tier is
inclusive: a block loaded back keeps its slot, so evicting it again costs nothing.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class TierIndex:
    """Which block hash each of ``capacity`` slots holds, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Block hash -> (slot, its parent's hash), least recently used first."""
        self._free = list(range(capacity - 1, -1, -1))
        self._pinned: set[int] = set()
        """Slots the current step reads or writes: never reused before it runs."""

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[int]:
        return list(self._slots)

    def slot(self, block_hash: int) -> int | None:
        """The slot holding ``block_hash``, if any, left as it is (an export reads it
        after the step's moves were made)."""
        entry = self._slots.get(block_hash)
        return None if entry is None else entry[0]

    def take(self, block_hash: int) -> int:
        """The slot holding ``block_hash`` (KeyError if none), now the most recently used
        and pinned until the step runs: a load reads it."""
        slot, _ = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pinned.add(slot)
        return slot

    def put(self, block_hash: int, parent: int) -> tuple[int, int | None] | None:
        """A slot for ``block_hash`` (a save writes it) and the hash it displaced, if any:
        a free slot, else the least recently used one no step is moving. None: every
        slot is pinned (the block is dropped, as without a tier)."""
        if self._free:
            slot, displaced = self._free.pop(), None
        else:
            victim = next((h for h, (s, _) in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot, _ = self._slots.pop(victim)
            displaced = victim
        self._slots[block_hash] = (slot, parent)
        self._pinned.add(slot)
        return slot, displaced

    def parent(self, block_hash: int) -> int:
        return self._slots[block_hash][1]

    def step_taken(self) -> None:
        """The step's moves are handed to the ranks: its slots may be reused from now on
        (a later step's copies run after this one's)."""
        self._pinned.clear()

    def forget(self) -> None:
        """Hold nothing (a reset prefix cache); moves already decided still run."""
        self._slots.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._pinned.clear()


class HostPool:
    """``slots`` blocks of each of ``caches``' layers (and per-block ``scales``), in host
    memory or in a file under ``directory`` (removed at once: it lives while mapped)."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        slots: int,
        directory: Path | None = None,
    ) -> None:
        pin = caches[0].device.type == "cuda"
        shapes = [(c.shape[0], slots, *c.shape[2:]) for c in caches]
        self.caches = _allocate(shapes, caches[0].dtype, pin, directory)
        self.scales: list[torch.Tensor | None] = [None] * len(scales)
        if any(s is not None and s.dim() == 3 for s in scales):  # int8: per block
            shapes = [(s.shape[0], slots, s.shape[2]) for s in scales]  # type: ignore[union-attr]
            self.scales = _allocate(shapes, torch.float32, pin, directory)  # type: ignore[assignment]

    def save(
        self,
        caches: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        blocks: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        """Device blocks ``blocks`` into ``slots`` (on CUDA, queued on the stream)."""
        for layer, cache in enumerate(caches):
            _move(cache, blocks, self.caches[layer], slots)
            host = self.scales[layer]
            if host is not None:
                _move(scales[layer], blocks, host, slots)  # type: ignore[arg-type]

    def load(
        self,
        caches: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        slots: np.ndarray,
        blocks: np.ndarray,
    ) -> None:
        """``slots`` into device blocks ``blocks`` (on CUDA, queued on the stream)."""
        for layer, cache in enumerate(caches):
            _move(self.caches[layer], slots, cache, blocks)
            host = self.scales[layer]
            if host is not None:
                _move(host, slots, scales[layer], blocks)  # type: ignore[arg-type]


def _move(source: torch.Tensor, rows: np.ndarray, target: torch.Tensor, into: np.ndarray) -> None:
    """``target[:, into] = source[:, rows]`` (dimension 1 is the block), across devices."""
    if source.device == target.device:
        index = torch.from_numpy(np.ascontiguousarray(rows))
        target[:, torch.from_numpy(np.ascontiguousarray(into))] = source[:, index]
        return
    for row, to in zip(rows.tolist(), into.tolist(), strict=True):
        target[:, to].copy_(source[:, row], non_blocking=True)


def _allocate(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, pin: bool, directory: Path | None
) -> list[torch.Tensor]:
    """Zeroed tensors of ``shapes``: pinned host memory, or views of one shared mapping
    of a file in ``directory``."""
    if directory is None:
        return [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape in shapes]
    sizes = [int(np.prod(shape)) for shape in shapes]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"lamina-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        flat = torch.from_file(str(path), shared=True, size=sum(sizes), dtype=dtype)
    finally:
        path.unlink(missing_ok=True)  # the mapping keeps the pages; nothing is left behind
    views, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        views.append(flat[start : start + size].view(shape))
        start += size
    return views


@dataclass(frozen=True)
class KvBlocks:
    """Cached KV blocks out of one engine, for another (``Engine.export_blocks``,
    ``import_blocks``): consecutive blocks of one sequence, on the host."""

    layout: str
    """``block_size/dtype/layers/kv_heads/head_dim``: what must match to import them."""
    parent_hash: int
    """The hash before the first block (``ROOT_HASH`` at a sequence start)."""
    hashes: list[int]
    caches: list[torch.Tensor]
    """Per layer, ``(2, blocks, block size, KV heads, head dim)``."""
    scales: list[torch.Tensor | None]
    """Per layer, int8 caches' ``(2, blocks, KV heads)`` scales; None otherwise."""


def cache_layout(caches: list[torch.Tensor], block_size: int) -> str:
    """The layout string of a pool's caches (:attr:`KvBlocks.layout`)."""
    _, _, size, heads, dim = caches[0].shape
    assert size == block_size
    return f"{block_size}/{str(caches[0].dtype).removeprefix('torch.')}/{len(caches)}/{heads}/{dim}"
