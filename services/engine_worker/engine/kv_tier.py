"""The KV cache's lower tiers: host memory, then a file on local disk, holding prefix
blocks evicted from the device pool, so that a later request with the same prefix loads
them back instead of computing them again (vLLM's CPU offloading, SGLang's HiCache,
LMCache, Dynamo's KV block manager).

Blocks move down one tier at a time, least recently used first: the device pool's
evicted blocks go to the host tier, the host tier's to the disk tier, and the disk
tier's are gone. Either lower tier may be absent (then blocks skip it). A hit in either
loads straight into the device pool, and the tier keeps its copy (the tiers are
inclusive: evicting the block again costs nothing).

Two halves, as with the device pool:

* :class:`TierIndex` is the bookkeeping, on the driver only (the block manager's): which
  block hash each slot of one tier holds, least recently used first, and the slots a
  step is moving.
* :class:`TierPool` is the storage, on every rank: per layer, the same ``(2, slots,
  block, KV heads, head dim)`` layout as the device pool (and int8 caches' per-block
  scales), in host memory (pinned on CUDA, so that copies run on the stream without the
  host) or, for the disk tier, in a file mapped shared (the OS pages it to local disk).

A step carries what moves (``StepInput.moves``: rows of source tier, source block or
slot, target tier, target block or slot; tier 0 is the device) and every rank copies its
own layers and KV heads before it runs the step, in the order :data:`MOVE_ORDER` gives:
a slot or block is only reused after what it held was copied out of it.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEVICE, HOST, DISK = 0, 1, 2
"""Tier numbers in a step's moves."""
MEDIA = {DEVICE: "device", HOST: "host", DISK: "disk"}
"""Each tier's name in KV events and stats."""
MOVE_ORDER = ((HOST, DISK), (DEVICE, HOST), (DEVICE, DISK), (HOST, DEVICE), (DISK, DEVICE))
"""(source, target) tiers, in the order a step's moves are made: the host tier's evicted
blocks go down before its slots take the device's evicted blocks, and those are saved
before their device blocks take the loads. A slot a step writes or reads is pinned in its
tier's index, so no two moves of one kind touch the same slot."""


class TierIndex:
    """Which block hash each of ``capacity`` slots of tier ``number`` holds, least
    recently used first."""

    def __init__(self, capacity: int, number: int = HOST) -> None:
        self.capacity = capacity
        self.number = number
        self.medium = MEDIA[number]
        self.loads = 0
        """Blocks loaded back from this tier (cumulative)."""
        self.saves = 0
        """Blocks saved to it (cumulative)."""
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

    def put(self, block_hash: int, parent: int) -> tuple[int, tuple[int, int] | None] | None:
        """A slot for ``block_hash`` (a save writes it) and the block it displaced, if
        any, as ``(hash, parent)``: a free slot, else the least recently used one no step
        is moving. None: every slot is pinned (the block goes no lower)."""
        displaced = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, (s, _) in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot, victim_parent = self._slots.pop(victim)
            displaced = (victim, victim_parent)
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


class TierPool:
    """``slots`` blocks of each of ``caches``' layers (and int8 caches' per-block
    ``scales``), in host memory or in a file under ``directory`` (removed at once: it
    lives while mapped)."""

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
        if any(s is not None for s in scales):
            shapes = [(s.shape[0], slots, s.shape[2]) for s in scales]  # type: ignore[union-attr]
            self.scales = _allocate(shapes, torch.float32, pin, directory)  # type: ignore[assignment]


def copy_blocks(
    source: tuple[list[torch.Tensor], list[torch.Tensor | None]],
    rows: np.ndarray,
    target: tuple[list[torch.Tensor], list[torch.Tensor | None]],
    into: np.ndarray,
) -> None:
    """Blocks ``rows`` of ``source`` (per layer, caches and per-block scales or None)
    into blocks ``into`` of ``target`` (across devices: queued on the stream on CUDA)."""
    for layer, cache in enumerate(source[0]):
        _move(cache, rows, target[0][layer], into)
        scales = source[1][layer]
        if scales is not None:
            _move(scales, rows, target[1][layer], into)  # type: ignore[arg-type]


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
    """``block_size/dtype/layers/kv_heads/head_dim`` (``kv_shards.block_layout``): what
    must match to import them."""
    parent_hash: int
    """The hash before the first block (``ROOT_HASH`` at a sequence start)."""
    hashes: list[int]
    caches: list[torch.Tensor]
    """Per layer, ``(2, blocks, block size, KV heads, head dim)``: whole (every rank's
    share of a parallel engine's blocks)."""
    scales: list[torch.Tensor | None]
    """Per layer, int8 caches' ``(2, blocks, KV heads)`` scales; None otherwise."""
