"""Prompt logprobs (vLLM's ``prompt_logprobs``; ``echo`` with ``logprobs``) against Hugging
Face ``transformers`` on the same weights: each prompt token's logprob, rank and top
alternatives, however the prompt is chunked and whether or not its blocks are cached."""

from __future__ import annotations

import pytest
import torch

from lamina.services.engine_worker.engine.params import SamplingParams
from tests.engine.helpers import make_engine
from tests.engine.test_hf_parity import hf_model, sequences


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint("llama")


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """``(len(prompt) - 1, vocab)`` logprobs of each next prompt token's distribution."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def first_outputs(engine, prompts: dict[str, list[int]], top: int) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(
            rid, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=top)
        )
    got = {}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.prompt_logprobs is not None:
                assert out.request_id not in got  # sent once, with the first token
                got[out.request_id] = out.prompt_logprobs
    return got


def assert_matches(got, want: torch.Tensor, prompt: list[int], top: int) -> None:
    assert len(got) == len(prompt) - 1
    for position, (logprob, rank, alternatives) in enumerate(got):
        row, token = want[position], prompt[position + 1]
        assert logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert rank == int((row > row[token]).sum()) + 1
        assert len(alternatives) == top
        values, ids = row.topk(top)
        assert [t for t, _ in alternatives] == ids.tolist()
        assert [v for _, v in alternatives] == pytest.approx(values.tolist(), abs=2e-4)


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_transformers(model, chunk):
    overrides = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = make_engine(model, enable_chunked_prefill=True, **overrides)
    hf = hf_model(model)
    prompts = dict(zip(("a", "b", "c"), sequences(256, [5, 37, 1]), strict=True))
    got = first_outputs(engine, prompts, top=3)
    for rid, prompt in prompts.items():
        assert_matches(got[rid], reference(hf, prompt), prompt, 3)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(model):
    engine = make_engine(model)
    prompt = sequences(256, [40])[0]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    while engine.has_work():
        engine.step()
    engine.add_request("again", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    outputs = []
    while engine.has_work():
        outputs += engine.step().outputs
    (out,) = outputs
    assert out.num_cached_tokens == 0  # not read from the cache its blocks are in
    assert_matches(out.prompt_logprobs, reference(hf_model(model), prompt), prompt, 0)
    # Without prompt logprobs, the same prompt is served from the cache, and sends none.
    engine.add_request("cached", prompt, SamplingParams(max_tokens=1))
    (plain,) = [o for _ in range(3) for o in engine.step().outputs][:1]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_a_moved_request_does_not_send_them_again(model):
    engine = make_engine(model)
    prompt = sequences(256, [12])[0]
    engine.add_request("moved", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2), replayed=4)
    while engine.has_work():
        assert all(out.prompt_logprobs is None for out in engine.step().outputs)
