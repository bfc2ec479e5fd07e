"""OpenAI request bodies: lenient where clients differ, strict where types are wrong."""

from __future__ import annotations

import pytest

from lamina.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    decode_body,
)


def test_prompts_as_text_token_ids_or_a_batch_of_one():
    for prompt, want in [("hi", "hi"), ([1, 2], [1, 2]), (["hi"], "hi"), ([[3, 4]], [3, 4])]:
        body = CompletionRequest(prompt=prompt)
        assert body.prompt_input() == want
    with pytest.raises(InvalidRequest, match="batched"):
        CompletionRequest(prompt=["a", "b"]).prompt_input()
    with pytest.raises(InvalidRequest):
        CompletionRequest(prompt=[1, "x"]).prompt_input()


def test_unknown_fields_are_ignored_and_wrong_types_name_the_field():
    body = decode_body(
        b'{"prompt": "x", "user": "u", "some_future_field": {"a": 1}}', CompletionRequest
    )
    assert body.prompt == "x"
    with pytest.raises(InvalidRequest) as err:
        decode_body(b'{"prompt": "x", "temperature": "hot"}', CompletionRequest)
    assert err.value.param == "temperature"
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        decode_body(b'{"prompt": ', CompletionRequest)


def test_sampling_mapping_and_defaults():
    body = decode_body(
        b'{"messages": [{"role": "user", "content": [{"type": "text", '
        b'"text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens'
        b'": 5, "top_k": 3, "stop": "x", "logprobs": true, "top_logprobs": 2}',
        ChatCompletionRequest,
    )
    assert body.chat() == [{"role": "user", "content": "ab"}]
    sampling = body.sampling(None, body.logprobs_count())
    assert (sampling.max_tokens, sampling.top_k, sampling.logprobs) == (5, 3, 2)
    assert sampling.temperature == 1.0 and body.stop_strings() == ["x"]
    assert CompletionRequest(prompt="x").sampling(16, None).max_tokens == 16
    with pytest.raises(InvalidRequest, match="n=1"):
        CompletionRequest(prompt="x", n=2).sampling(16, None)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        CompletionRequest(prompt="x", max_tokens=0).sampling(16, None)
