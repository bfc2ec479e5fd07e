"""GPU kernel benchmark: decode paged attention, Triton vs the torch reference (gather +
``scaled_dot_product_attention``), as achieved memory bandwidth and a fraction of the
device's peak, for bf16 and quantized (fp8, int8) caches; the weight-only quantized linears
(W8A16, W4A16) against torch's bf16 matmul on the same shape; then the engine's end-to-end
decode tokens/s with each backend, with CUDA graphs on and off, and with int8 weights.

Needs a CUDA device; ``benchmarks/gpu_check.sh`` runs it with the GPU tests.

    # H200: 4.8 TB/s
    python benchmarks/kernels.py --peak-gbs 4800 [--parts table linear engine sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from lamina.kernels import reference as ref
from lamina.kernels.reference import AttentionMetadata, kv_quant
from lamina.kernels.weight_quant import QuantizedWeight


def time_cuda(fn, rounds: int = 3) -> float:
    """Median seconds of ``fn()`` over ``rounds`` rounds of ``triton.testing.do_bench``
    (each: warm-up, then ~100 ms of calls, the L2 cache flushed before each, so small
    caches are not read from L2; the round's median)."""
    from triton.testing import do_bench

    return statistics.median(
        do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3 for _ in range(rounds)
    )


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy, bytes read plus written: the practical peak
    next to the datasheet's."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * (1 << 32) / time_cuda(lambda: dst.copy_(src)) / 1e9


def quantized(cache: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``cache`` stored as ``kind`` (``auto``: as is), with its scales, as the engine would."""
    if kind == "auto":
        return cache, None
    hkv = cache.shape[3]
    if kind == "fp8":
        stored = cache.clamp(-kv_quant.FP8_MAX, kv_quant.FP8_MAX).to(torch.float8_e4m3fn)
        return stored, torch.ones(2, hkv, device=cache.device)
    scales = cache.abs().amax(dim=(2, 4)).float().clamp_min(1e-8) / kv_quant.INT8_MAX
    stored = torch.floor(cache / scales[:, :, None, :, None] + 0.5).clamp(-127, 127)
    return stored.to(torch.int8), scales


def decode_case(
    batch: int, context: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, kind: str
) -> tuple:
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq + 1
    dev = torch.device("cuda")
    cache, scales = quantized(torch.randn(2, num_blocks, bs, hkv, d, device=dev, dtype=dtype), kind)
    table = np.random.default_rng(0).permutation(num_blocks - 1)[: batch * blocks_per_seq]
    table = table.reshape(batch, blocks_per_seq)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    k = torch.randn(batch, hkv, d, device=dev, dtype=dtype)
    slots = torch.tensor(
        [table[i, (context - 1) // bs] * bs + (context - 1) % bs for i in range(batch)], device=dev
    )
    meta = AttentionMetadata.build([1] * batch, [context - 1] * batch, table, batch, bs, slots, dev)
    bytes_read = batch * context * hkv * d * 2 * cache.element_size()  # K and V once
    return q, k, cache, scales, meta, bytes_read


def attention_table(args: argparse.Namespace) -> None:
    print(
        f"decode attention, bf16 queries, {args.hq} query / {args.hkv} KV heads, head_dim "
        f"{args.head_dim}, block {args.block_size}; peak {args.peak_gbs:.0f} GB/s"
    )
    print(
        f"{'cache':>5} {'batch':>5} {'context':>7} {'triton GB/s':>12} {'% peak':>7} "
        f"{'torch GB/s':>11} {'speed-up':>8} {'fp16 dots GB/s':>15}"
    )
    for kind in args.kv_cache_dtypes:
        for batch in args.batches:
            for context in args.contexts:
                t_tri, t_ref, t_fp16, nbytes = measure(batch, context, kind, args)
                gbs, ref_gbs = nbytes / t_tri / 1e9, nbytes / t_ref / 1e9
                fp16 = "-" if t_fp16 is None else f"{nbytes / t_fp16 / 1e9:.0f}"
                print(
                    f"{kind:>5} {batch:>5} {context:>7} {gbs:>12.0f} "
                    f"{100 * gbs / args.peak_gbs:>6.1f}% {ref_gbs:>11.0f} {t_ref / t_tri:>7.2f}x "
                    f"{fp16:>15}",
                    flush=True,
                )
                torch.cuda.empty_cache()


def measure(
    batch: int, context: int, kind: str, args: argparse.Namespace
) -> tuple[float, float, float | None, int]:
    """(Triton seconds, reference seconds, Triton seconds with the dots in fp16 for a
    quantized cache (else None), bytes of K/V read) for one decode batch."""
    from lamina.kernels import triton as tri
    from lamina.kernels.triton.attention import default_launch

    q, k, cache, scales, meta, nbytes = decode_case(
        batch, context, args.hq, args.hkv, args.head_dim, args.block_size, torch.bfloat16, kind
    )
    scale = args.head_dim**-0.5
    t_tri = time_cuda(lambda: tri.paged_attention(q, k, k, cache, meta, scale, scales))
    t_ref = time_cuda(lambda: ref.paged_attention(q, k, k, cache, meta, scale, scales))
    t_fp16 = None
    if kind != "auto":
        fp16 = dataclasses.replace(default_launch(kind), fp16_dot=True)
        t_fp16 = time_cuda(
            lambda: tri.paged_attention(q, k, k, cache, meta, scale, scales, launch=fp16)
        )
    return t_tri, t_ref, t_fp16, nbytes


def sweep(args: argparse.Namespace, kind: str) -> None:
    """Decode attention GB/s of each launch configuration (tile, warps, stages, split
    target) on a few cases with a ``kind`` cache: batches that take the one-pass kernel
    and the split-K one."""
    from lamina.kernels.triton.attention import Launch, default_launch

    launches = [
        Launch(tile, warps, stages, per_sm)
        for tile in (32, 64, 128)
        for warps in (2, 4, 8)
        for stages in (2, 3)
        for per_sm in (2, 4, 8, 16)
    ]
    default = default_launch(None if kind == "auto" else kind)
    if default not in launches:
        launches.append(default)
    print(
        f"launch sweep ({kind} cache; default {default}), GB/s, tile/warps/stages/programs per SM:"
    )
    overall = dict.fromkeys(launches, 0.0)
    for batch, context in args.sweep_cases:
        rates = _sweep_case(batch, context, kind, launches, args)
        for launch, rate in rates.items():
            overall[launch] += math.log(rate) / len(args.sweep_cases)
        print(
            f"  batch {batch} context {context}: default {rates[default]:.0f}; "
            f"best {_ranked(rates, 5)}; worst {_ranked(rates, -2)}",
            flush=True,
        )
        torch.cuda.empty_cache()
    geomean = {launch: math.exp(value) for launch, value in overall.items()}
    print(f"  geometric mean over the cases: default {geomean[default]:.0f}; "
          f"best {_ranked(geomean, 8)}")  # fmt: skip


def _ranked(rates: dict, count: int) -> str:
    """The ``count`` best (negative: worst) launches of ``rates``, named t/w/s/p."""
    ranked = sorted(rates, key=rates.__getitem__, reverse=True)
    chosen = ranked[:count] if count > 0 else ranked[count:]
    return ", ".join(
        f"{lc.tile}/{lc.num_warps}/{lc.num_stages}/{lc.programs_per_sm} {rates[lc]:.0f}"
        for lc in chosen
    )


def _sweep_case(
    batch: int, context: int, kind: str, launches: list, args: argparse.Namespace
) -> dict:
    from lamina.kernels import triton as tri

    q, k, cache, scales, meta, nbytes = decode_case(
        batch, context, args.hq, args.hkv, args.head_dim, args.block_size,
        torch.bfloat16, kind,
    )  # fmt: skip
    scale = args.head_dim**-0.5
    return {
        launch: nbytes
        / time_cuda(
            lambda launch=launch: tri.paged_attention(
                q, k, k, cache, meta, scale, scales, launch=launch
            ),
            rounds=1,
        )
        / 1e9
        for launch in launches
    }


def linear_table(args: argparse.Namespace, device: str = "cuda") -> None:
    """Weight-only quantized linears at decode batch sizes: Triton's W8A16 (int8, fp8) and
    W4A16 (int4, groups of 128) kernels against torch's bf16 matmul of the same shape (the
    unquantized peer: a decode-sized matmul reads its weight once, so the quantized ones
    should take about their share of its bytes) and against torch's dequantize-then-matmul
    (the reference the tests hold them to). GB/s counts the stored weight's bytes (codes,
    scales, zero points) over the time."""
    from lamina.kernels.triton.quant_linear import TritonQuantLinear
    from lamina.kernels.weight_quant import quantize, quantize_int4

    print(f"weight-only linears, bf16 activations; peak {args.peak_gbs:.0f} GB/s")
    print(
        f"{'weight':>6} {'batch':>5} {'N x K':>13} {'GB/s':>6} {'% peak':>7} "
        f"{'vs bf16':>8} {'vs dequant+mm':>13}"
    )
    for n, k in args.linear_shapes:
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        stored = {
            "int8": quantize(weight, "int8"),
            "fp8": quantize(weight, "fp8"),
            "int4": quantize_int4(weight, 128),
        }
        for batch in args.linear_batches:
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            t_bf16 = time_cuda(partial(F.linear, x, weight))
            rows = [("bf16", 2 * n * k, t_bf16, None)]
            for name, q in stored.items():
                kernel = TritonQuantLinear(q, None)
                t_tri = time_cuda(partial(kernel, x))
                t_ref = time_cuda(partial(_dequantize_then_linear, x, q))
                rows.append((name, _stored_bytes(kernel), t_tri, t_ref))
            for name, nbytes, t, t_ref in rows:
                gbs = nbytes / t / 1e9
                vs_ref = "-" if t_ref is None else f"{t_ref / t:.2f}x"
                print(
                    f"{name:>6} {batch:>5} {f'{n}x{k}':>13} {gbs:>6.0f} "
                    f"{100 * gbs / args.peak_gbs:>6.1f}% {t_bf16 / t:>7.2f}x {vs_ref:>13}",
                    flush=True,
                )
        torch.cuda.empty_cache()


def linear_sweep(args: argparse.Namespace, device: str = "cuda") -> None:
    """Each quantized linear's GB/s (stored bytes over time) under every launch
    configuration (columns and inputs per tile, warps, stages, programs per SM the split
    along K aims for; 0: no split) on a few decode-sized cases, for each format of
    ``--linear-formats``: what the defaults in ``kernels/triton/quant_linear.py`` should be.
    A launch that needs more shared memory than the device has reads 0."""
    from triton.runtime.errors import OutOfResources

    from lamina.kernels.triton.quant_linear import DEFAULT_LAUNCH, Launch, TritonQuantLinear
    from lamina.kernels.weight_quant import quantize, quantize_int4

    launches = [
        Launch(block_n, block_k, warps, stages, per_sm)
        for block_n in (32, 64)
        for block_k in (64, 128, 256)
        for warps in (4, 8)
        for stages in (3,)
        for per_sm in (0, 2, 4)
    ]
    if DEFAULT_LAUNCH not in launches:
        launches.append(DEFAULT_LAUNCH)
    name = lambda lc: (  # noqa: E731
        f"{lc.block_n}/{lc.block_k}/{lc.num_warps}/{lc.num_stages}/{lc.programs_per_sm}"
    )
    for fmt in args.linear_formats:
        print(f"{fmt} linear launch sweep (default {name(DEFAULT_LAUNCH)}), GB/s, "
              "columns/inputs/warps/stages/programs per SM:")  # fmt: skip
        overall = dict.fromkeys(launches, 0.0)
        for batch, n, k in args.linear_sweep_cases:
            weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
            q = quantize_int4(weight, 128) if fmt == "int4" else quantize(weight, fmt)
            kernel = TritonQuantLinear(q, None)
            nbytes = _stored_bytes(kernel)
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            rates = {}
            for lc in launches:
                try:
                    rates[lc] = nbytes / time_cuda(partial(kernel, x, lc), rounds=1) / 1e9
                except OutOfResources:  # more shared memory than a multiprocessor has
                    rates[lc] = 0.0
            for lc, rate in rates.items():
                overall[lc] += (math.log(rate) if rate else -math.inf) / len(
                    args.linear_sweep_cases
                )
            ranked = sorted(rates, key=rates.__getitem__, reverse=True)
            print(f"  batch {batch} {n}x{k}: default {rates[DEFAULT_LAUNCH]:.0f}; best "
                  + ", ".join(f"{name(lc)} {rates[lc]:.0f}" for lc in ranked[:5]),
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        geomean = {lc: math.exp(v) for lc, v in overall.items()}
        ranked = sorted(geomean, key=geomean.__getitem__, reverse=True)
        print(f"  geometric mean over the cases: default {geomean[DEFAULT_LAUNCH]:.0f}; best "
              + ", ".join(f"{name(lc)} {geomean[lc]:.0f}" for lc in ranked[:8]),
              flush=True)  # fmt: skip


def _dequantize_then_linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    return F.linear(x, q.dequantize(x.dtype))


def engine_decode(args: argparse.Namespace) -> None:
    """Decode tokens/s of the whole engine (small preset, bf16) at each batch size: the
    reference ops, Triton eager, Triton replayed from CUDA graphs, and that with int8
    weights (W8A16)."""
    from lamina.services.engine_worker.default_model import ensure_default_model
    from lamina.services.engine_worker.engine.config import EngineConfig
    from lamina.services.engine_worker.engine.engine import Engine
    from lamina.services.engine_worker.engine.params import SamplingParams

    model = ensure_default_model("small")
    setups = [
        ("reference", False, None),
        ("triton", False, None),
        ("triton", True, None),
        ("triton", True, "int8"),
    ]
    for batch in args.engine_batches:
        rates = {}
        for backend, graphs, quantization in setups:
            os.environ["LAMINA_KERNELS"] = backend
            engine = Engine(
                EngineConfig(
                    model=model,
                    device="cuda",
                    dtype="bfloat16",
                    max_model_len=2048,
                    max_num_seqs=max(args.engine_batches),
                    kv_cache_memory_bytes=4 << 30,
                    cuda_graphs=graphs,
                    quantization=quantization,
                )
            )
            for i in range(batch):
                engine.add_request(
                    f"r{i}",
                    list(range(3 + i, 3 + i + 128)),
                    SamplingParams(max_tokens=256, temperature=0, ignore_eos=True),
                )
            engine.step()  # prefill
            torch.cuda.synchronize()
            started, produced = time.perf_counter(), 0
            while engine.has_work():
                produced += len(engine.step().outputs)
            torch.cuda.synchronize()
            name = f"{backend}{' + graphs' if graphs else ''}"
            name += f" + {quantization} weights" if quantization else ""
            rates[name] = produced / (time.perf_counter() - started)
        base = rates["triton"]
        print(
            f"engine decode, batch {batch} (small preset, bf16): "
            + ", ".join(f"{k} {v:.0f} tok/s ({v / base:.2f}x)" for k, v in rates.items()),
            flush=True,
        )


def step_bytes(config: dict, context: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(weight bytes, K/V bytes) a batch-1 decode step reads at ``context`` tokens, from a
    Llama ``config.json``: every linear, norm and the LM head once (the embedding gives one
    row, which is left out), and the sequence's keys and values in every layer."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    weights = config["num_hidden_layers"] * layer + h + config["vocab_size"] * h
    kv_bytes = config["num_hidden_layers"] * 2 * kv * context * dtype_bytes
    return weights * dtype_bytes, kv_bytes


def engine_mbu(args: argparse.Namespace) -> None:
    """Model-bandwidth utilisation of batch-1 decode: the ``--mbu-preset`` model (default
    ``medium``, 0.7B parameters, made on the device) in bf16 with CUDA graphs, one
    ``--mbu-prompt``-token prompt decoding ``--mbu-tokens`` tokens; each step must read
    every weight once and the sequence's K/V, and MBU is those bytes over the step time
    against ``--peak-gbs``."""
    import json

    from lamina.services.engine_worker.default_model import ensure_default_model
    from lamina.services.engine_worker.engine.config import EngineConfig
    from lamina.services.engine_worker.engine.engine import Engine
    from lamina.services.engine_worker.engine.params import SamplingParams

    model = ensure_default_model(args.mbu_preset)
    config = json.loads((model / "config.json").read_text())
    os.environ["LAMINA_KERNELS"] = "triton"
    engine = Engine(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="bfloat16",
            max_model_len=args.mbu_prompt + args.mbu_tokens + 16,
            max_num_seqs=4,
            kv_cache_memory_bytes=4 << 30,
            cuda_graphs=True,
        )
    )
    prompt = [3 + i % 500 for i in range(args.mbu_prompt)]
    for run in range(args.runs + 1):  # the first warms up
        engine.add_request(
            f"m{run}",
            prompt,
            SamplingParams(max_tokens=args.mbu_tokens, temperature=0, ignore_eos=True),
        )
        engine.step()  # prefill and the first token
        torch.cuda.synchronize()
        started, steps = time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        step_s = (time.perf_counter() - started) / steps
        if run == 0:
            continue
        weights, kv = step_bytes(config, args.mbu_prompt + args.mbu_tokens // 2)
        gbs = (weights + kv) / step_s / 1e9
        print(
            f"batch-1 decode, {args.mbu_preset} ({weights / 2e9:.2f}B parameters read per "
            f"token, bf16, CUDA graphs): {step_s * 1e3:.3f} ms a step ({1 / step_s:.0f} tok/s), "
            f"{(weights + kv) / 1e6:.0f} MB a step ({kv / 1e6:.1f} MB of it K/V at the "
            f"mean context): {gbs:.0f} GB/s, MBU {100 * gbs / args.peak_gbs:.1f}% of "
            f"{args.peak_gbs:.0f} GB/s",
            flush=True,
        )


def _dims(text: str) -> tuple[int, ...]:
    """``"16x8192"`` -> ``(16, 8192)``."""
    return tuple(int(x) for x in text.split("x"))


def _stored_bytes(kernel) -> int:
    """The bytes of a ``TritonQuantLinear``'s weight as stored: codes, scales, zero points."""
    tensors = (kernel.weight, kernel.scale, kernel.zero)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbs", type=float, default=4800.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--linear-shapes",
        type=_dims,
        nargs="+",
        default=[(4096, 4096), (28672, 4096), (4096, 14336)],
        metavar="NxK",
        help="weight shapes (default: Llama-3-8B's attention output, fused gate/up, down)",
    )
    parser.add_argument("--linear-batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--linear-sweep-cases",
        type=_dims,
        nargs="+",
        default=[(1, 4096, 4096), (1, 4096, 14336), (16, 28672, 4096)],
        metavar="BATCHxNxK",
    )
    parser.add_argument(
        "--linear-formats", nargs="+", default=["int8", "int4"], choices=["int8", "fp8", "int4"]
    )
    parser.add_argument("--mbu-preset", default="medium")
    parser.add_argument("--mbu-prompt", type=int, default=128)
    parser.add_argument("--mbu-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3, help="mbu: timed runs")
    parser.add_argument("--engine-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["table", "linear", "engine"],
        choices=["table", "linear", "engine", "mbu", "sweep", "linear-sweep"],
        help="attention table, quantized linears, engine decode, batch-1 model-bandwidth "
        "utilisation (mbu), and/or a launch sweep of "
        "attention (every tile/warps/stages/split configuration on --sweep-cases, for each "
        "--kv-cache-dtypes) or of the quantized linears (--linear-sweep-cases, for each "
        "--linear-formats)",
    )
    parser.add_argument(
        "--sweep-cases",
        type=_dims,
        nargs="+",
        default=[(1, 32768), (16, 8192), (64, 8192), (64, 32768)],
        metavar="BATCHxCONTEXT",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto", "fp8", "int8"],
        choices=kv_quant.KV_CACHE_DTYPES,
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    print(f"device copy: {copy_bandwidth():.0f} GB/s (read + written)", flush=True)
    if "table" in args.parts:
        attention_table(args)
    if "linear" in args.parts:
        linear_table(args)
    if "engine" in args.parts:
        engine_decode(args)
    if "mbu" in args.parts:
        engine_mbu(args)
    if "sweep" in args.parts:
        for kind in args.kv_cache_dtypes:
            sweep(args, kind)
    if "linear-sweep" in args.parts:
        linear_sweep(args)


if __name__ == "__main__":
    main()
