"""Compile every Triton kernel for the H100/H200 (sm_90) down to a cubin, without a GPU:
Triton's NVIDIA backend (with its bundled ptxas) runs on any x86 machine.

Run as a script (``python -m tests.kernel.sm90_compile``) in a process *without*
``TRITON_INTERPRET``: under the interpreter ``@triton.jit`` yields interpreted functions,
which cannot be compiled. Prints ``ok <case>`` per case; exits non-zero on the first that
fails. Signatures are those the engine launches with on bf16 models, for each KV cache
dtype."""

from __future__ import annotations

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lamina.kernels.triton import activation, attention, lora, norm, rotary
from lamina.kernels.triton import quant_linear as ql

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232448
"""The most shared memory one program may use on an H100/H200 (227 KiB)."""
FLOAT_ARGS = {"scale", "eps"}
CACHE = {0: "bf16", 1: "fp8e4nv", 2: "i8"}  # by the kernels' QUANT switch
KIND = {0: None, 1: "fp8", 2: "int8"}
INDEX = {"block_table_ptr", "query_start_ptr", "context_len_ptr", "slots_ptr", "writes_ptr"}
PARTIALS = {"part_out_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32"}


def compile_sm90(
    kernel, constexprs: dict, pointers: dict[str, str] | None = None, options: dict | None = None
) -> None:
    """Compile ``kernel`` for sm_90: pointers are bf16 unless named in ``pointers`` (index
    arrays int64), scalars int32 (``scale``/``eps`` fp32); ``options`` such as
    ``num_warps``."""
    pointers = pointers or {}
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "i64" if name in INDEX else "bf16")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=SM90, options=options or {}
    )
    assert compiled.asm["cubin"], kernel
    # A launch over the multiprocessor's shared memory compiles, then fails to launch.
    shared = compiled.metadata.shared
    assert shared <= SM90_SHARED_BYTES, f"{kernel.__name__} needs {shared} B of shared memory"


def cases():
    """(name, kernel, constexprs, pointer types[, compile options]) for every kernel and
    configuration; attention with the default launch of each cache kind (and head
    dimensions from 128 down to the stories260K fixture's 8)."""
    for residual in (False, True):
        yield (
            f"rms_norm residual={residual}",
            norm._rms_norm_kernel,
            {
                "HAS_RESIDUAL": residual,
                "BLOCK": 4096,
            },
            {},
        )
    yield "rotary", rotary._rotary_kernel, {"BLOCK": 64}, {}
    yield "silu_and_mul", activation._silu_and_mul_kernel, {"BLOCK": 1024}, {}
    for quant, cache_type in CACHE.items():
        cache = {"cache_ptr": cache_type, "scales_ptr": "fp32"}
        if quant == 2:
            shape = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "D_PAD": 128, "BLOCK_SIZE": 16}
            yield "write_kv int8", attention._write_kv_int8_kernel, shape, cache
        else:
            flags = {"BLOCK_D": 128, "FP8": quant == 1}
            yield f"write_kv {cache_type}", attention._write_kv_kernel, flags, cache
        launch = attention.default_launch(KIND[quant])
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        shapes = ((4, 128, False), (8, 80, False), (7, 64, False), (2, 8, False))
        if quant:  # and the dots in fp16 (Launch.fp16_dot)
            shapes += ((4, 128, True),)
        for group, head_dim, fp16_dot in shapes:
            d_pad = attention.dot_width(head_dim)
            shape = {"NUM_KV_HEADS": 8, "GROUP": group, "HEAD_DIM": head_dim, "D_PAD": d_pad}
            shape |= {"BLOCK_SIZE": 16, "TILE": launch.tile, "QUANT": quant}
            shape |= {"FP16_DOT": fp16_dot}
            tag = f"{cache_type} group={group} head_dim={head_dim} fp16_dot={fp16_dot}"
            yield (
                f"paged_attention {tag}",
                attention._paged_attention_kernel,
                shape | {"BLOCK_Q": 16 // group, "ROWS": 16},
                cache,
                options,
            )
            yield (
                f"decode_split {tag}",
                attention._decode_split_kernel,
                shape | {"G_PAD": 16},
                cache | PARTIALS,
                options,
            )
    reduce = {"NUM_HEADS": 32, "HEAD_DIM": 128, "D_PAD": 128, "S_PAD": 16}
    yield "decode_reduce", attention._decode_reduce_kernel, reduce, PARTIALS
    launch = ql.DEFAULT_LAUNCH
    blocks = {"BLOCK_M": ql.BLOCK_M, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k}
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    for fmt, code in ql.FORMATS.items():
        weights = {"w_ptr": "i8" if fmt == "int8" else "u8", "scale_ptr": "fp32"}
        weights["zero_ptr"] = "fp32"
        for split, one_group in itertools.product((False, True), (False, True)):
            if one_group and fmt != "int4":
                continue
            yield (
                f"quant_linear {fmt} split={split} one_group={one_group}",
                ql._quant_linear_kernel,
                blocks | {"FORMAT": code, "HAS_BIAS": True, "SPLIT": split, "ONE_GROUP": one_group},
                weights | ({"out_ptr": "fp32"} if split else {}),
                options,
            )
    lora_pointers = {"slots_ptr": "i64", "v_ptr": "fp32"}
    yield (
        "lora_shrink",
        lora._lora_shrink_kernel,
        {"BLOCK_W": 64, "BLOCK_K": lora.BLOCK_K},
        lora_pointers,
    )
    yield (
        "lora_expand",
        lora._lora_expand_kernel,
        {"BLOCK_N": lora.BLOCK_N, "BLOCK_W": 64},
        lora_pointers,
    )
    yield (
        "quant_linear split sum",
        ql._split_sum_kernel,
        {"SCALED": True, "HAS_BIAS": True, "BLOCK": ql.SUM_BLOCK},
        {"partial_ptr": "fp32", "scale_ptr": "fp32"},
    )


def main() -> None:
    for name, kernel, constexprs, pointers, *options in cases():
        compile_sm90(kernel, constexprs, pointers, *options)
        print("ok", name, flush=True)


if __name__ == "__main__":
    main()
