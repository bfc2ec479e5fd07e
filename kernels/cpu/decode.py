"""A decode step's forward pass in one native call (``decode.cpp``), from the token ids
to the logits, on the CPU with every linear on a native matmul and the KV cache in the
model's dtype: an fp32 model (fp32 or quantized weights, adapters allowed) or a bf16 one
(:class:`~lamina.kernels.cpu.bf16_linear.PackedBf16Linear`; no adapters, no per-head
norms). It is what
:meth:`lamina.services.engine_worker.engine.model.CausalLM.decode_logits` runs for a step of
decodes only, instead of a dozen Python-level kernel calls per layer and the lookups,
attention metadata and LM head around them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lamina.kernels.cpu.bf16_linear import PackedBf16Linear, PackedBf16SiluMul
from lamina.kernels.cpu.build import load_library, ptr
from lamina.kernels.cpu.linear import PackedLinear, PackedQuantSiluMul, PackedSiluMul

NativeLinear = PackedLinear | PackedBf16Linear
"""The linears the native step runs: a packed fp32 or quantized weight (fp32 models), a
pair-packed bf16 one (bf16 models)."""
NativeGated = PackedSiluMul | PackedQuantSiluMul | PackedBf16SiluMul
"""The gated MLP projections it runs."""

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The model dtypes the native step runs, by ``decode.cpp``'s ``dtype`` argument."""

LAYER_FIELDS = 40
"""Fields in a row of the layer table: ``decode.cpp``'s ``kLayerFields``."""
LORA_FIELDS = 12
"""Fields in a row of the LoRA table: ``decode.cpp``'s ``kLoraFields`` (per fused linear,
Q/K/V, O, gate/up, down: the slots' ``A`` and ``B`` and the slot width, or zeros where no
adapter touches it)."""


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's weights and cache as the native step reads them."""

    input_norm: torch.Tensor
    qkv: NativeLinear
    qk_norm: torch.Tensor | None  # (Hq + Hkv, D) fp32: Qwen3's per-head norms
    o: NativeLinear
    post_norm: torch.Tensor
    gate_up: NativeGated
    down: NativeLinear
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D) in the model's dtype

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


class DecodeStep:
    """A model's forward pass for steps of decodes only (one token per sequence): every
    decoder layer, with the embedding and rotary lookups before them and the final norm
    and LM head after. The tensors it names must outlive it (the model and its runner
    hold them)."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        embed: torch.Tensor,  # (V, H), in the model's dtype as every table here
        cos: torch.Tensor,  # (max_positions, D/2), and sin
        sin: torch.Tensor,
        norm: torch.Tensor,  # (H,): the final norm
        lm_head: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        dtype = embed.dtype
        if dtype not in DTYPES:
            raise ValueError(f"the native decode step runs fp32 or bf16 models, not {dtype}")

        def plain(t: torch.Tensor) -> bool:
            return t.dtype == dtype and t.is_contiguous()

        for layer in layers:
            norms = (layer.input_norm, layer.post_norm, layer.kv_cache)
            if not all(plain(t) for t in norms):
                raise ValueError(f"the native decode step takes contiguous {dtype} norms and cache")
            if layer.qk_norm is not None and not (dtype == torch.float32 and plain(layer.qk_norm)):
                raise ValueError("the native decode step takes per-head norms in fp32 models")
        if not all(plain(t) for t in (embed, cos, sin, norm)):
            raise ValueError(f"the native decode step takes contiguous {dtype} tables and norm")
        first = layers[0]
        _, num_blocks, block_size, _, _ = first.kv_cache.shape
        hidden = first.qkv.in_features
        intermediate = first.gate_up.out_features
        if embed.shape[1] != hidden or cos.shape[1] * 2 != head_dim or cos.shape != sin.shape:
            raise ValueError("the embedding or rotary tables do not fit the layers")
        # A head on the native matmul runs in the same call; another (a small weight on
        # F.linear) is called on the final norm's output.
        native_head = isinstance(lm_head, PackedLinear | PackedBf16Linear)
        self._python_head = None if native_head else lm_head
        self._outputs = lm_head.out_features if native_head else hidden
        self._table = torch.tensor([layer.fields() for layer in layers], dtype=torch.int64)
        if self._table.shape[1] != LAYER_FIELDS:  # decode.cpp would read past each row
            raise ValueError(f"a layer has {self._table.shape[1]} fields, not {LAYER_FIELDS}")
        self._dims = torch.tensor(
            [hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks, block_size,
             embed.shape[0], cos.shape[0]],
            dtype=torch.int64,
        )  # fmt: skip
        self._head = torch.tensor(lm_head.native_fields()) if native_head else None
        library = load_library()
        self._dtype = dtype
        self._work_bytes = library.lamina_decode_work_bytes(1, ptr(self._dims), DTYPES[dtype])
        """decode.cpp's work buffers' bytes per sequence (they scale with the sequences)."""
        self._num_layers, self._eps, self._scale = len(layers), eps, scale
        self._tables = (ptr(embed), ptr(cos), ptr(sin), ptr(norm), ptr(self._head))
        self._named = (layers, embed, cos, sin, norm, lm_head)  # what the pointers point at
        self._run = library.lamina_decode_logits

    def __call__(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        block_table: np.ndarray,
        context_lens: np.ndarray,
        lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``(S, V)`` for ``S`` sequences' next tokens: each one's last token
        ``ids`` at ``positions``, written to the cache at ``slots``, attending over its
        ``block_table`` row's ``context_lens`` cached tokens and itself (int64 arrays);
        with ``lora``, the LoRA table (``(layers, LORA_FIELDS)``) and each sequence's
        adapter slot (``(S,)``, -1: none), both int64."""
        if lora is not None and lora[0].shape != (self._num_layers, LORA_FIELDS):
            raise ValueError(f"the LoRA table is {tuple(lora[0].shape)}, not one row a layer")
        if lora is not None and self._dtype != torch.float32:
            raise ValueError("the native decode step runs adapters in fp32 models only")
        adapters, adapter_slots = (None, None) if lora is None else (ptr(t) for t in lora)
        ids, positions, slots, table, contexts = (
            np.ascontiguousarray(a, dtype=np.int64)
            for a in (ids, positions, slots, block_table, context_lens)
        )
        seqs = ids.shape[0]
        logits = torch.empty((seqs, self._outputs), dtype=self._dtype)
        work = torch.empty(seqs * self._work_bytes, dtype=torch.uint8)
        status = self._run(
            ptr(self._table),
            self._num_layers,
            ptr(self._dims),
            DTYPES[self._dtype],
            self._eps,
            self._scale,
            seqs,
            ids.ctypes.data,
            positions.ctypes.data,
            *self._tables,
            slots.ctypes.data,
            table.ctypes.data,
            table.shape[1],
            contexts.ctypes.data,
            adapters,
            adapter_slots,
            ptr(work),
            ptr(logits),
        )
        if status == 3:
            raise ValueError("a token id or position is outside the model's tables")
        if status == 4:
            raise ValueError(f"a layer does not fit a {self._dtype} native decode step")
        if status:
            raise ValueError("query heads do not share the KV heads evenly")
        return (logits if self._python_head is None else self._python_head(logits)).float()
