"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flattened batch.

Every step's tokens, from all sequences, form one ``(T,)`` run; attention finds each
token's sequence through :class:`AttentionMetadata`. Q/K/V and gate/up projections are
fused into one matmul each at load time: fewer, larger kernels per layer. With a
``quantization``, every linear (the LM head included; not the embedding) runs on weights
quantized at load; a quantized checkpoint's linears run on its weights as stored. Under
tensor parallelism (``parallel.py``) each rank holds its heads' and MLP columns' share of
those fused weights and ``self.local`` describes its shapes. A step of decodes only on the
CPU backend runs its layers in one native call where it can (:meth:`CausalLM.forward`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lamina.kernels.cpu.decode import DTYPES as DECODE_DTYPES
from lamina.kernels.cpu.decode import DecodeLayer, DecodeStep, NativeGated, NativeLinear
from lamina.kernels.dispatch import load_ops
from lamina.kernels.linear import (
    GatedLinear,
    Linear,
    Weight,
    gated_linear_factory,
    linear_factory,
)
from lamina.kernels.reference import AttentionMetadata, rotary_cos_sin, rotary_for_positions
from lamina.kernels.weight_quant import QuantizedWeight, WeightFormat, concat
from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.loader import CheckpointTensors
from lamina.services.engine_worker.engine.lora import LoraStep
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import (
    SINGLE,
    WHOLE,
    GatheredInput,
    PipelineStage,
    TensorParallel,
)
from lamina.services.engine_worker.engine.rank_weights import RankWeights, reads_every_rank


def stack_rows(parts: list[Weight]) -> Weight:
    """Projections fused into one weight, their rows stacked (plain or quantized alike)."""
    if all(isinstance(part, QuantizedWeight) for part in parts):
        return concat(parts)  # type: ignore[arg-type]
    if any(isinstance(part, QuantizedWeight) for part in parts):
        raise ModelLoadError("checkpoint", "a fused projection mixes quantized and plain parts")
    return torch.cat(parts)  # type: ignore[arg-type]


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q_size + 2 * kv_size
    qk_norm: torch.Tensor | None  # (Hq + Hkv, head_dim): Qwen3's q_norm/k_norm per head
    o: Linear | GatheredInput  # gathers its input where it reads every rank's (act-order)
    post_norm: torch.Tensor
    gate_up: GatedLinear  # hidden -> intermediate: silu(x gate^T) * (x up^T)
    down: Linear | GatheredInput


class CausalLM:
    """Weights and forward pass of one supported decoder-only model."""

    def __init__(
        self,
        config: ModelConfig,
        weights: CheckpointTensors,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel = SINGLE,
        quantization: WeightFormat | None = None,
        pp: PipelineStage = WHOLE,
    ) -> None:
        self.config = c = config
        self.tp, self.pp = tp, pp
        layers = pp.layers(c.num_layers)
        self.local = dataclasses.replace(tp.local_config(config), num_layers=len(layers))
        """This rank's shapes: its stage's layers, their heads and MLP width divided
        across tensor-parallel ranks."""
        self.dtype = dtype
        stored = config.quantization.weight_format if config.quantization else None
        self.weight_dtype = quantization or stored or str(dtype).removeprefix("torch.")
        """What the linears' weights are stored as: the quantized format, or ``dtype``."""
        if quantization is not None and config.quantization is not None:
            raise ModelLoadError(
                "quantization",
                f"the checkpoint is already quantized ({config.quantization.method}); load it "
                "without --quantization",
            )
        self.ops = load_ops(device, dtype)
        backend = self.ops.backend
        linear = linear_factory(device, dtype, backend, quantization)
        gated = gated_linear_factory(device, dtype, backend, self.ops.silu_and_mul, quantization)
        w = RankWeights(weights, config, dtype, device, tp, quantization)
        h, d = c.hidden_size, c.head_dim

        tied = c.tie_word_embeddings
        self.embed = None  # the first stage's (and the last's, when the LM head is tied to it)
        if pp.first or (pp.last and tied):
            self.embed = w.take("model.embed_tokens.weight", c.vocab_size, h)
        self.layers = [self._layer(w, n, linear, gated) for n in layers]
        self.checkpoint_kv_scales = [
            w.kv_scales(f"model.layers.{n}.self_attn.", c.num_kv_heads) for n in layers
        ]
        """Per layer of this stage, the checkpoint's fp8 KV scales ``(2, local Hkv)`` or None."""
        self.norm = self.lm_head = None  # the last stage's
        if pp.last:
            self.norm = w.take("model.norm.weight", h)
            head = self.embed if tied else w.weight("lm_head.", c.vocab_size, h)
            self.lm_head = linear(head, None)
        self.weight_bytes = w.bytes
        """Bytes of this rank's share of the weights (as loaded, before any repacking)."""
        self.cos, self.sin = rotary_cos_sin(
            d, c.max_position_embeddings, c.rope_theta, c.rope_scaling, device
        )
        self.scale = d**-0.5
        self.native_decode = self.ops.backend == "cpu" and tp.size == 1 and pp.size == 1
        """Run steps of decodes only as one native call (``kernels/cpu/decode.cpp``) where
        the layers allow it (see :meth:`decode_logits`)."""
        self._native: tuple[int, DecodeStep | None] | None = None
        """(the KV caches it was made for, by their first's address; the native step)."""

    def _layer(
        self,
        w: RankWeights,
        n: int,
        linear: Callable[[Weight, torch.Tensor | None], Linear],
        gated: Callable[[Weight, torch.Tensor | None], GatedLinear],
    ) -> Layer:
        """Decoder layer ``n``: its projections fused (Q/K/V, gate/up), this rank's share."""
        c = self.config
        h, i = c.hidden_size, c.intermediate_size
        p = f"model.layers.{n}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = gate_up_bias = None
        if c.qkv_bias:
            qkv_bias = torch.cat(
                [
                    w.rows(attn + "q_proj.bias", c.q_size),
                    w.rows(attn + "k_proj.bias", c.kv_size, kv=True),
                    w.rows(attn + "v_proj.bias", c.kv_size, kv=True),
                ]
            )
        if c.mlp_bias:
            gate_up_bias = torch.cat(
                [w.rows(mlp + "gate_proj.bias", i), w.rows(mlp + "up_proj.bias", i)]
            )
        qkv = [
            w.weight(attn + "q_proj.", c.q_size, h, shard_dim=0),
            w.weight(attn + "k_proj.", c.kv_size, h, shard_dim=0, kv=True),
            w.weight(attn + "v_proj.", c.kv_size, h, shard_dim=0, kv=True),
        ]
        gate_up = [
            w.weight(mlp + "gate_proj.", i, h, shard_dim=0),
            w.weight(mlp + "up_proj.", i, h, shard_dim=0),
        ]
        return Layer(
            input_norm=w.take(p + "input_layernorm.weight", h),
            qkv=linear(stack_rows(qkv), qkv_bias),
            qk_norm=self._qk_norm(w, attn) if c.qk_norm else None,
            o=self._row_parallel(
                linear,
                w.weight(attn + "o_proj.", h, c.q_size, shard_dim=1),
                w.rank0_bias(attn + "o_proj.bias", h) if c.o_bias else None,
            ),
            post_norm=w.take(p + "post_attention_layernorm.weight", h),
            gate_up=gated(stack_rows(gate_up), gate_up_bias),
            down=self._row_parallel(
                linear,
                w.weight(mlp + "down_proj.", h, i, shard_dim=1),
                w.rank0_bias(mlp + "down_proj.bias", h) if c.mlp_bias else None,
            ),
        )

    def _row_parallel(
        self,
        linear: Callable[[Weight, torch.Tensor | None], Linear],
        weight: Weight,
        bias: torch.Tensor | None,
    ) -> Linear | GatheredInput:
        """A row-parallel linear; one that reads every rank's inputs gathers them."""
        made = linear(weight, bias)
        return GatheredInput(made, self.tp) if reads_every_rank(weight, self.tp) else made

    def _qk_norm(self, w: RankWeights, prefix: str) -> torch.Tensor:
        """Qwen3 normalises each query and key head before rotary; stacking the two weights
        per head lets one RMSNorm call cover the fused ``(T, Hq + Hkv, D)`` view."""
        c = self.local
        q_norm = w.take(prefix + "q_norm.weight", c.head_dim)
        k_norm = w.take(prefix + "k_norm.weight", c.head_dim)
        return torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])

    @torch.inference_mode()
    def decode_logits(
        self,
        ids: np.ndarray,  # (S,) each sequence's last token
        positions: np.ndarray,  # (S,)
        slots: np.ndarray,  # (S,) flat cache slots of the new tokens
        block_table: np.ndarray,  # (S, max_blocks)
        context_lens: np.ndarray,  # (S,) cached tokens before each new one
        kv_caches: list[torch.Tensor],
        lora: LoraStep | None = None,  # the step's LoRA adapters, if any sequence has one
    ) -> torch.Tensor | None:
        """Logits ``(S, vocab)`` of a step of decodes only, by the native decode step in one
        call; None where that does not apply (the caller runs :meth:`forward`)."""
        if lora is not None and (lora.kernel_slots is None or self.dtype != torch.float32):
            return None  # the adapters' torch forms, or a bf16 model's (the native step's are fp32)
        step = self._decode_step(kv_caches)
        if step is None:
            return None
        adapters = None if lora is None else (lora.slots.native_table(), lora.kernel_slots)
        return step(ids, positions, slots, block_table, context_lens, adapters)

    def _decode_step(self, kv_caches: list[torch.Tensor]) -> DecodeStep | None:
        """The native decode step over ``kv_caches``, made on first use; None where it
        does not apply: another backend or dtype, tensor parallelism, a linear not on a
        native matmul (a small fp32 weight runs ``F.linear``), a quantized KV cache, or
        per-head norms in bf16."""
        if not self.native_decode or not kv_caches:
            return None
        key = kv_caches[0].data_ptr()
        if self._native is None or self._native[0] != key:
            self._native = (key, self._make_decode_step(kv_caches))
        return self._native[1]

    def _make_decode_step(self, kv_caches: list[torch.Tensor]) -> DecodeStep | None:
        dtype = self.dtype
        if dtype not in DECODE_DTYPES:
            return None
        layers = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            linears = (layer.qkv, layer.o, layer.down)
            if not all(isinstance(lin, NativeLinear) for lin in linears):
                return None
            if not isinstance(layer.gate_up, NativeGated) or cache.dtype != dtype:
                return None
            if layer.qk_norm is not None and dtype != torch.float32:
                return None
            layers.append(
                DecodeLayer(
                    layer.input_norm.contiguous(),
                    layer.qkv,
                    None if layer.qk_norm is None else layer.qk_norm.contiguous(),
                    layer.o,
                    layer.post_norm.contiguous(),
                    layer.gate_up,
                    layer.down,
                    cache,
                )
            )
        c = self.local
        return DecodeStep(
            layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.rms_norm_eps,
            self.scale,
            self.embed.contiguous(),
            self.cos.to(dtype).contiguous(),  # rounded once, as each step's lookup rounds
            self.sin.to(dtype).contiguous(),
            self.norm.contiguous(),
            self.lm_head,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer (2, num_blocks, block_size, Hkv, D)
        logits_indices: torch.Tensor,  # (S,) rows of the batch whose next token is sampled
        kv_scales: list[torch.Tensor | None] | None = None,  # per layer, quantized caches
        lora: LoraStep | None = None,  # the step's LoRA adapters, if any token has one
    ) -> torch.Tensor | None:
        """Logits ``(S, vocab)`` in fp32 for the tokens at ``logits_indices``; on a
        pipeline stage before the last, None (its output went to the next stage)."""
        c = self.local  # this rank's layers, heads and MLP width
        tp, pp = self.tp, self.pp
        num_tokens = input_ids.shape[0]
        eps = c.rms_norm_eps
        residual: torch.Tensor | None = None
        if pp.first:
            hidden = F.embedding(input_ids, self.embed)  # (T, hidden)
        else:
            shape = (num_tokens, c.hidden_size)
            hidden, residual = pp.receive(shape, self.dtype, input_ids.device)
        cos, sin = rotary_for_positions(positions, self.cos, self.sin, self.dtype)
        heads = c.num_heads + c.num_kv_heads
        ops = self.ops
        scales = kv_scales or [None] * len(kv_caches)
        for n, (layer, kv_cache, kv_scale) in enumerate(
            zip(self.layers, kv_caches, scales, strict=True)
        ):
            x, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.add("qkv", n, qkv, x)
            v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
            qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, heads, c.head_dim)
            if layer.qk_norm is not None:
                qk, _ = ops.rms_norm(qk, layer.qk_norm, eps)
            qk = ops.apply_rotary(qk, cos, sin)  # queries and keys in one call
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            ops.write_kv_cache(k, v, kv_cache, attn.slot_mapping, kv_scale, attn.block_writes)
            o = ops.paged_attention(q, k, v, kv_cache, attn, self.scale, kv_scale)  # (T, Hq, D)
            if lora is None:
                hidden = tp.all_reduce(layer.o(o.view(num_tokens, c.q_size)))
                x, residual = ops.rms_norm(hidden, layer.post_norm, eps, residual)
                hidden = tp.all_reduce(layer.down(layer.gate_up(x)))
            else:  # each rank's LoRA product joins its partial sum before the all-reduce
                o = o.reshape(num_tokens, c.q_size)
                hidden = tp.all_reduce(lora.add("o", n, layer.o(o), o))
                x, residual = ops.rms_norm(hidden, layer.post_norm, eps, residual)
                gate_up = lora.add("gate_up", n, layer.gate_up.pre_activation(x), x)
                y = ops.silu_and_mul(gate_up)
                hidden = tp.all_reduce(lora.add("down", n, layer.down(y), y))
        if not pp.last:
            pp.send(hidden, residual)
            return None
        hidden, _ = ops.rms_norm(hidden[logits_indices], self.norm, eps, residual[logits_indices])
        return self.lm_head(hidden).float()
