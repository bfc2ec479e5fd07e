"""A parallel engine's KV blocks, whole and in shares (``kv_shards.py``): split into
the ranks' shares (their stage's layers, their KV heads) and assembled again, blocks are
what they were; ranks that share a KV head hold the same copy of it."""

from __future__ import annotations

import pytest
import torch

from lamina.services.engine_worker.engine.kv_shards import Sharding, dump_share, load_share


def _whole(layers: int, heads: int, scales: bool) -> tuple[list, list]:
    caches = [torch.randn(2, 3, 16, heads, 8) for _ in range(layers)]
    per_block = [torch.rand(2, 3, heads) if scales else None for _ in range(layers)]
    return caches, per_block


@pytest.mark.parametrize(
    "tp,pp,heads", [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (4, 1, 2), (2, 3, 2)]
)
def test_shares_assemble_into_the_blocks_they_were_split_from(tp, pp, heads):
    sharding = Sharding(num_layers=5, num_kv_heads=heads, tp=tp, pp=pp)
    whole = _whole(5, heads, scales=True)
    shares = sharding.split(whole)
    assert len(shares) == tp * pp
    for rank, (caches, scales) in enumerate(shares):
        layers = sharding.layers(rank)
        assert len(caches) == len(layers) == len(scales)
        assert caches[0].shape[3] == max(1, heads // tp)  # its KV heads only
    back = sharding.assemble([load_share(dump_share(share)) for share in shares])
    for got, want in zip(back[0] + back[1], whole[0] + whole[1], strict=True):
        assert torch.equal(got, want)


def test_every_layer_and_head_has_exactly_one_owner_per_stage_and_tensor_rank():
    sharding = Sharding(num_layers=5, num_kv_heads=4, tp=2, pp=2)
    assert [sharding.layers(r) for r in range(4)] == [range(0, 3)] * 2 + [range(3, 5)] * 2
    assert [sharding.heads(r) for r in range(4)] == [slice(0, 2), slice(2, 4)] * 2
    replicated = Sharding(num_layers=2, num_kv_heads=2, tp=4)
    assert [replicated.heads(r) for r in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2


def test_caches_without_per_block_scales_carry_none():
    sharding = Sharding(num_layers=3, num_kv_heads=4, tp=2)
    whole = _whole(3, 4, scales=False)
    shares = sharding.split(whole)
    assert all(s is None for _, scales in shares for s in scales)
    caches, scales = sharding.assemble(shares)
    assert scales == [None] * 3 and all(
        torch.equal(a, b) for a, b in zip(caches, whole[0], strict=True)
    )
