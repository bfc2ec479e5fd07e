"""KV blocks out of one engine and into another (``Engine.export_blocks``,
``import_blocks``): what transfer between workers moves. The importer, given the
sender's blocks of a prefix, serves a request with that prefix as a hit and gives
exactly the sender's tokens and logprobs (the same KV bytes, read by the same steps); a
cache laid out otherwise is refused, typed. A parallel engine's blocks leave it whole
(every rank's share: its layers, its KV heads) and come back split, exactly; they move
between engines split differently."""

from __future__ import annotations

import pytest
import torch

from lamina.services.engine_worker.engine.errors import KvLayoutMismatch
from lamina.services.engine_worker.engine.kv_tier import HOST
from tests.engine.helpers import make_engine
from tests.engine.test_kv_tier import FILLERS, PREFIX, QUESTION, _engine, _hashes, _run


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_imported_blocks_give_the_senders_tokens_and_logprobs(stories, kv_cache_dtype):
    sender = make_engine(stories, num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    want = _run(sender, {"p": PREFIX, "q": QUESTION})["q"]
    assert want[2] == len(PREFIX)  # the sender's own device hit
    blocks = sender.export_blocks(_hashes(sender, QUESTION))
    assert len(blocks.hashes) == 4  # the prompt's full blocks it holds: the prefix's

    receiver = make_engine(stories, num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    assert receiver.import_blocks(blocks) == 4
    stored = receiver.take_kv_events()
    assert [h for e in stored for h in e.block_hashes] == blocks.hashes
    assert receiver.import_blocks(blocks) == 0  # already cached
    assert _run(receiver, {"q": QUESTION})["q"] == want


def test_blocks_of_another_layout_are_refused(stories):
    blocks = make_engine(stories, num_kv_blocks=16).export_blocks(_hashes_of(stories))
    other = make_engine(stories, num_kv_blocks=16, kv_cache_dtype="int8")
    with pytest.raises(KvLayoutMismatch, match="16/float32/5/4/8"):
        other.import_blocks(blocks)
    assert other.take_kv_events() == []  # nothing changed


def _hashes_of(model) -> list[int]:
    return _hashes(make_engine(model, num_kv_blocks=16), PREFIX)


@pytest.mark.parametrize(
    "config",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "kv_cache_dtype": "int8"},
    ],
    ids=["tp2", "pp2", "tp2-pp2-int8"],
)
def test_a_parallel_engines_blocks_leave_whole_and_come_back_exactly(stories, config):
    engine = _engine(stories, **config)  # with a host tier, on every rank
    try:
        want = _run(engine, {"p": PREFIX, "q": QUESTION})["q"]
        hashes = _hashes(engine, QUESTION)
        whole = engine.export_blocks(hashes)
        dtype = "int8" if config.get("kv_cache_dtype") else "float32"
        assert whole.layout == f"16/{dtype}/5/4/8"  # every layer and KV head
        assert [c.shape for c in whole.caches] == [(2, 4, 16, 4, 8)] * 5
        # Evicted to the tier on every rank, the blocks read back the same from there.
        _run(engine, FILLERS)
        assert [engine.blocks.holder(h).number for h in hashes[:4]] == [HOST] * 4
        again = engine.export_blocks(hashes)
        for ours, theirs in zip(
            again.caches + again.scales, whole.caches + whole.scales, strict=True
        ):
            assert (ours is None and theirs is None) or torch.equal(ours, theirs)
        engine.reset_prefix_cache()
        assert engine.import_blocks(whole) == 4  # split across the ranks again
        got = _run(engine, {"q": QUESTION})["q"]
    finally:
        engine.close()
    assert got == want  # tokens, logprobs (exactly) and the 64 cached tokens


def test_blocks_move_between_an_engine_and_a_tensor_parallel_one(stories):
    single = make_engine(stories, num_kv_blocks=16)
    want = _run(single, {"p": PREFIX, "q": QUESTION})["q"]
    hashes = _hashes(single, QUESTION)
    blocks = single.export_blocks(hashes)
    two = make_engine(stories, num_kv_blocks=16, tensor_parallel_size=2)
    try:
        _run(two, {"p": PREFIX})
        theirs = two.export_blocks(hashes)
        assert theirs.layout == blocks.layout
        for a, b in zip(theirs.caches, blocks.caches, strict=True):
            torch.testing.assert_close(a, b)  # the same KV, up to the split's rounding
        two.reset_prefix_cache()
        assert two.import_blocks(blocks) == 4
        got = _run(two, {"q": QUESTION})["q"]
    finally:
        two.close()
    assert (got[0], got[2]) == (want[0], len(PREFIX))  # the same tokens, from the hit
    receiver = make_engine(stories, num_kv_blocks=16)
    assert receiver.import_blocks(theirs) == 4
    assert _run(receiver, {"q": QUESTION})["q"][0] == want[0]
