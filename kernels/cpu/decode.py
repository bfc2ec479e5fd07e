"""A decode step's decoder layers in one native call (``decode.cpp``), for fp32 on the
CPU with every linear on the native matmul (fp32 or quantized weights) and an fp32 KV
cache: what :meth:`lamina.services.engine_worker.model.CausalLM.forward` runs for a
step of decodes only, instead of a dozen Python-level kernel calls per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.kernels.cpu.build import load_library, ptr
from lamina.kernels.cpu.linear import PackedLinear

LAYER_FIELDS = 40
"""Fields in a row of the layer table: ``decode.cpp``'s ``kLayerFields``."""


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's weights and cache as the native step reads them."""

    input_norm: torch.Tensor
    qkv: PackedLinear
    qk_norm: torch.Tensor | None  # (Hq + Hkv, D): Qwen3's per-head norms
    o: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear  # a PackedSiluMul or PackedQuantSiluMul
    down: PackedLinear
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D) fp32

    def fields(self) -> list[int]:
        """The row of ``decode.cpp``'s ``Layer``."""
        return [
            ptr(self.input_norm),
            *self.qkv.native_fields(),
            ptr(self.qk_norm) or 0,
            *self.o.native_fields(),
            ptr(self.post_norm),
            *self.gate_up.native_fields(),
            *self.down.native_fields(),
            ptr(self.kv_cache),
        ]


class DecodeLayers:
    """Every decoder layer of a model for steps of decodes only (one token per sequence).
    The tensors the layers name must outlive it (the model and its runner hold them)."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
    ) -> None:
        for layer in layers:
            norms = (layer.input_norm, layer.post_norm, layer.qk_norm)
            if not all(
                t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in norms
            ):
                raise ValueError("the native decode step takes contiguous fp32 norm weights")
            cache = layer.kv_cache
            if cache.dtype != torch.float32 or not cache.is_contiguous():
                raise ValueError("the native decode step takes a contiguous fp32 KV cache")
        first = layers[0]
        _, num_blocks, block_size, _, _ = first.kv_cache.shape
        self.hidden = first.qkv.in_features
        self.intermediate = first.gate_up.out_features
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self._table = torch.tensor([layer.fields() for layer in layers], dtype=torch.int64)
        if self._table.shape[1] != LAYER_FIELDS:  # decode.cpp would read past each row
            raise ValueError(f"a layer has {self._table.shape[1]} fields, not {LAYER_FIELDS}")
        self._dims = torch.tensor(
            [self.hidden, num_heads, num_kv_heads, head_dim, self.intermediate, num_blocks,
             block_size],
            dtype=torch.int64,
        )  # fmt: skip
        # decode.cpp's work buffers, per sequence: x, qkv, rotated q and k, attention, o, mlp
        self._width = 2 * self.hidden + 3 * self.q_size + 3 * self.kv_size + self.intermediate
        self._num_layers, self._eps, self._scale = len(layers), eps, scale
        self._run = load_library().lamina_decode_layers

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer on ``hidden`` ``(S, H)`` (the embeddings; overwritten), each
        sequence's new token at ``slot_mapping``, attending over its ``block_table`` row's
        ``context_lens`` cached tokens and itself; ``cos``/``sin`` ``(S, 1, D/2)``. Returns
        the last layer's output and the residual stream, for the final norm."""
        seqs = hidden.shape[0]
        residual = torch.empty_like(hidden)
        work = torch.empty(seqs * self._width)
        status = self._run(
            ptr(self._table),
            self._num_layers,
            ptr(self._dims),
            self._eps,
            self._scale,
            seqs,
            ptr(hidden),
            ptr(residual),
            ptr(cos),
            ptr(sin),
            ptr(slot_mapping),
            ptr(block_table),
            block_table.stride(0),
            ptr(context_lens),
            ptr(work),
        )
        if status:
            raise ValueError("query heads do not share the KV heads evenly")
        return hidden, residual
