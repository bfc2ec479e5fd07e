"""Chained hashes of full KV blocks, shared by the engine worker and the scheduler.

A block's hash covers its own token ids *and* the hash of the block before it, so equal
hashes mean equal prefixes, not merely equal 16-token windows. The scheduler's cluster
prefix index and every worker's prefix cache must agree bit for bit, across processes and
hosts, so this uses a keyed-free, seed-free BLAKE2b digest (Python's ``hash`` is salted per
process for bytes) truncated to 63 bits so it fits a signed 64-bit wire integer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

#: Parent hash of the first block of every sequence.
ROOT_HASH = 0

_MASK_63 = (1 << 63) - 1


def root_hash(adapter: str | None = None) -> int:
    """Parent hash of a sequence's first block: ``ROOT_HASH`` for the base model; for a
    LoRA adapter, one derived from its name, so that sequences of different adapters
    (whose KV differs for the same tokens) never share a block hash."""
    if not adapter:
        return ROOT_HASH
    digest = hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & _MASK_63


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one full block of ``token_ids`` chained onto ``parent_hash``."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little") & _MASK_63


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH, start: int = 0
) -> list[int]:
    """Hashes of the full blocks of ``token_ids[start:]``; a trailing partial block is skipped.

    ``start`` must be a multiple of ``block_size`` and ``parent_hash`` the hash of the block
    ending at ``start`` (``ROOT_HASH`` when ``start`` is 0), which lets callers extend a
    sequence's hashes incrementally as it grows.
    """
    if block_size <= 0:
        raise ValueError(f"block_size ({block_size}) must be positive")
    if start % block_size:
        raise ValueError(f"start ({start}) is not a multiple of block_size ({block_size})")
    hashes: list[int] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[begin : begin + block_size])
        hashes.append(parent_hash)
    return hashes
