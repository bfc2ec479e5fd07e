"""The KV cache's lower tiers (``kv_tier.py``): a prefix whose blocks were evicted from
the device pool to a tier, and loaded back, gives exactly what the same prefix kept on
the device gives: the same tokens and the same logprobs, bit for bit (the same KV bytes,
read by the same steps). In host memory, on disk (alone, and below a host tier that
passes blocks down to it), with int8 caches' per-block scales, and on two
tensor-parallel ranks (each moves its own share)."""

from __future__ import annotations

import pytest

from lamina.services.engine_worker.engine.kv_events import BlockRemoved, BlockStored
from lamina.services.engine_worker.engine.kv_tier import DISK
from lamina.services.engine_worker.engine.params import SamplingParams
from tests.engine.helpers import make_engine

PREFIX = list(range(5, 69))  # 4 blocks of 16
QUESTION = [*PREFIX, 100, 101, 102]
FILLERS = {f"f{n}": [200 + n, *range(300, 340)] for n in range(6)}  # 4 blocks each, unshared
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


def _run(engine, prompts: dict[str, list[int]], params: SamplingParams = PARAMS) -> dict:
    """Each request's (tokens, logprobs, cached tokens), the requests one after another."""
    got = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
        tokens, logprobs, cached = [], [], 0
        while engine.has_work():
            for out in engine.step().outputs:
                tokens += out.new_token_ids
                logprobs += out.new_logprobs or []
                cached = out.num_cached_tokens
        got[request_id] = (tokens, logprobs, cached)
    return got


def _engine(model, **config):
    # 12 blocks: the prefix's 4, then fillers that need them all back.
    settings = dict(num_kv_blocks=12, max_model_len=128, kv_offload_bytes=64 << 20)
    return make_engine(model, **(settings | config))


DISK_ONLY = {"kv_offload_bytes": 0, "kv_offload_disk_bytes": 64 << 20}


@pytest.mark.parametrize(
    "config",
    [
        {},
        DISK_ONLY,
        {"kv_cache_dtype": "int8"},
        {"kv_cache_dtype": "int8", **DISK_ONLY},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, **DISK_ONLY},
    ],
    ids=["host", "disk", "int8", "int8-disk", "tp2", "tp2-disk"],
)
def test_a_prefix_loaded_back_from_the_tier_gives_what_one_kept_on_the_device_gives(
    stories, tmp_path, config
):
    disk = bool(config.get("kv_offload_disk_bytes"))
    if disk:
        config = config | {"kv_offload_dir": str(tmp_path / "tier")}
    medium = "disk" if disk else "host"
    kept = _engine(stories, **config)  # (one parallel engine at a time per process)
    try:
        want = _run(kept, {"p": PREFIX, "q": QUESTION})["q"]
    finally:
        kept.close()
    assert want[2] == len(PREFIX)  # a device hit
    moved = _engine(stories, **config)
    try:
        _run(moved, {"p": PREFIX, **FILLERS})
        saves = getattr(moved.stats(), f"{medium}_kv_saves_total")
        assert saves >= 4  # the prefix's blocks went to the tier
        assert not any(moved.blocks.cached.get(h) is not None for h in _hashes(moved, PREFIX))
        got = _run(moved, {"q": QUESTION})["q"]
        assert getattr(moved.stats(), f"{medium}_kv_loads_total") == 4
    finally:
        moved.close()
    assert got == want  # tokens, logprobs (exactly) and the 64 cached tokens
    if disk:
        assert list((tmp_path / "tier").iterdir()) == []  # the file lives while mapped


def test_blocks_the_host_tier_passes_down_to_the_disk_tier_load_back_exactly(stories, tmp_path):
    # A host tier of 2 blocks over a disk tier: the prefix's blocks are saved to the host
    # tier, and the fillers' evicted blocks displace them down to the disk tier, where
    # the hit loads them from.
    config = dict(
        kv_offload_bytes=2 * _block_bytes(stories),
        kv_offload_disk_bytes=64 << 20,
        kv_offload_dir=str(tmp_path / "tier"),
    )
    kept = _engine(stories)
    try:
        want = _run(kept, {"p": PREFIX, "q": QUESTION})["q"]
    finally:
        kept.close()
    moved = _engine(stories, **config)
    try:
        _run(moved, {"p": PREFIX, **FILLERS})
        stats = moved.stats()
        assert stats.host_kv_blocks == 2 and stats.disk_kv_saves_total >= 4
        prefix = _hashes(moved, PREFIX)
        events = moved.take_kv_events()
        passed_down = {
            h
            for e in events
            if isinstance(e, BlockRemoved) and e.medium == "host"
            for h in e.block_hashes
        }
        assert len(passed_down & set(prefix)) >= 2  # not only saved to the disk tier direct
        assert [moved.blocks.holder(h).number for h in prefix] == [DISK] * 4
        got = _run(moved, {"q": QUESTION})["q"]
        stats = moved.stats()
        assert stats.disk_kv_loads_total == 4
        assert stats.disk_kv_load_blocks_per_s > 0  # timed on a CPU device
    finally:
        moved.close()
    assert got == want


def _hashes(engine, tokens: list[int]) -> list[int]:
    from lamina.services.engine_worker.engine.request import Request

    request = Request("h", tokens, SamplingParams(), max_tokens=1)
    request.update_block_hashes(engine.config.block_size)
    return request.block_hashes


def test_a_full_tier_drops_its_least_recently_used_blocks_and_says_so(stories):
    # Room for 2 blocks: of the prefix's 4, the last 2 evicted stay.
    engine = _engine(stories, kv_offload_bytes=2 * _block_bytes(stories))
    try:
        assert engine.stats().host_kv_blocks == 2
        _run(engine, {"p": PREFIX, **FILLERS})
        events = engine.take_kv_events()
        assert engine.stats().host_kv_blocks_used == 2
        host_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]
        host_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "host"]
        assert len(host_stored) - len(host_removed) == 2
        # The prefix's first blocks left the tier first: no hit from the start.
        assert _run(engine, {"q": QUESTION})["q"][2] == 0
    finally:
        engine.close()


def _block_bytes(model) -> int:
    from lamina.services.engine_worker.engine.runner import kv_block_bytes

    engine = make_engine(model, num_kv_blocks=4, max_model_len=64)
    return kv_block_bytes(engine.runner.model, engine.config.block_size)
