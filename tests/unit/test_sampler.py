"""Sampler: each filter and penalty against a hand-computed expectation."""

from __future__ import annotations

import math

import torch

from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.request import Request
from lamina.services.engine_worker.engine.sampler import Sampler, _filter

NEG = float("-inf")


def req(prompt=(1,), output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100)
    r.token_ids += list(output)
    return r


def sampler() -> Sampler:
    return Sampler(eos_token_ids=(0,), seed=0, device=torch.device("cpu"))


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4))
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.45),
        SamplingParams(top_p=0.8, top_k=3),
    ]
    kept = _filter(logits, params) > NEG
    assert kept.tolist() == [
        [True, True, False, False],  # top 2
        [True, True, False, False],  # 0.4 < 0.6, 0.4 + 0.3 >= 0.6
        [True, True, True, False],  # >= 0.45 * 0.4
        [True, True, True, False],  # top 3 renormalised: mass before the 3rd is 0.7/0.9 < 0.8
    ]


def test_greedy_and_penalties():
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.0, 0.5]])
    assert sampler()(logits.clone(), [req(temperature=0)]).token_ids == [2]
    # A subnormal temperature is greedy (dividing by it overflowed: the same token always,
    # whatever the logits), as is anything under GREEDY_BELOW.
    for tiny in (5e-324, 1e-39, 9e-6):
        assert sampler()(logits.clone(), [req(temperature=tiny)]).token_ids == [2]
    # repetition 2.0 on token 2 (from the prompt): 3 -> 1.5, so token 1 (2.0) wins.
    out = sampler()(logits.clone(), [req(prompt=(2,), temperature=0, repetition_penalty=2.0)])
    assert out.token_ids == [1]
    # frequency 1.0 per occurrence of token 2 in the output (twice): 3 - 2 = 1 < 2.
    out = sampler()(logits.clone(), [req(output=(2, 2), temperature=0, frequency_penalty=1.0)])
    assert out.token_ids == [1]
    # presence applies once however often: 3 - 0.5 = 2.5 still wins.
    out = sampler()(logits.clone(), [req(output=(2, 2), temperature=0, presence_penalty=0.5)])
    assert out.token_ids == [2]


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0, 0.0, 0.0]])
    out = sampler()(logits.clone(), [req(temperature=0, min_tokens=2, stop_token_ids=(2,))])
    assert out.token_ids == [1]
    out = sampler()(logits.clone(), [req(output=(4, 4), temperature=0, min_tokens=2)])
    assert out.token_ids == [0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0, 0.0])
    logits = torch.log(probs).expand(4000, -1).clone()
    requests = [req(temperature=1.0) for _ in range(4000)]
    tokens = torch.tensor(sampler()(logits, requests).token_ids)
    freq = torch.bincount(tokens, minlength=6).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).expand(2000, -1).clone()
    cold = sampler()(logits.clone(), [req(temperature=0.1) for _ in range(2000)]).token_ids
    hot = sampler()(logits.clone(), [req(temperature=10.0) for _ in range(2000)]).token_ids
    assert cold.count(0) > 1990 and hot.count(0) < 600


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0, 0.0, 0.0]]))
    out = sampler()(logits, [req(temperature=0, logprobs=2)])
    lp, top = out.logprobs[0]
    assert math.isclose(lp, math.log(0.5), rel_tol=1e-6)
    assert top[0] == (0, lp) and top[1][0] in (1, 2)


def test_logit_bias_allowed_tokens_and_bad_words_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0, 0.5]] * 5)
    rows = [
        req(temperature=0),  # untouched: 2
        req(temperature=0, logit_bias={5: 3.0}),  # 0.5 + 3 beats 3
        req(temperature=0, logit_bias={2: -100.0}),  # banned in effect: 1
        req(temperature=0, allowed_token_ids=[0, 3, 4]),  # the best of those: 0
        # "1 2" is a bad word: after an output ending in 1, 2 is banned; "5" always is.
        req(output=(1,), temperature=0, bad_words_token_ids=[[1, 2], [5]]),
    ]
    before = logits.clone()
    assert sampler()(logits, rows).token_ids == [2, 5, 1, 0, 1]
    assert torch.equal(logits, before)  # the engine may sample a row again alone
    # The same rules with sampling (not greedy): never a token they exclude.
    for seed in range(20):
        out = sampler()(
            logits[:2],
            [
                req(temperature=1.0, seed=seed, allowed_token_ids=[3, 4]),
                req(output=(1,), temperature=1.0, seed=seed, bad_words_token_ids=[[1, 2]]),
            ],
        )
        assert out.token_ids[0] in (3, 4) and out.token_ids[1] != 2
