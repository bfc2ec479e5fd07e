"""Decode attention on CPU: the native kernel (``kernels/cpu``) vs the torch reference
(gather the blocks into a padded tensor, then ``scaled_dot_product_attention``), on the
same paged cache in one run, across batch sizes and context lengths. Prints median
milliseconds of ``--runs`` repetitions per layer call, the native kernel's effective
bandwidth over the K/V bytes it reads, and the ratio. In bf16 on a CPU with AMX, also the
kernel with its tiles off (the fp32 path on the widened values) and what the tiles gain.

    .venv/bin/python benchmarks/cpu_attention.py    # the 'small' preset's heads: 8 / 2 x 64
    .venv/bin/python benchmarks/cpu_attention.py --dtype bfloat16   # a bf16 model's
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import median_ms

from lamina.kernels import cpu
from lamina.kernels import reference as ref
from lamina.kernels.reference import AttentionMetadata


def case(
    batch: int, context: int, args: argparse.Namespace
) -> tuple[float, float, float, float | None]:
    """(reference ms, native ms, K/V megabytes read, native ms without AMX tiles or None)
    for ``batch`` decodes at ``context``."""
    bs, hq, hkv, d = args.block_size, args.hq, args.hkv, args.head_dim
    per_seq = -(-(context + 1) // bs)
    num_blocks = batch * per_seq
    table = np.random.default_rng(0).permutation(num_blocks).reshape(batch, per_seq)
    slots = torch.from_numpy(table[:, context // bs] * bs + context % bs)
    dtype = getattr(torch, args.dtype)
    cache = torch.randn(2, num_blocks, bs, hkv, d).to(dtype)
    q = torch.randn(batch, hq + hkv, d).to(dtype)[:, :hq]  # strided, as the fused QKV makes it
    kv = torch.randn(batch, hkv, d).to(dtype)

    def meta(dense: bool) -> AttentionMetadata:
        return AttentionMetadata.build(
            [1] * batch, [context] * batch, table, batch, bs, slots, q.device,
            dense_decodes=dense,
        )  # fmt: skip

    dense, flat = meta(True), meta(False)
    scale = d**-0.5
    t_ref = median_ms(lambda: ref.paged_attention(q, kv, kv, cache, dense, scale), args.runs, 3)
    t_cpu = median_ms(lambda: cpu.paged_attention(q, kv, kv, cache, flat, scale), args.runs, 3)
    t_wide = None
    if dtype == torch.bfloat16 and cpu.attention.AMX:
        lens, blocks = flat.context_lens, flat.block_table
        wide = lambda: cpu.decode_attention(q, cache, blocks, lens, scale, tiles=False)  # noqa: E731
        t_wide = median_ms(wide, args.runs, 3)
    return t_ref, t_cpu, batch * (context + 1) * hkv * d * cache.element_size() * 2 / 1e6, t_wide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--hq", type=int, default=8)
    parser.add_argument("--hkv", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    cpu.load_library()  # compile outside the timing
    print(
        f"decode attention, {args.dtype}, {args.hq} query / {args.hkv} KV heads x {args.head_dim}, "
        f"block {args.block_size}, {torch.get_num_threads()} threads; median of {args.runs}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'reference ms':>12} {'native ms':>9} {'GB/s':>5} ratio"
        "  (no tiles ms, tiles' gain)"
    )
    for batch in args.batches:
        for context in args.contexts:
            t_ref, t_cpu, mb, t_wide = case(batch, context, args)
            tiles = "" if t_wide is None else f"  {t_wide:.3f} {t_wide / t_cpu:.2f}x"
            print(
                f"{batch:5d} {context:7d} {t_ref:12.3f} {t_cpu:9.3f} {mb / t_cpu:5.1f} "
                f"{t_ref / t_cpu:.2f}x{tiles}",
                flush=True,
            )


if __name__ == "__main__":
    main()
