"""Engine configuration: validation that quotes the bad value, and the KV budget."""

from __future__ import annotations

import pytest
import torch

from lamina.services.engine_worker.engine.config import EngineConfig


def test_kv_budget_defaults_and_overrides():
    cpu = torch.device("cpu")
    assert EngineConfig(model="m").kv_budget_bytes(cpu) == 256 << 20
    assert EngineConfig(model="m", kv_cache_memory_bytes=1 << 20).kv_budget_bytes(cpu) == 1 << 20


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 0),
        ("max_num_seqs", -1),
        ("gpu_memory_utilization", 1.5),
        ("dtype", "float8"),
        ("num_kv_blocks", 0),
        ("kv_offload_disk_bytes", -4096),
    ],
)
def test_bad_values_are_quoted(field, value):
    with pytest.raises(ValueError, match=str(value)):
        EngineConfig(model="m", **{field: value})


@pytest.mark.parametrize(
    "tier", [{"kv_offload_disk_bytes": 1 << 20}, {"kv_offload_dir": "/var/tmp/kv"}]
)
def test_the_disk_tier_needs_both_its_size_and_its_directory(tier):
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model="m", **tier)
    both = {"kv_offload_disk_bytes": 1 << 20, "kv_offload_dir": "/var/tmp/kv"}
    assert EngineConfig(model="m", **both).kv_offload_disk_bytes == 1 << 20
