"""Turns a scheduled batch into tensors, runs the model, and owns the KV pool memory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lamina.kernels.reference import AttentionMetadata, kv_quant
from lamina.kernels.transfer import upload
from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.block_manager import NO_MOVES
from lamina.services.engine_worker.engine.cuda_graphs import DecodeGraphs
from lamina.services.engine_worker.engine.kv_shards import Share
from lamina.services.engine_worker.engine.kv_tier import (
    DEVICE,
    DISK,
    HOST,
    MOVE_ORDER,
    TierPool,
    copy_blocks,
)
from lamina.services.engine_worker.engine.lora import LoraSlots, LoraStep
from lamina.services.engine_worker.engine.model import CausalLM

NO_ADAPTERS = np.zeros(0, dtype=np.int64)
"""A step's LoRA slots when no request has an adapter (``StepInput.adapters``)."""


def kv_block_bytes(model: CausalLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes across all layers (keys and values, and int8's scales)."""
    c = model.local
    dtype = kv_quant.cache_torch_dtype(kv_cache_dtype, model.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * c.num_kv_heads * c.head_dim * itemsize
    if kv_cache_dtype == "int8":
        per_layer += 2 * c.num_kv_heads * 4  # one fp32 scale per block, KV head, K and V
    return c.num_layers * per_layer


class ModelRunner:
    """Runs one flattened step of the model over the paged KV pool."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        c = model.local  # this rank's KV heads
        shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        dtype = kv_quant.cache_torch_dtype(kv_cache_dtype, model.dtype)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)
        ]
        kind = kv_quant.quant_kind(self.kv_caches[0])
        self.kv_scales: list[torch.Tensor | None] = [
            kv_quant.new_scales(kind, num_blocks, c.num_kv_heads, device)
            for _ in range(c.num_layers)
        ]
        """Per layer: fp8 ``(2, Hkv)`` static scales, int8 ``(2, num_blocks, Hkv)``."""
        if kind == "fp8":
            for layer, scales in enumerate(model.checkpoint_kv_scales):
                if scales is not None:
                    self.kv_scales[layer].copy_(scales)
        self._block_writes = kind == "int8"
        self.block_scales = [s if self._block_writes else None for s in self.kv_scales]
        """Per layer, the scales that belong to each block (int8's), which move with it."""
        self.tiers: dict[int, TierPool] = {}
        """The lower tiers' storage for this rank's KV, by tier number (:meth:`add_tier`)."""
        self.load_timing: dict[int, list[float]] = {}
        """Per lower tier: blocks loaded from it, and the seconds their copies took (timed
        on a CPU device only: on a GPU they are queued)."""
        self.decode_graphs: DecodeGraphs | None = None
        """Set by the engine when decode-only steps run from CUDA graphs."""
        self.lora_slots: LoraSlots | None = None
        """Set by the engine when it serves LoRA adapters: their device slots."""

    def add_tier(self, number: int, slots: int, directory: Path | None = None) -> None:
        """Lower tier ``number`` (``kv_tier.HOST`` or ``DISK``) of ``slots`` blocks of this
        rank's KV (in a file under ``directory``, if given)."""
        self.tiers[number] = TierPool(self.kv_caches, self.block_scales, slots, directory)
        self.load_timing[number] = [0, 0.0]

    def storage(self, tier: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Tier ``tier``'s caches and per-block scales, per layer (0: the device pool)."""
        if tier == DEVICE:
            return self.kv_caches, self.block_scales
        pool = self.tiers[tier]
        return pool.caches, pool.scales

    def transfer(self, moves: np.ndarray) -> None:
        """A step's moves between the tiers (``(4, n)``: see :attr:`StepInput.moves`),
        kind by kind in ``MOVE_ORDER``."""
        if not moves.shape[1]:
            return
        for source, target in MOVE_ORDER:
            picked = moves[:, (moves[0] == source) & (moves[2] == target)]
            if not picked.shape[1]:
                continue
            if (source, target) == (HOST, DISK) and self.device.type == "cuda":
                # The host copies slots that earlier steps' saves, queued on the stream,
                # may still be writing (loads to the device are ordered on the stream).
                torch.cuda.current_stream(self.device).synchronize()
            started = time.perf_counter()
            copy_blocks(self.storage(source), picked[1], self.storage(target), picked[3])
            if target == DEVICE and self.device.type == "cpu":
                timing = self.load_timing[source]
                timing[0] += picked.shape[1]
                timing[1] += time.perf_counter() - started

    def read_blocks(self, where: np.ndarray) -> Share:
        """This rank's share of the blocks ``where`` names (``(2, n)``: each one's tier,
        and its block or slot there), in order, on the host."""
        if self.tiers and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # queued saves
        stores = {tier: self.storage(tier) for tier in {DEVICE, *where[0].tolist()}}
        caches = [
            _gather({tier: c[layer] for tier, (c, _) in stores.items()}, where)
            for layer in range(len(self.kv_caches))
        ]
        scales = [
            None
            if self.block_scales[layer] is None
            else _gather({tier: s[layer] for tier, (_, s) in stores.items()}, where)  # type: ignore[misc]
            for layer in range(len(self.kv_caches))
        ]
        return caches, scales

    def write_blocks(self, blocks: np.ndarray, share: Share) -> None:
        """This rank's ``share`` of some blocks into device blocks ``blocks``, in order."""
        if not len(blocks):
            return
        target = torch.from_numpy(np.ascontiguousarray(blocks)).to(self.device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, target] = share[0][layer].to(self.device)
            scales, theirs = self.block_scales[layer], share[1][layer]
            if scales is not None and theirs is not None:
                scales[:, target] = theirs.to(self.device)

    def load_rate(self, tier: int) -> float:
        """Blocks per second this rank's loads from ``tier`` ran at (0: none timed)."""
        blocks, seconds = self.load_timing.get(tier, (0, 0.0))
        return blocks / seconds if seconds else 0.0

    def run(self, step: StepInput) -> torch.Tensor:
        """The model over one step's input (this rank's share): the logits of its
        ``sampled`` rows (``Engine.forward``), after the step's moves between the tiers."""
        self.transfer(step.moves)
        lora = None
        if self.lora_slots is not None and len(step.adapters):
            token_slots = np.repeat(step.adapters, step.num_new)
            backend = self.model.ops.backend
            lora = LoraStep.of(token_slots, self.lora_slots, self.device, backend)
        graphs = None if lora is not None else self.decode_graphs  # (recorded without)
        if graphs is not None and step.decodes_only and graphs.bucket(len(step.ids)):
            return graphs.run(step.ids, step.positions, step.slots, step.context, step.table)
        if step.decodes_only and step.all_sampled:  # (a one-token prompt chunk is not)
            logits = self.model.decode_logits(
                step.ids,
                step.positions,
                step.slots,
                step.table,
                step.context,
                self.kv_caches,
                lora,
            )
            if logits is not None:
                return logits
        return self._forward(step, lora)

    def _forward(self, step: StepInput, lora: LoraStep | None) -> torch.Tensor:
        """The model's general forward over ``step``."""
        dev = self.device
        slot_mapping = upload(step.slots, torch.int64, dev)
        meta = AttentionMetadata.build(
            step.num_new.tolist(),
            step.context.tolist(),
            step.table,
            step.num_decodes,
            self.block_size,
            slot_mapping,
            dev,
            dense_decodes=self.model.ops.dense_decodes,
            dense_prefill=self.model.ops.dense_prefill,
            with_block_writes=self._block_writes,
        )
        return self.model.forward(
            upload(step.ids, torch.int64, dev),
            upload(step.positions, torch.int64, dev),
            meta,
            self.kv_caches,
            upload(step.sampled, torch.int64, dev),
            self.kv_scales,
            lora,
        )


def _gather(sources: dict[int, torch.Tensor], where: np.ndarray) -> torch.Tensor:
    """The blocks ``where`` names (``(2, n)``: a tier, and a block or slot there, dimension
    1 of that tier's tensor in ``sources``, the device's always among them), in order, on
    the host."""
    like = sources[DEVICE]
    out = torch.empty((like.shape[0], where.shape[1], *like.shape[2:]), dtype=like.dtype)
    for tier, source in sources.items():
        rows = np.flatnonzero(where[0] == tier)
        if len(rows):
            index = torch.from_numpy(where[1, rows].copy()).to(source.device)
            out[:, torch.from_numpy(rows)] = source.index_select(1, index).cpu()
    return out


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step's input to the model, as flat arrays: no request objects, nothing but
    what every tensor-parallel rank needs to run the same step (what a driver would
    broadcast). Tokens of all sequences form one run, decodes first."""

    ids: np.ndarray
    """``(T,)`` the tokens to compute."""
    positions: np.ndarray
    """``(T,)`` each token's position in its sequence."""
    slots: np.ndarray
    """``(T,)`` each token's flat KV cache slot (block id × block size + offset)."""
    num_new: np.ndarray
    """``(S,)`` tokens each sequence computes."""
    context: np.ndarray
    """``(S,)`` tokens already cached before them."""
    table: np.ndarray
    """``(S, max blocks)`` each sequence's block ids, zero-padded."""
    sampled: np.ndarray
    """Rows of the flat run whose logits are returned: each sequence that finishes its
    tokens (with a draft: its last token's row and each draft token's), in order, then
    the extra positions asked for."""
    num_decodes: int
    decodes_only: bool
    """Every sequence decodes one token and nothing extra is asked for."""
    all_sampled: bool
    """Every sequence finishes its tokens this step."""
    moves: np.ndarray = field(default_factory=lambda: NO_MOVES)
    """``(4, n)``: blocks to copy between the tiers before the model runs, a column each:
    source tier, block or slot there, target tier, block or slot there (``kv_tier``)."""
    adapters: np.ndarray = field(default_factory=lambda: NO_ADAPTERS)
    """``(S,)`` each sequence's LoRA slot (-1: the base model), or empty: none has one."""

    @classmethod
    def of(
        cls,
        batch: ScheduledBatch,
        block_size: int,
        extra: list[int] | None,
        moves: np.ndarray = NO_MOVES,
        adapters: np.ndarray = NO_ADAPTERS,
    ) -> StepInput:
        """``batch`` as flat arrays; ``adapters``: each request's LoRA slot, if any has
        one (see :attr:`adapters`)."""
        requests, num_new = batch.requests, batch.num_new_tokens
        context = [r.num_computed_tokens for r in requests]
        ids: list[int] = []
        drafted = False
        chunks = False  # a prompt chunk of several tokens
        for request, start, n in zip(requests, context, num_new, strict=True):
            ids.extend(request.token_ids[start : start + n])
            if request.draft and start + n > request.num_tokens:
                ids.extend(request.draft[: start + n - request.num_tokens])
                drafted = True
            elif n > 1:
                chunks = True
        n_arr = np.asarray(num_new, dtype=np.int64)
        ctx_arr = np.asarray(context, dtype=np.int64)
        ends = np.cumsum(n_arr)
        row = np.repeat(np.arange(len(requests)), n_arr)
        positions = np.arange(int(ends[-1])) - np.repeat(ends - n_arr - ctx_arr, n_arr)
        tables = batch.block_tables
        table = np.zeros((len(requests), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        slots = table[row, positions // block_size] * block_size + (positions % block_size)
        done = (ctx_arr + n_arr) == np.asarray([r.num_step_tokens for r in requests])
        if drafted and not chunks and not extra and done.all():
            # Decodes and drafts alone: each drafted token as a decode row of its own
            # (its context the tokens before it, its KV written before any row attends),
            # so the step stays on the decode paths (the native decode step, CUDA graphs)
            # where a drafted request would run as a prompt chunk through the general
            # forward. Every row is sampled, as verification wants.
            return cls(
                ids=np.asarray(ids),
                positions=positions,
                slots=slots,
                num_new=np.ones(len(ids), dtype=np.int64),
                context=positions,
                table=table[row],
                sampled=np.arange(len(ids)),
                num_decodes=len(ids),
                decodes_only=True,
                all_sampled=True,
                moves=moves,
                adapters=adapters[row] if len(adapters) else adapters,
            )
        sampled = (ends - 1)[done]
        if drafted:  # a drafted request's last token and each draft token are scored
            sampled = np.concatenate(
                [
                    np.arange(end - len(r.draft) - 1, end)
                    for r, end, last in zip(requests, ends, done, strict=True)
                    if last
                ]
            )
        if extra:
            sampled = np.concatenate([sampled, np.asarray(extra, dtype=np.int64)])
        return cls(
            ids=np.asarray(ids),
            positions=positions,
            slots=slots,
            num_new=n_arr,
            context=ctx_arr,
            table=table,
            sampled=sampled,
            num_decodes=batch.num_decodes,
            decodes_only=batch.num_decodes == len(requests) and not extra,
            all_sampled=bool(done.all()),
            moves=moves,
            adapters=adapters,
        )
