"""KV blocks out of one engine and into another (``Engine.export_blocks``,
``import_blocks``): what transfer between workers moves. The importer, given the
sender's blocks of a prefix, serves a request with that prefix as a hit and gives
exactly the sender's tokens and logprobs (the same KV bytes, read by the same steps); a
cache laid out otherwise is refused, typed."""

from __future__ import annotations

import pytest

from lamina.services.engine_worker.engine.errors import EngineError, KvLayoutMismatch
from tests.engine.helpers import make_engine
from tests.engine.test_kv_tier import PREFIX, QUESTION, _hashes, _run


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


def test_blocks_of_another_layout_are_refused_and_a_parallel_engine_says_it_cannot(stories):
    blocks = make_engine(stories, num_kv_blocks=16).export_blocks(_hashes_of(stories))
    other = make_engine(stories, num_kv_blocks=16, kv_cache_dtype="int8")
    with pytest.raises(KvLayoutMismatch, match="16/float32/5/4/8"):
        other.import_blocks(blocks)
    assert other.take_kv_events() == []  # nothing changed
    two = make_engine(stories, num_kv_blocks=16, tensor_parallel_size=2)
    try:
        with pytest.raises(EngineError, match="not built for a parallel engine"):
            two.export_blocks([])
    finally:
        two.close()


def _hashes_of(model) -> list[int]:
    return _hashes(make_engine(model, num_kv_blocks=16), PREFIX)
