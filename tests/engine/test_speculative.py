"""Speculative decoding in the engine on a trained checkpoint (``stories260K``): greedy
output is token for token what the engine makes without it, whatever the batch around
it (prompt chunks, drafts cut by the step's budget, requests arriving mid-run); the KV
of rejected draft tokens is given back, and what was accepted is cached as if decoded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig
from tests.engine.helpers import drain, greedy, make_engine, run_to_completion, variant

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


def test_seeded_requests_speculate_with_the_same_output_seed_for_seed(stories, shallow):
    """A seeded request draws each verification row with its own generator and keeps
    draft tokens while they equal the draws: its output, and where its generator stands,
    are what decoding one token at a time gives (so a moved request continues exactly)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=60)
    want = staggered(engine(stories, None), params)
    for speculative in (NGRAM, drafting(shallow)):
        speculating = engine(stories, speculative)
        assert staggered(speculating, params) == want
        assert speculating.stats().spec_decode_num_accepted_tokens > 0


def test_wide_batches_get_no_drafts(stories):
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


@pytest.mark.parametrize(
    "parallel",
    [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
    ids=["pp2", "tp2"],
)
def test_parallel_engines_speculate_with_the_same_greedy_output(stories, shallow, parallel):
    """Across pipeline stages a drafted request's batch is in flight while the next one
    launches: its draft stays until that batch completes. With ranks, the draft model runs
    beside rank 0's share of each step. Greedy output is the same parallel engine's
    without speculation (a split's rounding is its own)."""
    outputs, accepted = [], []
    for speculative in (None, NGRAM, drafting(shallow)):
        running = engine(stories, speculative, **parallel)
        try:
            outputs.append(run_to_completion(running, PROMPTS, greedy(80)))
            accepted.append(running.stats().spec_decode_num_accepted_tokens)
        finally:
            running.close()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert accepted[1] > 0 and accepted[2] > 0


# ------------------------------------------------------------------------ a draft model
@pytest.fixture(scope="module")
def shallow(stories, tmp_path_factory) -> Path:
    """stories260K's first two layers of five: a draft model of the same tokenizer that
    agrees with the target often, not always."""
    return variant(stories, tmp_path_factory.mktemp("shallow"), layers=2)


def drafting(model: Path, tokens: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=tokens)


def assert_draft_kv_is_the_targets(engine) -> None:
    """With the target as its own draft: every cached block's KV in the draft's pool is
    the target's (up to the rounding of another batch's kernels)."""
    blocks = torch.tensor(sorted(engine.blocks.cached.values()))
    assert len(blocks)
    targets, drafts = engine.runner.kv_caches, engine.drafter.runner.kv_caches
    for target, draft in zip(targets, drafts, strict=True):
        torch.testing.assert_close(draft[:, blocks], target[:, blocks], rtol=1e-4, atol=1e-5)


def test_a_draft_model_that_is_the_target_has_every_draft_token_accepted(stories):
    """The target as its own draft: each of its proposals is the target's argmax, so every
    one is accepted, which holds only if the draft's KV is the target's at every position
    (prompt chunks, earlier drafts, a cut budget)."""
    want = staggered(engine(stories, None), greedy(150))
    speculating = engine(stories, drafting(stories))
    assert staggered(speculating, greedy(150)) == want
    stats = speculating.stats()
    assert stats.spec_decode_num_draft_tokens > 100
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_draft_kv_is_the_targets(speculating)


def test_a_shallow_draft_model_keeps_greedy_output_and_is_partly_accepted(stories, shallow):
    want = staggered(engine(stories, None), greedy(150))
    speculating = engine(stories, drafting(shallow))
    assert staggered(speculating, greedy(150)) == want
    stats = speculating.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_draft_models_kv_follows_blocks_into_the_host_tier_and_back(stories):
    """A prompt's blocks evicted to the host tier and loaded back: the draft's KV made the
    same round trip (its tier has the target's slots)."""
    tiered = engine(
        stories, drafting(stories), num_kv_blocks=24, kv_offload_bytes=1 << 22, max_model_len=256
    )
    prompt = PROMPTS["long"][:100]
    first = run_to_completion(tiered, {"p": prompt}, greedy(20))["p"]
    run_to_completion(tiered, {f"f{i}": [1, 7 + i] * 60 for i in range(4)}, greedy(4))
    assert tiered.stats().host_kv_saves_total > 0
    before = tiered.stats()
    tiered.add_request("again", prompt, greedy(20))
    outputs = []
    while tiered.has_work():
        outputs += tiered.step().outputs
    assert outputs[0].num_cached_tokens == 96
    assert tiered.stats().host_kv_loads_total == before.host_kv_loads_total + 6
    assert_draft_kv_is_the_targets(tiered)
    assert [t for out in outputs for t in out.new_token_ids] == first
    after = tiered.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0 and accepted == drafted


def test_sampled_requests_speculate_with_a_draft_model(stories, shallow):
    speculating = engine(stories, drafting(shallow))
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=80, ignore_eos=True)
    outputs = run_to_completion(speculating, PROMPTS, params)
    assert {rid: len(tokens) for rid, tokens in outputs.items()} == dict.fromkeys(PROMPTS, 80)
    assert speculating.stats().spec_decode_num_accepted_tokens > 0


def test_a_draft_model_of_another_vocabulary_or_too_few_positions_is_refused(stories, tmp_path):
    (tmp_path / "other").mkdir(), (tmp_path / "short").mkdir()
    other = variant(stories, tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        engine(stories, drafting(other))
    short = variant(stories, tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match="positions"):
        engine(stories, drafting(short))


def test_an_adaptive_engine_drafts_only_while_its_gate_finds_drafting_pays(stories):
    """``"adaptive": true``: the gate's step-time fit (its own test feeds it synthetic
    steps) stands in for a machine where each token costs a step's worth (compute-bound:
    drafts at this acceptance do not pay), then for one where a step costs the same at
    any width (memory-bound: they do). Output is unchanged throughout."""
    adaptive = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=True
    )
    speculating = engine(stories, adaptive)
    assert speculating.stats().spec_decode_active
    want = run_to_completion(engine(stories, None), PROMPTS, greedy(100))

    speculating.gate.step_time = lambda tokens: 1e-3 * tokens
    assert run_to_completion(speculating, PROMPTS, greedy(100)) == want
    stats = speculating.stats()
    assert not stats.spec_decode_active
    # 400 tokens decoded: drafts only until its first acceptance, then one step in
    # PROBE_OFF_EVERY (to measure the acceptance again).
    assert 0 < stats.spec_decode_num_drafts < 400 / 4

    speculating.gate.step_time = lambda tokens: 5e-3
    assert run_to_completion(speculating, PROMPTS, greedy(100)) == want
    again = speculating.stats()
    assert again.spec_decode_active
    # Drafting every step again: many times the drafts of the same work while off.
    assert (
        again.spec_decode_num_drafts - stats.spec_decode_num_drafts
        > 4 * stats.spec_decode_num_drafts
    )


def test_a_draft_model_skipped_while_drafts_are_off_catches_up_when_they_resume(stories):
    """While the gate holds drafts off, steps without drafts leave the draft model out;
    each drafted step (one in ``PROBE_OFF_EVERY``, then every step once drafts pay again)
    first computes the draft's KV it was left behind on. The target as its own draft: every
    proposal is still accepted, which holds only if the caught-up KV is the target's."""
    adaptive = dataclasses.replace(drafting(stories), adaptive=True)
    want = staggered(engine(stories, None), greedy(150))
    speculating = engine(stories, adaptive)
    mirrored = []
    mirror = speculating.drafter.mirror
    speculating.drafter.mirror = lambda step: mirrored.append(step) or mirror(step)
    # Drafts do not pay, even all accepted: a step's time grows faster than its width.
    speculating.gate.step_time = lambda tokens: 1e-3 * tokens**2
    assert staggered(speculating, greedy(150)) == want
    off = speculating.stats()
    assert not off.spec_decode_active and off.spec_decode_num_drafts > 0
    assert off.spec_decode_num_accepted_tokens == off.spec_decode_num_draft_tokens
    steps_off = len(mirrored)
    assert steps_off <= off.spec_decode_num_drafts  # only drafted steps ran the draft model
    speculating.gate.step_time = lambda tokens: 5e-3  # now they do
    steps = []
    step = speculating.step
    speculating.step = lambda: steps.append(1) or step()
    assert staggered(speculating, greedy(150)) == want
    on = speculating.stats()
    assert on.spec_decode_active
    assert on.spec_decode_num_draft_tokens > off.spec_decode_num_draft_tokens + 100
    assert on.spec_decode_num_accepted_tokens == on.spec_decode_num_draft_tokens
    assert len(mirrored) - steps_off >= len(steps) - 1  # every step again
