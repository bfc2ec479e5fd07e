"""How a worker computes, as the cluster sees it: its numerics (what a moved stream must
find again to continue exactly) and the precisions ``/v1/models`` lists."""

from __future__ import annotations

from lamina.services.gateway.intake import precisions
from tests.telemetry.helpers import make_stats as stats


def test_numerics_name_the_device_type_and_every_dtype():
    worker = stats(
        "a", device="cuda:3", dtype="bfloat16", weight_dtype="fp8", kv_cache_dtype="int8"
    )
    assert worker.numerics() == "cuda/bfloat16/fp8/int8"
    assert stats("b", device="cuda:0", dtype="bfloat16", weight_dtype="fp8",
                 kv_cache_dtype="int8").numerics() == worker.numerics()  # fmt: skip
    # Two ranks sum each row-parallel product in halves: not the same rounding as one.
    group = stats("c", device="cuda:0", dtype="bfloat16", weight_dtype="fp8",
                  kv_cache_dtype="int8", tensor_parallel_size=2)  # fmt: skip
    assert group.numerics() == "cuda/bfloat16/fp8/int8/tp2"


def test_the_gateway_lists_each_way_its_models_workers_compute():
    """``/v1/models``' ``precisions``: one entry per distinct weight / activation / KV
    cache dtype (``auto`` as the dtype it means) and tensor-parallel size, most workers
    first; a worker still loading (no dtypes yet) is left out."""
    fp32 = dict(dtype="float32", weight_dtype="float32", kv_cache_dtype="auto")
    workers = [
        stats("a", **fp32),
        stats("b", **(fp32 | {"weight_dtype": "int8"})),
        stats("c", **(fp32 | {"weight_dtype": "int8"})),
        stats("d", **(fp32 | {"weight_dtype": "int8", "kv_cache_dtype": "fp8"})),
        stats("e"),
        stats("f", **fp32, tensor_parallel_size=2),
    ]
    fp32_cache = {
        "dtype": "float32",
        "kv_cache_dtype": "float32",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
    }
    assert precisions(workers) == [
        {"weight_dtype": "int8", **fp32_cache, "workers": 2},
        {"weight_dtype": "float32", **fp32_cache, "workers": 1},
        {"weight_dtype": "float32", **fp32_cache, "tensor_parallel_size": 2, "workers": 1},
        {"weight_dtype": "int8", **(fp32_cache | {"kv_cache_dtype": "fp8"}), "workers": 1},
    ]
