"""The linear layers of a model on CPU: ``F.linear`` (MKL), oneDNN's packed matmul and the
native blocked matmul on its own packed weights (``kernels/linear.py``,
``kernels/cpu/gemm.cpp``), all layers in sequence so the weights stream from memory as in a
real step, across row counts (decode batch sizes and prefill chunks). Each MLP gate/up
projection is followed by ``silu_and_mul``, as the engine runs it; the fourth column is the
native matmul with gate/up and the activation fused into one call (``PackedSiluMul``, what
the engine runs). Prints median milliseconds of ``--runs``, the weight read rate and
GFLOP/s of the fastest, and the ratios: oneDNN to torch and to native, native to fused.

``--quantized``: the fused native layers on bf16, int8, fp8 and int4 (groups of 128) weights
against fp32, with the bytes each reads per second and its speed-up over fp32.

``--bf16``: the layers on bf16 weights and activations: ``F.linear``, oneDNN's packed
matmul (what the engine runs in bf16 where oneDNN has bf16 matmuls) and, on a CPU with
AVX-512 BF16, the native bf16 matmul (``PackedBf16Linear``, what it runs there), beside the
fused native layers in fp32 (what it runs in fp32).

    .venv/bin/python benchmarks/cpu_linear.py    # the 'small' preset's 40 linears
    .venv/bin/python benchmarks/cpu_linear.py --quantized --rows 1 8 64
    .venv/bin/python benchmarks/cpu_linear.py --bf16 --rows 1 32 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import median_ms

from lamina.kernels.cpu import (
    PackedLinear,
    PackedQuantLinear,
    PackedQuantSiluMul,
    PackedSiluMul,
    silu_and_mul,
)
from lamina.kernels.cpu.bf16_linear import PackedBf16Linear
from lamina.kernels.cpu.bf16_linear import available as bf16_available
from lamina.kernels.linear import OneDnnLinear, SiluMulLinear, TorchLinear
from lamina.kernels.weight_quant import quantize, quantize_int4
from lamina.services.engine_worker.default_model import ensure_default_model


def layer_shapes(model: Path) -> list[tuple[int, int]]:
    """(out, in) of every fused linear of the model, layer by layer (as the engine fuses):
    QKV, O, gate/up, down."""
    c = json.loads((model / "config.json").read_text())
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * c["num_hidden_layers"]


def run_all(layers: list, inputs: list[torch.Tensor]):
    """One pass over every layer, each with its own input (as a step's layers run)."""
    return lambda: [f(x) for f, x in zip(layers, inputs, strict=True)]


BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}


def quantized_layers(weights: list[torch.Tensor]) -> dict[str, list]:
    """The fused native layers (gate/up one gated call) on each weight format."""

    def packed(w: torch.Tensor, n: int, fmt: str):
        gated = n % 4 == 2
        if fmt == "fp32":
            return (PackedSiluMul if gated else PackedLinear)(w, None)
        q = quantize_int4(w, 128) if fmt == "int4" else quantize(w, fmt)
        return (PackedQuantSiluMul if gated else PackedQuantLinear)(q, None)

    return {fmt: [packed(w, n, fmt) for n, w in enumerate(weights)] for fmt in BYTES_PER_WEIGHT}


def compare_formats(shapes: list[tuple[int, int]], weights: list[torch.Tensor], args) -> None:
    layers = quantized_layers(weights)
    params = sum(w.numel() for w in weights)
    print(f"{'rows':>6} " + " ".join(f"{f + ' ms':>9} {'GB/s':>6}" for f in layers)
          + "  speed-up over fp32")  # fmt: skip
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        with torch.inference_mode():
            ms = {fmt: median_ms(run_all(impl, xs), args.runs) for fmt, impl in layers.items()}
        cells = " ".join(
            f"{ms[f]:>9.2f} {params * BYTES_PER_WEIGHT[f] / ms[f] / 1e6:>6.1f}" for f in layers
        )
        ups = ", ".join(f"{f} {ms['fp32'] / ms[f]:.2f}x" for f in layers if f != "fp32")
        print(f"{rows:>6} {cells}  {ups}", flush=True)


def compare_bf16(shapes: list[tuple[int, int]], weights: list[torch.Tensor], args) -> None:
    halves = [w.bfloat16() for w in weights]
    layers = {
        "bf16 torch": [TorchLinear(w, None) for w in halves],
        "bf16 oneDNN": [OneDnnLinear(w, None) for w in halves],
        "fp32 fused": quantized_layers(weights)["fp32"],
    }
    if bf16_available():
        layers["bf16 native"] = [PackedBf16Linear(w, None) for w in halves]
    print(f"{'rows':>6} " + " ".join(f"{name + ' ms':>15}" for name in layers)
          + "  torch/oneDNN  fp32/oneDNN  oneDNN/native")  # fmt: skip
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        inputs = {name: [x.bfloat16() for x in xs] if "bf16" in name else xs for name in layers}
        with torch.inference_mode():
            ms = {
                name: median_ms(run_all(layers[name], inputs[name]), args.runs) for name in layers
            }
        b = ms["bf16 oneDNN"]
        print(f"{rows:>6} " + " ".join(f"{v:>15.2f}" for v in ms.values())
              + f"  {ms['bf16 torch'] / b:>11.2f}x {ms['fp32 fused'] / b:>11.2f}x"
              + (f" {b / ms['bf16 native']:>12.2f}x" if "bf16 native" in ms else ""),
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the 'small' preset)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 512, 2048])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quantized", action="store_true", help="bf16, int8, fp8, int4 vs fp32")
    parser.add_argument("--bf16", action="store_true", help="bf16: F.linear vs oneDNN packed")
    args = parser.parse_args()
    shapes = layer_shapes(args.model or ensure_default_model("small"))
    weights = [torch.randn(n, k) for n, k in shapes]
    if args.quantized:
        compare_formats(shapes, weights, args)
        return
    if args.bf16:
        compare_bf16(shapes, weights, args)
        return
    impls = {"torch": TorchLinear, "oneDNN": OneDnnLinear, "native": PackedLinear}

    def build(w: torch.Tensor, cls: type, gated: bool):
        return SiluMulLinear(cls(w, None), silu_and_mul) if gated else cls(w, None)

    layers = {
        name: [build(w, cls, n % 4 == 2) for n, w in enumerate(weights)]
        for name, cls in impls.items()
    }
    layers["fused"] = [
        PackedSiluMul(w, None) if n % 4 == 2 else layer
        for n, (w, layer) in enumerate(zip(weights, layers["native"], strict=True))
    ]
    params = sum(w.numel() for w in weights)
    print(f"{len(shapes)} linears, {params / 1e6:.1f}M parameters, fp32, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'rows':>6} {'torch ms':>9} {'oneDNN ms':>10} {'native ms':>10} {'fused ms':>9} "
          f"{'best GB/s':>10} {'GFLOP/s':>8} {'oneDNN/torch':>13} {'oneDNN/native':>14} "
          f"{'native/fused':>13}")  # fmt: skip
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        with torch.inference_mode():
            ms = {name: median_ms(run_all(impl, xs), args.runs) for name, impl in layers.items()}
        a, b, n, f = ms["torch"], ms["oneDNN"], ms["native"], ms["fused"]
        best = min(ms.values())
        rate, gflops = params * 4 / best / 1e6, 2 * rows * params / best / 1e6
        print(f"{rows:>6} {a:>9.1f} {b:>10.1f} {n:>10.1f} {f:>9.1f} {rate:>10.1f} "
              f"{gflops:>8.1f} {a / b:>12.2f}x {b / n:>13.2f}x {n / f:>12.2f}x",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
