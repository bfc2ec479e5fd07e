"""GPU kernel benchmark: decode paged attention, Triton vs the torch reference (gather +
``scaled_dot_product_attention``), as achieved memory bandwidth and a fraction of the
device's peak, for bf16 and quantized (fp8, int8) caches; then the engine's end-to-end
decode tokens/s with each backend, and with CUDA graphs on and off.

Needs a CUDA device. Not yet run on one: see docs/performance.md.

    .venv/bin/python benchmarks/kernels.py --peak-gbs 4800    # H200 HBM3e: ~4.8 TB/s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from lamina.kernels import reference as ref
from lamina.kernels.reference import AttentionMetadata, kv_quant


def time_cuda(fn, iters: int = 20) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
        f"{'torch GB/s':>11} {'speed-up':>8}"
    )
    for kind in args.kv_cache_dtypes:
        for batch in args.batches:
            for context in args.contexts:
                t_tri, t_ref, nbytes = measure(batch, context, kind, args)
                gbs, ref_gbs = nbytes / t_tri / 1e9, nbytes / t_ref / 1e9
                print(
                    f"{kind:>5} {batch:>5} {context:>7} {gbs:>12.0f} "
                    f"{100 * gbs / args.peak_gbs:>6.1f}% {ref_gbs:>11.0f} {t_ref / t_tri:>7.2f}x",
                    flush=True,
                )
                torch.cuda.empty_cache()


def measure(
    batch: int, context: int, kind: str, args: argparse.Namespace
) -> tuple[float, float, int]:
    """(Triton seconds, reference seconds, bytes of K/V read) for one decode batch."""
    from lamina.kernels import triton as tri

    q, k, cache, scales, meta, nbytes = decode_case(
        batch, context, args.hq, args.hkv, args.head_dim, args.block_size, torch.bfloat16, kind
    )
    scale = args.head_dim**-0.5
    t_tri = time_cuda(lambda: tri.paged_attention(q, k, k, cache, meta, scale, scales))
    t_ref = time_cuda(lambda: ref.paged_attention(q, k, k, cache, meta, scale, scales))
    return t_tri, t_ref, nbytes


def engine_decode(args: argparse.Namespace) -> None:
    """Decode tokens/s of the whole engine (small preset, bf16) at each batch size: the
    reference ops, Triton eager, and Triton replayed from CUDA graphs."""
    from lamina.services.engine_worker.config import EngineConfig
    from lamina.services.engine_worker.default_model import ensure_default_model
    from lamina.services.engine_worker.engine import Engine
    from lamina.services.engine_worker.request import SamplingParams

    model = ensure_default_model("small")
    setups = [("reference", False), ("triton", False), ("triton", True)]
    for batch in args.engine_batches:
        rates = {}
        for backend, graphs in setups:
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
                produced += len(engine.step())
            torch.cuda.synchronize()
            name = f"{backend}{' + graphs' if graphs else ''}"
            rates[name] = produced / (time.perf_counter() - started)
        base = rates["triton"]
        print(
            f"engine decode, batch {batch} (small preset, bf16): "
            + ", ".join(f"{k} {v:.0f} tok/s ({v / base:.2f}x)" for k, v in rates.items()),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbs", type=float, default=4800.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--engine-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto", "fp8", "int8"],
        choices=kv_quant.KV_CACHE_DTYPES,
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    attention_table(args)
    engine_decode(args)


if __name__ == "__main__":
    main()
