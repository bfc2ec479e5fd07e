"""Speculative decoding in the engine on a trained checkpoint (``stories260K``): greedy
output is token for token what the engine makes without it, whatever the batch around
it (prompt chunks, drafts cut by the step's budget, requests arriving mid-run); the KV
of rejected draft tokens is given back, and what was accepted is cached as if decoded."""

from __future__ import annotations

import pytest

from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig
from tests.engine.helpers import drain, greedy, make_engine, run_to_completion

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
PROMPTS = {
    "a": [1, 400, 261, 403],
    "b": [1, 306, 323, 283, 272, 260, 389],
    "c": [1, 73, 87, 316],
    "long": list(range(1, 120)),  # prefilled in chunks while the others draft
}


def engine(stories, speculative=NGRAM, **overrides):
    config = dict(max_num_batched_tokens=24, max_model_len=512, speculative_config=speculative)
    return make_engine(stories, **(config | overrides))


def staggered(engine, params: SamplingParams) -> dict[str, list[int]]:
    """``PROMPTS`` added a few steps apart (the later ones prefill beside drafts); each
    step checks that every running request's KV is its tokens', no more."""
    outputs: dict[str, list[int]] = {}
    pending = list(PROMPTS.items())
    for step in range(10_000):
        if pending and step % 5 == 0:
            engine.add_request(*pending.pop(0), params)
        if not engine.has_work() and not pending:
            break
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        for request in engine.scheduler.running:
            assert not request.draft
            if request.num_computed_tokens >= request.num_prompt_tokens:
                assert request.num_computed_tokens == request.num_tokens - 1
            table = engine.blocks.block_table(request)
            assert len(table) <= engine.blocks.blocks_needed(request.num_tokens)
    assert not any(engine.blocks.ref_counts), "every block is released at the end"
    return outputs


def test_greedy_output_is_the_same_token_for_token(stories):
    want = staggered(engine(stories, None), greedy(150))
    speculating = engine(stories)
    got = staggered(speculating, greedy(150))
    assert got == want
    stats = speculating.stats()
    assert stats.spec_decode_num_accepted_tokens > 50  # it did speculate, and it paid
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens
    )
    assert stats.generation_tokens_total == sum(len(tokens) for tokens in want.values())


def test_accepted_tokens_are_cached_with_the_kv_they_would_have_had(stories):
    speculating = engine(stories, max_num_batched_tokens=64)
    (first,) = run_to_completion(speculating, {"a": PROMPTS["a"]}, greedy(120)).values()
    # The prompt and 100 tokens of that output, again: its blocks come from the cache,
    # written by speculative steps; what follows must be what followed before.
    again = PROMPTS["a"] + first[:100]
    speculating.add_request("again", again, greedy(20))
    outputs = []
    for _ in range(1000):
        if not speculating.has_work():
            break
        outputs += speculating.step().outputs
    assert outputs[0].num_cached_tokens >= 96
    assert [t for out in outputs for t in out.new_token_ids] == first[100:120]


def test_stop_tokens_and_max_tokens_end_a_request_inside_an_accepted_draft(stories):
    plain = run_to_completion(engine(stories, None), PROMPTS, greedy(150))
    speculating = engine(stories)
    stops = {rid: tokens[40] for rid, tokens in plain.items()}
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(temperature=0.0, max_tokens=150, stop_token_ids=[stops[rid]])
        speculating.add_request(rid, prompt, params)
    got = drain(speculating)
    for rid, tokens in plain.items():
        assert got[rid] == tokens[: tokens.index(stops[rid]) + 1]
    for max_tokens in (1, 2, 7, 33):
        assert run_to_completion(engine(stories), PROMPTS, greedy(max_tokens)) == {
            rid: tokens[:max_tokens] for rid, tokens in plain.items()
        }


def test_logprobs_of_verified_tokens_are_the_targets(stories):
    params = greedy(60, logprobs=2)
    found = {}
    for speculative in (None, NGRAM):
        e = engine(stories, speculative)
        for rid, prompt in PROMPTS.items():
            e.add_request(rid, prompt, params)
        found[speculative] = {}
        while e.has_work():
            for out in e.step().outputs:
                found[speculative].setdefault(out.request_id, []).extend(out.new_logprobs)
    for rid, plain in found[None].items():
        drafted = found[NGRAM][rid]
        assert len(drafted) == len(plain) == 60
        for (logprob, top), (want, want_top) in zip(drafted, plain, strict=True):
            assert logprob == pytest.approx(want, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in want_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)


def test_penalised_requests_speculate_with_the_same_greedy_output(stories):
    params = greedy(100, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    want = staggered(engine(stories, None), params)
    speculating = engine(stories)
    assert staggered(speculating, params) == want
    assert speculating.stats().spec_decode_num_accepted_tokens > 0


def test_bad_words_and_min_tokens_speculate_with_the_same_greedy_output(stories):
    plain = staggered(engine(stories, None), greedy(60))
    common = [t for tokens in plain.values() for t in tokens]
    frequent = max(set(common), key=common.count)  # banned: the output must change
    params = SamplingParams(
        temperature=0.0, max_tokens=120, min_tokens=80, bad_words_token_ids=[[frequent]]
    )
    want = staggered(engine(stories, None), params)
    assert want != plain
    speculating = engine(stories)
    assert staggered(speculating, params) == want
    assert speculating.stats().spec_decode_num_accepted_tokens > 0


def test_requests_that_may_not_speculate_and_wide_batches_get_no_drafts(stories):
    seeded = engine(stories)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    run_to_completion(seeded, PROMPTS, params)
    assert seeded.stats().spec_decode_num_drafts == 0
    off_at_4 = SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=4)
    wide = engine(stories, off_at_4, max_num_batched_tokens=256)
    run_to_completion(wide, PROMPTS, greedy(40, min_tokens=40))  # four run to the end
    assert wide.stats().spec_decode_num_drafts == 0
    narrow = engine(stories, off_at_4, max_num_batched_tokens=256)
    run_to_completion(narrow, {k: PROMPTS[k] for k in ("a", "b", "c")}, greedy(40))
    assert narrow.stats().spec_decode_num_drafts > 0


def test_sampled_requests_speculate_too(stories):
    speculating = engine(stories)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=80, ignore_eos=True)
    outputs = run_to_completion(speculating, PROMPTS, params)
    assert {rid: len(tokens) for rid, tokens in outputs.items()} == dict.fromkeys(PROMPTS, 80)
    assert speculating.stats().spec_decode_num_accepted_tokens > 0


def test_speculation_is_refused_across_pipeline_stages(stories):
    with pytest.raises(ValueError, match="pipeline stages"):
        engine(stories, pipeline_parallel_size=2)
