"""Turns a scheduled batch into tensors, runs the model, and owns the KV pool memory."""

from __future__ import annotations

import numpy as np
import torch

from lamina.kernels.reference import AttentionMetadata
from lamina.services.engine_worker.model import CausalLM
from lamina.services.engine_worker.scheduler import ScheduledBatch


def kv_block_bytes(model: CausalLM, block_size: int) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    c = model.local
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize


class ModelRunner:
    """Runs one flattened step of the model over the paged KV pool."""

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        c = model.local  # this rank's KV heads
        shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(c.num_layers)
        ]

    def execute(self, batch: ScheduledBatch, sample_all_chunks: bool = False) -> torch.Tensor:
        """Logits ``(S, vocab)`` for each request of ``batch`` that finishes its tokens this
        step (or, with ``sample_all_chunks``, for every request: teacher-forced tests)."""
        requests, num_new = batch.requests, batch.num_new_tokens
        context = [r.num_computed_tokens for r in requests]
        ids: list[int] = []
        for request, start, n in zip(requests, context, num_new, strict=True):
            ids.extend(request.token_ids[start : start + n])

        n_arr = np.asarray(num_new, dtype=np.int64)
        ctx_arr = np.asarray(context, dtype=np.int64)
        ends = np.cumsum(n_arr)
        row = np.repeat(np.arange(len(requests)), n_arr)
        positions = np.arange(int(ends[-1])) - np.repeat(ends - n_arr - ctx_arr, n_arr)
        tables = [r.block_ids for r in requests]
        width = max(len(t) for t in tables)
        table = np.zeros((len(requests), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        slots = table[row, positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        if sample_all_chunks:
            sampled = ends - 1
        else:
            done = (ctx_arr + n_arr) == np.asarray([r.num_tokens for r in requests])
            sampled = (ends - 1)[done]

        dev = self.device
        slot_mapping = torch.from_numpy(slots).to(dev)
        meta = AttentionMetadata.build(
            num_new,
            context,
            table,
            batch.num_decodes,
            self.block_size,
            slot_mapping,
            dev,
            dense=self.model.ops.backend == "reference",
        )
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.from_numpy(positions).to(dev),
            meta,
            self.kv_caches,
            torch.from_numpy(sampled).to(dev),
        )
