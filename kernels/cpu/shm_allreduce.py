"""An all-reduce through shared memory, for the tensor-parallel ranks of one host
(``shm_allreduce.cpp`` says how). vLLM's and SGLang's CPU backends do the same: gloo's
all-reduce between two processes costs about a millisecond whatever its size, and every
layer pays two."""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from pathlib import Path

import torch

from lamina.kernels.cpu.build import load_library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
SHM_DIR = Path("/dev/shm")


def segment_path(tag: str) -> Path | None:
    """A fresh path for a segment (None where there is no ``/dev/shm``)."""
    if not SHM_DIR.is_dir():
        return None
    return SHM_DIR / f"lamina-allreduce-{os.getpid()}-{uuid.uuid4().hex[:8]}-{tag}"


def create_segment(path: Path, ranks: int, capacity: int) -> None:
    """Make the segment for ``ranks`` ranks of ``capacity`` bytes each, zeroed."""
    size = load_library().lamina_shm_allreduce_bytes(ranks, capacity)
    with open(path, "wb") as f:
        f.truncate(size)


class ShmAllReduce:
    """Rank ``rank``'s view of a segment that ``create_segment`` made: call it with a
    tensor to sum it across the ranks in place. Every rank must make the same calls in
    the same order (as collectives do)."""

    def __init__(self, path: Path, rank: int, ranks: int, capacity: int, timeout_s: float):
        self._lib = load_library()
        self.rank, self.ranks, self.capacity, self.timeout_s = rank, ranks, capacity, timeout_s
        size = self._lib.lamina_shm_allreduce_bytes(ranks, capacity)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._lib.lamina_shm_allreduce_attach(self._base, rank, os.getpid())
        self._seq = 0

    def __call__(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` across the ranks in place; False (nothing done, by every rank
        alike) for a tensor it does not take: not on the CPU, not contiguous, another
        dtype, or larger than a slot. Raises RuntimeError if a rank is gone or late."""
        dtype = _DTYPES.get(tensor.dtype)
        fits = tensor.numel() * tensor.element_size() <= self.capacity
        if dtype is None or not fits or tensor.device.type != "cpu":
            return False
        if not tensor.is_contiguous():
            return False
        self._seq += 1
        code = self._lib.lamina_shm_allreduce(
            self._base,
            self.rank,
            self.ranks,
            self.capacity,
            tensor.data_ptr(),
            tensor.numel(),
            dtype,
            self._seq,
            self.timeout_s,
        )
        if code == -1:
            raise RuntimeError(
                f"shared-memory all-reduce: a rank did not arrive within {self.timeout_s:g}s"
            )
        if code < -1:
            raise RuntimeError(f"shared-memory all-reduce: rank {-2 - code} has exited")
        return True
