"""Speculative decoding's pieces alone: the config, prompt lookup, and verification
(``Sampler.verify``), whose rejection sampling must leave the target distribution as it
is: checked by drawing many times with a fixed seed."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.request import Request
from lamina.services.engine_worker.engine.sampler import Sampler
from lamina.services.engine_worker.engine.speculative import (
    SpeculativeConfig,
    may_speculate,
    propose,
)


def test_the_config_takes_vllms_json_and_refuses_unknown_keys():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (5, 4)
    assert config.prompt_lookup_min == 2
    assert SpeculativeConfig.parse('{"prompt_lookup_max": 1}').prompt_lookup_min == 1
    with pytest.raises(ValueError, match="unknown keys \\['num_spec_tokens'\\]"):
        SpeculativeConfig.parse('{"num_spec_tokens": 3}')
    with pytest.raises(ValueError, match="'ngram' and 'draft_model' are built"):
        SpeculativeConfig.parse('{"method": "eagle"}')
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{ngram")
    with pytest.raises(ValueError, match="1 <= min <= max"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="positive"):
        SpeculativeConfig(num_speculative_tokens=0)


def test_a_draft_model_is_named_by_its_checkpoint_and_the_method_follows_from_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    given = json.dumps({"model": str(tmp_path), "num_speculative_tokens": 5})
    config = SpeculativeConfig.parse(given)
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        str(tmp_path),
        5,
    )
    assert SpeculativeConfig.parse(str(config)) == config
    with pytest.raises(ValueError, match="takes a draft checkpoint"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="takes a draft checkpoint"):
        SpeculativeConfig.parse(json.dumps({"method": "ngram", "model": str(tmp_path)}))
    with pytest.raises(ValueError, match="no config\\.json"):
        SpeculativeConfig.parse(json.dumps({"model": str(tmp_path / "missing")}))


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    config = SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3)
    # 1 2 3 occurs twice before the end: the latest is followed by 9 1 2.
    assert propose([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], config, 3) == [9, 1, 2]
    assert propose([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], config, 1) == [9]
    # A longer match beats a later, shorter one: "7 2" matches at 1, "2" alone later.
    assert propose([7, 2, 5, 2, 6, 7, 2], config, 2) == [5, 2]
    assert propose([1, 2, 3, 4, 5, 2], config, 3) == [3, 4, 5]
    assert propose([1, 2, 3], config, 3) == []  # nothing repeats
    # What followed the match runs into the end: the copy goes on from its start.
    assert propose([7, 4, 4, 4], config, 4) == [4, 4, 4, 4]
    assert propose([1, 5, 6, 5, 6], config, 3) == [5, 6, 5]
    assert propose([1, 2, 1, 2], config, 0) == []
    at_least_3 = SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=4)
    assert propose([5, 1, 2, 7, 1, 2], at_least_3, 2) == []
    assert propose([5, 1, 2, 7, 5, 1, 2], at_least_3, 2) == [7, 5]


def request(params: SamplingParams, draft: list[int] = ()) -> Request:
    r = Request("r", [1, 2, 3], params, max_tokens=16)
    r.draft = list(draft)
    return r


def test_only_requests_whose_rows_need_no_draft_state_speculate():
    assert may_speculate(request(SamplingParams(temperature=0.7, top_p=0.9, logprobs=2)))
    assert may_speculate(request(SamplingParams(logit_bias={3: 1.0})))
    assert may_speculate(request(SamplingParams(presence_penalty=0.5)))  # modelled per row
    assert may_speculate(request(SamplingParams(repetition_penalty=1.2, frequency_penalty=1)))
    assert may_speculate(request(SamplingParams(bad_words_token_ids=[[4]])))
    assert may_speculate(request(SamplingParams(min_tokens=4)))
    seeded = request(SamplingParams(seed=7))
    seeded.generator = torch.Generator()
    assert may_speculate(seeded)  # its own draw per row
    unsent = request(SamplingParams(prompt_logprobs=1))
    unsent.prompt_logprobs = {}
    assert not may_speculate(unsent)


def test_a_rows_penalties_count_the_draft_tokens_before_it():
    """Verifying a penalised request's draft: row i is penalised as if the draft tokens
    before it were output, so each row is what the sampler would see after them."""
    sampler = Sampler((0,), seed=0, device=torch.device("cpu"))
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5, max_tokens=16)
    drafted = request(params, draft=[5, 5])
    drafted.token_ids += [7]  # one output token so far
    logits = torch.zeros(3, 10)
    logits[:, 5] = 2.0  # the argmax while 5 is not yet penalised twice
    logits[:, 6] = 0.9
    ((tokens, _),) = sampler.verify(logits, [drafted])
    # Row 0: 5 unseen, 2.0 wins (accept); row 1: 5 once, 0.5 < 0.9: 6 replaces it.
    assert tokens == [5, 6]
    for i in range(3):  # each row equals the plain sampler's on that sequence
        plain = request(params)
        plain.token_ids += [7, *drafted.draft[:i]]
        (token,) = sampler(logits[i : i + 1], [plain]).token_ids
        assert token == (5 if i == 0 else 6)


def test_a_rows_bad_words_and_min_tokens_follow_the_draft_before_it():
    """Row i bans a bad word's last token when the output plus draft[:i] ends with its
    prefix, and holds off EOS while the output plus i tokens is under min_tokens."""
    sampler = Sampler((0,), seed=0, device=torch.device("cpu"))
    logits = torch.zeros(3, 10)
    logits[:, 8] = 2.0  # the argmax after row 0, unless banned
    logits[:, 4] = 1.0
    logits[0, 5] = 3.0  # row 0 takes the draft's 5
    banned = request(SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 8]]), [5, 8])
    ((tokens, _),) = sampler.verify(logits, [banned])
    assert tokens == [5, 4]  # row 1 follows 5: 8 is banned there, 4 replaces the draft's 8
    logits = torch.zeros(3, 10)
    logits[:, 0] = 2.0  # EOS, the argmax
    logits[:, 6] = 1.0
    held = request(SamplingParams(temperature=0.0, min_tokens=1), [6, 0])
    ((tokens, _),) = sampler.verify(logits, [held])
    assert tokens == [6, 0, 0]  # row 0 holds EOS off (no token out yet); row 1 may end
    held.draft = [0]  # EOS proposed first: row 0 holds it off, so 6 replaces it
    ((tokens, _),) = sampler.verify(logits[:2], [held])
    assert tokens == [6]


def test_greedy_verification_keeps_the_draft_up_to_the_first_token_not_the_argmax():
    sampler = Sampler((0,), seed=0, device=torch.device("cpu"))
    # Rows: argmax 5, then 6, then 2, then 9.
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate((5, 6, 2, 9)):
        logits[row, token] = 5.0
    params = SamplingParams(temperature=0.0, logprobs=1)
    all_kept = request(params, [5, 6, 2])
    ((tokens, logprobs),) = sampler.verify(logits, [all_kept])
    assert tokens == [5, 6, 2, 9]  # all three, and the target's own next token
    assert [top[0][0] for _, top in logprobs] == tokens
    ((tokens, logprobs),) = sampler.verify(logits[:4], [request(params, [5, 3, 2])])
    assert tokens == [5, 6]  # the second was rejected: the argmax takes its place
    assert len(logprobs) == 2


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}])
def test_sampled_verification_keeps_the_target_distribution(filters):
    """Each output position is distributed as the target's (filtered) distribution, both
    where a draft token was proposed and past it. 24,000 draws with a fixed seed; each
    probability within 0.015 (over 4 standard deviations of its estimate)."""
    sampler = Sampler((0,), seed=1234, device=torch.device("cpu"))
    first = torch.tensor([0.1, 0.45, 0.3, 0.15]).log()  # the draft proposes token 2
    second = torch.tensor([0.25, 0.05, 0.2, 0.5]).log()  # then token 1 (unlikely)
    params = SamplingParams(temperature=1.0, **filters)
    n, batch = 24_000, 4_000
    firsts: collections.Counter[int] = collections.Counter()
    seconds: collections.Counter[int] = collections.Counter()
    lengths: collections.Counter[int] = collections.Counter()
    for _ in range(n // batch):
        requests = [request(params, [2, 1]) for _ in range(batch)]
        logits = torch.stack([first, second, second]).repeat(batch, 1)
        for tokens, _ in sampler.verify(logits, requests):
            firsts[tokens[0]] += 1
            lengths[len(tokens)] += 1
            if tokens[0] == 2:
                seconds[tokens[1]] += 1

    def target(logits):
        if filters:
            logits = logits.masked_fill(logits < logits.topk(filters["top_k"]).values[-1], -1e9)
        return logits.softmax(-1).tolist()

    want_first, want_second = target(first), target(second)
    for token in range(4):
        assert abs(firsts[token] / n - want_first[token]) < 0.015, (token, firsts)
        accepted = firsts[2]
        assert abs(seconds[token] / accepted - want_second[token]) < 0.015, (token, seconds)
    # One token (the correction) when the first draft token is rejected, two when the
    # second is, three when both are taken (never under top-k 3: it drops token 1).
    assert sorted(lengths) == ([1, 2] if filters else [1, 2, 3])
