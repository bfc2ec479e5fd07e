"""Pipeline parallelism: the layers split into stages, each stage its own process(es),
against one process on the same weights.

A stage runs the same operations on the same numbers as one process would (hidden states
and residuals pass between stages whole), so logits agree within 1e-5: only the path a
step takes may differ (one process decodes with its native step where the stages run the
Python forward). Greedy tokens are equal.
"""

from __future__ import annotations

import pytest
import torch

from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.parallel import stage_layers
from tests.engine.helpers import greedy, make_engine, run_to_completion, teacher_forced_logits
from tests.engine.test_tensor_parallel import GREEDY, PROMPTS, SEQS


def test_stages_take_contiguous_layers_the_first_ones_one_more_when_uneven():
    assert stage_layers(10, 2) == [range(0, 5), range(5, 10)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 1) == [range(0, 4)]
    with pytest.raises(ModelLoadError, match="3 layers cannot fill 4 pipeline stages"):
        stage_layers(3, 4)


def _compare(path, **config) -> None:
    one = make_engine(path, max_num_batched_tokens=32)
    want = run_to_completion(one, GREEDY, greedy(12))
    want_logits = teacher_forced_logits(one, SEQS, PROMPTS)
    staged = make_engine(path, max_num_batched_tokens=32, **config)
    try:
        got = run_to_completion(staged, GREEDY, greedy(12))
        got_logits = teacher_forced_logits(staged, SEQS, PROMPTS)
        ranks = staged.spec.ranks
    finally:
        staged.close()
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    size = config.get("pipeline_parallel_size", 1)
    assert sorted({rank.stage for rank in ranks}) == list(range(size))


def test_two_stages_generate_what_one_process_does_on_a_trained_model(stories):
    _compare(stories, pipeline_parallel_size=2)  # 5 layers: 3 and 2


def test_two_stages_generate_what_one_process_does_on_the_small_preset(small):
    _compare(small, pipeline_parallel_size=2)


def test_two_stages_of_two_ranks_each(stories):
    _compare(stories, pipeline_parallel_size=2, tensor_parallel_size=2)


def test_a_stage_holds_only_its_layers(stories):
    one = make_engine(stories)
    staged = make_engine(stories, pipeline_parallel_size=2)
    try:
        (whole,) = one.spec.ranks
        first, last = staged.spec.ranks
        # Stage 0: the embedding and 3 of 5 layers; stage 1: 2 layers, the final norm and
        # the (tied) LM head, which is the embedding again.
        assert first.weight_bytes < whole.weight_bytes and last.weight_bytes < whole.weight_bytes
        assert first.kv_bytes * 5 == whole.kv_bytes * 3  # its 3 layers of 5, as many blocks
        assert last.kv_bytes * 5 == whole.kv_bytes * 2
    finally:
        staged.close()


def test_two_stages_keep_two_batches_in_flight_and_drop_one_aborted_meanwhile(stories):
    """Each batch takes half the requests, so stage 0 runs one while stage 1 runs the
    other; the tokens are one process's. A request aborted while its batch is in flight
    yields nothing more, and the others are unaffected."""
    prompts = {f"r{n}": list(range(5 + n, 25 + n)) for n in range(4)}
    want = run_to_completion(make_engine(stories), prompts, greedy(10))
    engine = make_engine(stories, pipeline_parallel_size=2)
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, greedy(10))
        got: dict[str, list[int]] = {}
        overlapped, aborted = 0, None
        while engine.has_work():
            result = engine.step()
            for out in result.outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            # A batch completed while the next one was already in flight.
            overlapped += bool(result.outputs) and len(engine._in_flight) == 1
            if aborted is None and len(engine._in_flight) == 1 and len(got) == 4:
                aborted = engine._in_flight[0].batch.requests[0].request_id
                assert engine.abort(aborted)
                cut = len(got[aborted])
    finally:
        engine.close()
    assert overlapped >= 10 and aborted is not None
    assert got[aborted] == want[aborted][:cut]
    for rid in prompts.keys() - {aborted}:
        assert got[rid] == want[rid]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from lamina.services.engine_worker.default_model import ensure_default_model

    return ensure_default_model("small", tmp_path_factory.mktemp("small") / "lamina-small")
