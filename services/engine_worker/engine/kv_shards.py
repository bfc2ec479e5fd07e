"""A parallel engine's KV blocks, whole: each rank holds a share of every block (its
pipeline stage's layers, its tensor-parallel KV heads), and a block that leaves the
engine (``Engine.export_blocks``) or enters it (``import_blocks``) is whole, so that
workers exchange blocks whatever their parallelism: a tensor-parallel worker's blocks
import into a single-process worker's pool, and the other way round. An export
assembles every rank's share (:meth:`Sharding.assemble`); an import splits whole blocks
into the ranks' shares (:meth:`Sharding.split`). A share is, per layer of the rank, its
caches' blocks ``(2, n, block size, its KV heads, head dim)`` and int8 caches' per-block
scales ``(2, n, its KV heads)`` (None for other caches).

The layout a transfer checks (:func:`block_layout`) is the whole block's: two engines of
one model and cache dtype match however each is split.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from lamina.services.engine_worker.engine.parallel import TensorParallel, stage_layers

Share = tuple[list[torch.Tensor], list[torch.Tensor | None]]
"""One rank's part of some blocks, per layer it holds: caches, and per-block scales."""


def block_layout(block_size: int, dtype: torch.dtype, layers: int, kv_heads: int, dim: int) -> str:
    """``block_size/dtype/layers/kv_heads/head_dim`` of whole blocks: what must match for
    one engine to import another's (``KvBlocks.layout``)."""
    return f"{block_size}/{str(dtype).removeprefix('torch.')}/{layers}/{kv_heads}/{dim}"


@dataclass(frozen=True)
class Sharding:
    """How a model's KV splits across ``tp`` × ``pp`` ranks, numbered stage by stage
    (global rank ``stage * tp + tensor-parallel rank``, as ``parallel.py`` numbers them)."""

    num_layers: int
    num_kv_heads: int
    tp: int = 1
    pp: int = 1

    def layers(self, rank: int) -> range:
        """The layers rank ``rank`` holds."""
        return stage_layers(self.num_layers, self.pp)[rank // self.tp]

    def heads(self, rank: int) -> slice:
        """The KV heads rank ``rank`` holds (one, shared with other ranks, where there
        are fewer KV heads than tensor-parallel ranks)."""
        first, count = TensorParallel(rank % self.tp, self.tp).kv_heads(self.num_kv_heads)
        return slice(first, first + count)

    def assemble(self, shares: list[Share]) -> Share:
        """Whole blocks out of every rank's share of them, in rank order."""
        if len(shares) == 1:
            return shares[0]
        caches: list[torch.Tensor | None] = [None] * self.num_layers
        scales: list[torch.Tensor | None] = [None] * self.num_layers
        for rank, (rank_caches, rank_scales) in enumerate(shares):
            heads = self.heads(rank)
            for local, layer in enumerate(self.layers(rank)):
                caches[layer] = self._place(caches[layer], rank_caches[local], heads, 3)
                scales[layer] = self._place(scales[layer], rank_scales[local], heads, 2)
        return caches, scales  # type: ignore[return-value]

    def _place(
        self, whole: torch.Tensor | None, part: torch.Tensor | None, heads: slice, dim: int
    ) -> torch.Tensor | None:
        """``part`` (some KV heads, along ``dim``) into ``whole`` at ``heads``; ``whole``
        made, of every KV head, if None."""
        if part is None:
            return whole
        if whole is None:
            shape = list(part.shape)
            shape[dim] = self.num_kv_heads
            whole = part.new_empty(shape)
        whole.narrow(dim, heads.start, heads.stop - heads.start).copy_(part)
        return whole

    def split(self, whole: Share) -> list[Share]:
        """Each rank's share of whole blocks, in rank order."""
        if self.tp * self.pp == 1:
            return [whole]
        shares: list[Share] = []
        for rank in range(self.tp * self.pp):
            heads, layers = self.heads(rank), self.layers(rank)
            caches = [whole[0][layer][:, :, :, heads].contiguous() for layer in layers]
            scales = [
                None if (s := whole[1][layer]) is None else s[:, :, heads].contiguous()
                for layer in layers
            ]
            shares.append((caches, scales))
        return shares


def dump_share(share: Share) -> bytes:
    """``share`` as bytes, for a rank's channel (any dtype: ``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(share, buffer)
    return buffer.getvalue()


def load_share(data: bytes | memoryview) -> Share:
    """The share :func:`dump_share` made ``data`` from (tensors only: nothing runs)."""
    return torch.load(io.BytesIO(data), weights_only=True)
