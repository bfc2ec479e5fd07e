"""CUDA graphs for decode-only steps.

A decode step of a small batch is launch-bound: a few hundred kernels of microseconds
each, and the host's Python and launch overhead between them leaves the GPU idle. A
CUDA graph records the whole forward pass (embedding to logits) once per batch-size
bucket and replays it with one launch. Everything a graph reads lives in static buffers
sized for the largest bucket, so a step only copies its inputs into them:

* token ids, positions and cache slots, one row per sequence;
* each sequence's context length and block table, the table at its full width
  (``max_model_len / block_size`` blocks), so that the kernels' launch shapes, and with
  them the split-K decision, are fixed at capture;
* rows past the batch are padding: token 0 at position 0, writing its key and value into a
  block reserved for padding (never handed to a request) and attending only to that.

Sampling stays outside the graph (its parameters change from step to step). Batches with
prefill chunks, larger than the largest bucket, or on int8 caches (whose per-block write
plan changes shape every step) run eagerly.

:class:`DecodeGraphs` runs on any device with ``capture=False``: the same static buffers,
padding and metadata, executed eagerly. That is how the CPU tests check everything but
the recording itself against the ordinary path.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from lamina.kernels.reference import AttentionMetadata
from lamina.services.engine_worker.engine.model import CausalLM

log = logging.getLogger("lamina.worker.engine")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets (as vLLM picks them): 1, 2, 4, then every multiple of 8 up to
    ``max_num_seqs``, which is always a bucket itself."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Static decode inputs, and one recorded forward pass per bucket."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        kv_scales: list[torch.Tensor | None],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        pad_block: int,
        capture: bool = True,
    ) -> None:
        if model.ops.dense_decodes:
            raise ValueError(f"decode graphs need block-table kernels, not {model.ops.backend}")
        if kv_caches[0].dtype == torch.int8:
            raise ValueError("decode graphs cannot replay int8 caches' per-step write plans")
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.pad_block = pad_block
        self.sizes = graph_batch_sizes(max_num_seqs)
        dev = kv_caches[0].device
        n = self.sizes[-1]
        width = -(-max_model_len // block_size)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        self.input_ids = ints(n)
        self.positions = ints(n)
        self.slot_mapping = ints(n)
        self.context_lens = ints(n)
        self.block_table = ints(n, width)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        # Staging copies in pinned host memory: the step's inputs go up in one async copy.
        pin = dev.type == "cuda"
        self._host = torch.zeros((n, 4 + width), dtype=torch.int64, pin_memory=pin)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.captured = False
        if capture:
            self._capture()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences (None: too many)."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_groups=(),
            num_prefill_tokens=0,
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.forward(
            self.input_ids[:size],
            self.positions[:size],
            self._metadata(size),
            self.kv_caches,
            self.logits_indices[:size],
            self.kv_scales,
        )

    def _capture(self) -> None:
        """Record one graph per bucket, largest first, all in one memory pool. Each bucket
        runs once eagerly first (Triton compiles its kernels outside the recording)."""
        self._pad(0, self.sizes[-1])
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self.captured = True
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` become padding (see the module docstring)."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.pad_block * self.block_size
        self.context_lens[start:end] = 0
        self.block_table[start:end] = self.pad_block

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """Logits ``(n, vocab)`` of a decode-only batch of ``n`` sequences (one token
        each; ``block_table`` ``(n, w)`` with ``w`` at most the full width). The result
        is a view of a static buffer, valid until the next call."""
        n, w = block_table.shape
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"{n} sequences exceed the largest decode graph ({self.sizes[-1]})")
        host = self._host[:n]  # one contiguous pinned row per sequence
        for column, values in enumerate((input_ids, positions, slots, context_lens)):
            host[:, column] = torch.from_numpy(values)
        host[:, 4 : 4 + w] = torch.from_numpy(block_table)
        staged = host.to(self.input_ids.device, non_blocking=True)
        self.input_ids[:n] = staged[:, 0]
        self.positions[:n] = staged[:, 1]
        self.slot_mapping[:n] = staged[:, 2]
        self.context_lens[:n] = staged[:, 3]
        self.block_table[:n, :w] = staged[:, 4 : 4 + w]
        self._pad(n, size)
        if self.captured:
            self._graphs[size].replay()
            return self._logits[size][:n]
        return self._forward(size)[:n]
