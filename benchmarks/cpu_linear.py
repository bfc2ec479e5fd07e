"""The linear layers of a model on CPU: ``F.linear`` (MKL), oneDNN's packed matmul and the
native skinny kernel (``kernels/linear.py``), all layers in sequence so the weights stream
from memory as in a real step, across row counts (decode batch sizes and prefill chunks).
Prints median milliseconds of ``--runs``, the weight read rate of the fastest, and the
ratios to oneDNN (the skinny kernel only up to ``--skinny-max`` rows).

    .venv/bin/python benchmarks/cpu_linear.py    # the 'small' preset's 40 linears
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import median_ms

from lamina.kernels.cpu import skinny_linear
from lamina.kernels.linear import OneDnnLinear, TorchLinear
from lamina.services.engine_worker.default_model import ensure_default_model


def layer_shapes(model: Path) -> list[tuple[int, int]]:
    """(out, in) of every fused linear of the model, layer by layer (as the engine fuses)."""
    c = json.loads((model / "config.json").read_text())
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * c["num_hidden_layers"]


def run_all(layers: list, inputs: list[torch.Tensor]):
    """One pass over every layer, each with its own input (as a step's layers run)."""
    return lambda: [f(x) for f, x in zip(layers, inputs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the 'small' preset)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 64, 512])
    parser.add_argument("--skinny-max", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shapes = layer_shapes(args.model or ensure_default_model("small"))
    weights = [torch.randn(n, k) for n, k in shapes]
    impls = {"torch (MKL)": TorchLinear, "oneDNN packed": OneDnnLinear}
    layers = {name: [cls(w, None) for w in weights] for name, cls in impls.items()}
    layers["skinny"] = [lambda x, w=w: skinny_linear(x, w) for w in weights]
    params = sum(w.numel() for w in weights)
    print(f"{len(shapes)} linears, {params / 1e6:.1f}M parameters, fp32, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'rows':>6} {'torch ms':>9} {'oneDNN ms':>10} {'skinny ms':>10} {'best GB/s':>10} "
          f"{'oneDNN/torch':>13} {'oneDNN/skinny':>14}")  # fmt: skip
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in shapes]
        names = [n for n in layers if n != "skinny" or rows <= args.skinny_max]
        with torch.inference_mode():
            ms = {name: median_ms(run_all(layers[name], xs), args.runs) for name in names}
        a, b, c = ms["torch (MKL)"], ms["oneDNN packed"], ms.get("skinny", float("nan"))
        rate = params * 4 / min(ms.values()) / 1e6
        print(f"{rows:>6} {a:>9.1f} {b:>10.1f} {c:>10.1f} {rate:>10.1f} {a / b:>12.2f}x "
              f"{b / c:>13.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
