"""Engine behaviour: cache, chunking and preemption leave outputs unchanged; requests are
validated; blocks all come back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lamina.services.engine_worker.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    TokenOutOfVocabError,
)
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.request import Status
from tests.engine.helpers import drain, greedy, make_engine, run_to_completion


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint("llama")


def prompts(n: int = 6, shared: int = 40, seed: int = 0) -> dict[str, list[int]]:
    """Prompts that share a ``shared``-token prefix, then differ, of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (shared,), generator=g).tolist()
    return {
        f"r{i}": prefix + torch.randint(3, 256, (3 + 7 * i,), generator=g).tolist()
        for i in range(n)
    }


def assert_all_blocks_released(engine) -> None:
    bm = engine.blocks
    assert bm.num_free_blocks == bm.num_blocks
    assert all(count == 0 for count in bm.ref_counts)
    assert not engine.requests and not engine.has_work()


def test_prefix_caching_and_chunked_prefill_do_not_change_outputs(model):
    reference = run_to_completion(
        make_engine(
            model,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            max_num_batched_tokens=256,
        ),
        prompts(),
        greedy(24),
    )
    for caching, chunk_budget in [(True, 256), (True, 24), (False, 7), (True, 7)]:
        engine = make_engine(
            model, enable_prefix_caching=caching, max_num_batched_tokens=chunk_budget
        )
        assert run_to_completion(engine, prompts(), greedy(24)) == reference
        assert_all_blocks_released(engine)


def test_prefix_cache_hits_are_counted_and_skip_compute(model):
    engine = make_engine(model)
    run_to_completion(engine, {"first": prompts()["r1"]}, greedy(4))
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == 50
    engine.add_request("second", prompts()["r2"], greedy(4))
    engine.step()
    assert engine.requests["second"].num_cached_tokens == 32  # two full shared blocks
    drain(engine)
    stats = engine.stats()
    assert stats.prefix_cache_hits == 32 and stats.prefix_cache_queries == 50 + 57
    assert stats.prompt_tokens_cached == 32
    assert 0 < stats.prefix_cache_hit_ratio < 1
    events = engine.take_kv_events()
    assert [e.event_id for e in events] == list(range(len(events)))


def test_preemption_by_recompute_gives_identical_outputs(model):
    reference = run_to_completion(make_engine(model), prompts(4, shared=0), greedy(40))
    # 12 blocks of 16 tokens cannot hold four ~80-token sequences at once.
    tight = make_engine(model, num_kv_blocks=12, max_model_len=128)
    for request_id, prompt in prompts(4, shared=0).items():
        tight.add_request(request_id, prompt, greedy(40))
    outputs = _all_outputs(tight)
    by_request: dict[str, list[int]] = {}
    for out in outputs:
        by_request.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert by_request == reference
    assert tight.stats().num_preemptions > 0
    # Each request reports its own preemptions when it finishes.
    finished = [out.timings for out in outputs if out.finished]
    assert sum(t.num_preemptions for t in finished) == tight.stats().num_preemptions
    assert_all_blocks_released(tight)


def test_preemption_picks_lowest_priority_then_latest_arrival(model):
    engine = make_engine(model, num_kv_blocks=8, max_model_len=128)
    for request_id, priority in [("low-early", 1), ("high", 0), ("low-late", 1)]:
        engine.add_request(request_id, list(range(3, 33)), greedy(60), priority=priority)
    preempted = []
    while engine.has_work():
        running = [r.request_id for r in engine.scheduler.running]
        engine.step()
        preempted += [
            rid
            for rid in running
            if rid in engine.requests and engine.requests[rid].status is Status.WAITING
        ]
    assert preempted, "the pool was sized to force a preemption"
    assert preempted[0] == "low-late"
    assert "high" not in preempted
    assert_all_blocks_released(engine)


def test_priorities_order_admission(model):
    engine = make_engine(model, max_num_seqs=1)
    engine.add_request("background", [5, 6, 7], greedy(2), priority=5)
    engine.add_request("urgent", [5, 6, 8], greedy(2), priority=0)
    first = engine.step().outputs
    assert [o.request_id for o in first] == ["urgent"]


def test_within_a_priority_the_earliest_deadline_is_admitted_first(model):
    engine = make_engine(model, max_num_seqs=1)
    engine.add_request("no-deadline", [5, 6, 7], greedy(2), priority=1)
    engine.add_request("later", [5, 6, 8], greedy(2), priority=1, deadline_ms=2_000)
    engine.add_request("sooner", [5, 6, 9], greedy(2), priority=1, deadline_ms=1_000)
    engine.add_request("urgent", [5, 6, 10], greedy(2), priority=0, deadline_ms=9_000)
    finished = [o.request_id for o in _all_outputs(engine) if o.finished]
    assert finished == ["urgent", "sooner", "later", "no-deadline"]


def test_abort_frees_everything_at_once(model):
    engine = make_engine(model, max_num_batched_tokens=16)
    engine.add_request("a", list(range(3, 60)), greedy(50))
    engine.add_request("b", list(range(3, 60)), greedy(50))
    engine.step()
    assert engine.stats().free_kv_blocks < engine.blocks.num_blocks
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    assert_all_blocks_released(engine)
    assert engine.step().outputs == []


def test_stop_tokens_min_tokens_and_max_tokens(model):
    engine = make_engine(model)
    free_run = run_to_completion(engine, {"x": [9, 10, 11]}, greedy(12))["x"]
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    out = run_to_completion(engine, {"y": [9, 10, 11]}, greedy(12, stop_token_ids=(stop_at,)))
    assert out["y"] == free_run[: first + 1]
    # min_tokens suppresses the stop token until it has been reached.
    out = run_to_completion(
        engine, {"z": [9, 10, 11]}, greedy(12, stop_token_ids=(stop_at,), min_tokens=first + 2)
    )
    assert len(out["z"]) > first + 1 and stop_at not in out["z"][: first + 2]
    engine.add_request("w", [9, 10, 11], greedy(3))
    finals = [o for o in _all_outputs(engine) if o.finished]
    assert finals[0].finish_reason == "length" and finals[0].num_output_tokens == 3


def test_eos_finishes_with_stop_unless_ignored(model):
    engine = make_engine(model)
    free_run = run_to_completion(engine, {"x": [9, 10, 11]}, greedy(12))["x"]
    # Any generated token can be declared an extra stop token; EOS is id 2 for this model.
    engine.add_request(
        "e",
        [9, 10, 11],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(free_run[0],)),
    )
    out = _all_outputs(engine)
    assert out[-1].finished and out[-1].finish_reason == "stop"
    assert engine.model_config.eos_token_ids == (2,)


def test_request_validation_errors_are_typed(model):
    engine = make_engine(model, max_model_len=64)
    with pytest.raises(EmptyPromptError):
        engine.add_request("a", [], greedy(1))
    with pytest.raises(TokenOutOfVocabError, match="256"):
        engine.add_request("a", [1, 256], greedy(1))
    with pytest.raises(TokenOutOfVocabError):
        engine.add_request("a", [-1], greedy(1))
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("a", list(range(3, 70)), greedy(1))
    with pytest.raises(PromptTooLongError):
        engine.add_request("a", [5] * 10, greedy(10_000_000))
    engine.add_request("a", [5] * 10, SamplingParams(max_tokens=None, temperature=0))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [5], greedy(1))
    assert engine.requests["a"].max_tokens == 54  # None: up to the context length
    # SamplingParams built in Python skipped the decoder's range checks: the engine makes them.
    for bad, field in [
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(seed=2**64 + 1), "seed"),
        (SamplingParams(top_k=2**63), "top_k"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("b", [5], bad)
        assert err.value.param == field
    with pytest.raises(TokenOutOfVocabError) as err:
        engine.add_request("b", [5], SamplingParams(stop_token_ids=[3, 5_000_000], min_tokens=2))
    assert err.value.param == "stop_token_ids" and "5000000" in err.value.message
    assert "b" not in engine.requests


def test_a_request_that_breaks_the_sampler_fails_alone(model):
    """Its batch mates go on to finish; it ends with an error and frees its blocks."""
    engine = make_engine(model)
    engine.add_request(
        "bad", [5, 6, 7], SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True)
    )
    engine.add_request("good", [5, 6, 8], greedy(8))
    engine.requests["bad"].params.stop_token_ids = [5_000_000]  # past every check
    free = engine.blocks.num_free_blocks
    outputs = [out for _ in range(50) if engine.has_work() for out in engine.step().outputs]
    (failed,) = [o for o in outputs if o.request_id == "bad"]
    assert failed.finished and failed.error and "sampling failed" in failed.error
    assert failed.new_token_ids == [] and failed.finish_reason is None
    good = [o for o in outputs if o.request_id == "good"]
    assert sum(len(o.new_token_ids) for o in good) == 8 and good[-1].finish_reason == "length"
    assert not engine.has_work() and engine.blocks.num_free_blocks >= free


def test_runs_to_the_context_limit(model):
    engine = make_engine(model, max_model_len=40)
    engine.add_request(
        "a", list(range(3, 33)), SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    )
    outputs = _all_outputs(engine)
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 10


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(model):
    params = SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True
    )
    alone = run_to_completion(make_engine(model), {"s": [7, 8, 9]}, params)["s"]
    batch = make_engine(model, seed=123)
    mates = SamplingParams(max_tokens=20, temperature=1.2, ignore_eos=True)
    for n in range(4):
        batch.add_request(f"mate{n}", [7, 8, 9 + n], mates)
    batch.add_request("s", [7, 8, 9], params)
    assert drain(batch)["s"] == alone
    other_seed = run_to_completion(
        make_engine(model), {"s": [7, 8, 9]}, SamplingParams(max_tokens=16, seed=7, ignore_eos=True)
    )["s"]
    assert other_seed != alone


def test_logprobs_are_returned_with_top_alternatives(model):
    engine = make_engine(model)
    engine.add_request("a", [5, 6, 7], greedy(3, logprobs=4))
    outputs = _all_outputs(engine)
    for out in outputs:
        ((sampled_lp, top),) = out.new_logprobs
        assert len(top) == 4
        assert top[0][0] == out.new_token_ids[0]  # greedy: the sampled token is the top one
        assert sampled_lp == pytest.approx(top[0][1]) and sampled_lp <= 0
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_stats_report_load(model):
    engine = make_engine(model, max_num_batched_tokens=32)
    engine.add_request("a", list(range(3, 103)), greedy(4))
    engine.add_request("b", list(range(3, 53)), greedy(4))
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running) == (2, 0)
    assert stats.num_queued_prefill_tokens == 150
    engine.step()  # 32 tokens of "a"
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running) == (1, 1)
    assert stats.num_queued_prefill_tokens == 150 - 32
    assert stats.kv_cache_usage == pytest.approx(2 / 128)  # blocks for a's first 32
    outputs = [engine.step().outputs] + [
        engine.step().outputs for _ in range(100) if engine.has_work()
    ]
    stats = engine.stats()
    assert stats.prompt_tokens_total == 150 and stats.generation_tokens_total == 8
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    # Every step, by the tokens it computed: the prompts' uncached tokens (b's first 48
    # are a's) and the decodes (the first token of each comes with its prefill).
    assert stats.prompt_tokens_cached == 48
    assert sum(stats.iteration_tokens) == 1 + len(outputs)
    assert stats.iteration_tokens_sum == 150 - 48 + 2 * 3
    assert stats.iteration_tokens[3] == 3  # a's three full steps of 32 (16 < n <= 32)


def test_only_a_step_with_a_real_prefill_measures_the_prefill_rate(model):
    # A cache hit's two-token tail measures the step's fixed cost: were it a prefill
    # rate, the scheduler would think this worker far slower than it is.
    engine = make_engine(model)
    run_to_completion(engine, {"short": list(range(3, 13))}, greedy(4))
    stats = engine.stats()
    assert stats.prefill_tokens_per_s == 0 and stats.decode_tokens_per_s > 0
    prompt = list(range(3, 131))
    run_to_completion(engine, {"long": prompt}, greedy(4))
    measured = engine.stats().prefill_tokens_per_s
    assert measured > 0
    run_to_completion(engine, {"tail": [*prompt, 7, 8]}, greedy(4))
    assert engine.requests == {} and engine.stats().prefill_tokens_per_s == measured


def test_finished_requests_report_their_phases(model):
    engine = make_engine(model, max_num_batched_tokens=32)
    engine.add_request("a", list(range(3, 103)), greedy(4))  # four steps of prefill
    engine.add_request("b", list(range(3, 13)), greedy(4))  # waits for a's first step
    timings = {out.request_id: out.timings for out in _all_outputs(engine) if out.finished}
    a, b = timings["a"], timings["b"]
    assert a.num_preemptions == b.num_preemptions == 0
    assert b.queued_s > a.queued_s >= 0
    assert a.prefill_s > 0 and a.decode_s > 0 and b.decode_s > 0


def _all_outputs(engine):
    outputs = []
    while engine.has_work():
        outputs += engine.step().outputs
    return outputs


MOVES = {
    "frequency_penalty": dict(temperature=0.0, frequency_penalty=1.5),
    "presence_penalty": dict(temperature=0.0, presence_penalty=1.5),
    "repetition_penalty": dict(temperature=0.0, repetition_penalty=1.8),
    "min_tokens": dict(temperature=0.0, min_tokens=10, ignore_eos=False),
    "seeded": dict(temperature=1.0, seed=7),
    "all": dict(temperature=0.9, seed=3, frequency_penalty=0.7, presence_penalty=0.4),
}


@pytest.mark.parametrize("name", sorted(MOVES))
def test_a_moved_request_continues_exactly_as_if_it_had_not(model, name):
    """A request resumed after ``done`` tokens (the prompt plus its replayed output, the
    gateway's move) produces the rest as the undisturbed run did, when the engine is told
    which prompt tokens are replayed output; told nothing, penalties and seeds drift."""
    total, done, prompt = 16, 6, list(range(30, 45))
    params = SamplingParams(max_tokens=total, **({"ignore_eos": True} | MOVES[name]))
    (whole,) = run_to_completion(make_engine(model), {"r": prompt}, params).values()
    rest = dataclasses.replace(
        params, max_tokens=total - done, min_tokens=max(0, params.min_tokens - done)
    )
    outputs = {}
    for replayed in (done, 0):
        engine = make_engine(model)
        engine.add_request("r", prompt + whole[:done], rest, replayed=replayed)
        outputs[replayed] = drain(engine)["r"]
    assert outputs[done] == whole[done:]
    if name not in ("min_tokens", "repetition_penalty"):  # these look at prompt and output
        assert outputs[0] != whole[done:], "the test cannot tell a drifting move"


def test_replayed_output_must_leave_a_prompt(model):
    engine = make_engine(model)
    with pytest.raises(InvalidRequestError, match="replayed"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), replayed=3)


def test_the_same_prompt_sent_together_is_computed_once(model):
    """``n > 1`` (or the same long prompt twice at once): the second waits a step for the
    first's blocks, then reads them from the prefix cache; only its last, partial block is
    its own. Their outputs are what each gets alone."""
    engine = make_engine(model)
    prompt = prompts(1, shared=40)["r0"]  # 43 tokens: two full blocks and a partial one
    alone = run_to_completion(make_engine(model), {"x": prompt}, greedy(5))["x"]
    computed = []
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt, greedy(5))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        step = engine.step()
        for out in step.outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        computed.append(sum(step.batch.num_new_tokens))
    assert outputs == {"a": alone, "b": alone, "c": alone}
    # One prefill of 43 tokens, then two of 11 (the partial block's), then decodes.
    assert computed[:2] == [43, 2 * 11 + 1]
    assert engine.stats().prompt_tokens_cached == 2 * 32
    assert_all_blocks_released(engine)
