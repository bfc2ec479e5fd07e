"""Weight memory on transparent huge pages.

A batch-1 decode step streams every weight once, so it runs at the memory's bandwidth,
and with 4 KiB pages it also walks a page table for every 4 KiB it reads (under a
hypervisor, a two-level walk). Packed weights are therefore placed in anonymous mappings
advised ``MADV_HUGEPAGE``: with the kernel's transparent huge pages in ``madvise`` or
``always`` mode, each 2 MiB of them is one TLB entry. Where the kernel has them off, the
advice is a no-op and the mappings are ordinary memory.

Weights are packed one after another into 64 MiB chunks (a tensor larger than a chunk
gets its own mapping), so a model of many small linears still fills whole huge pages. A
chunk is unmapped when the last tensor in it is freed and the arena has moved on from it.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
ALIGN = 64
"""Each tensor starts on a cache line, as from torch's own allocator: the fp32 matmul
loads its packed panels with aligned 32-byte loads."""


class Arena:
    """Hands out uninitialised tensors from huge-page-advised anonymous mappings."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self._chunk_size = chunk
        self._chunk: torch.Tensor | None = None  # uint8 view of the current mapping
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype``, uninitialised."""
        nbytes = numel * dtype.itemsize
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if size > self._chunk_size:
            return _mapping(size)[:nbytes].view(dtype)
        with self._lock:
            if self._chunk is None or self._used + size > self._chunk_size:
                self._chunk, self._used = _mapping(self._chunk_size), 0
            start, self._used = self._used, self._used + size
            return self._chunk[start : start + nbytes].view(dtype)


def _mapping(size: int) -> torch.Tensor:
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping: it is unmapped when the last view of it is freed.
    return torch.frombuffer(memory, dtype=torch.uint8)


weights = Arena()
"""The process's arena for packed weights."""
