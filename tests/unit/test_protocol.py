"""OpenAI request bodies: lenient where clients differ, strict where types are wrong."""

from __future__ import annotations

import msgspec
import pytest

from lamina.libs.bus import encode
from lamina.schemas.v1.generate import GenerateRequest, Sampling, StructuredOutput
from lamina.services.gateway.errors import InvalidRequest
from lamina.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
)


def test_prompts_as_text_token_ids_or_a_batch_of_either():
    for prompt, want in [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        (["hi"], ["hi"]),
        ([[3, 4]], [[3, 4]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ]:
        assert CompletionRequest(prompt=prompt).prompt_inputs() == want
    for bad in ([], [1, "x"], [[]], [["a"]], [True, 2], [{"a": 1}]):
        with pytest.raises(InvalidRequest) as err:
            CompletionRequest(prompt=bad).prompt_inputs()
        assert err.value.param == "prompt"


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
    assert body.chat_prompts()[0].messages == [{"role": "user", "content": "ab"}]
    sampling = body.sampling(None, body.logprobs_count(1000))
    assert (sampling.max_tokens, sampling.top_k, sampling.logprobs) == (5, 3, 2)
    assert sampling.temperature == 1.0 and body.stop_strings() == ["x"]
    assert CompletionRequest(prompt="x").sampling(16, None).max_tokens == 16
    with pytest.raises(InvalidRequest) as too_many:  # OpenAI's limit
        decode_body(b'{"prompt": "x", "n": 129}', CompletionRequest)
    assert too_many.value.param == "n"
    with pytest.raises(InvalidRequest, match="min_tokens"):
        CompletionRequest(prompt="x", max_tokens=2, min_tokens=3).sampling(16, None)


def test_every_sampling_field_reaches_the_engine():
    """Each OpenAI / vLLM field, set away from its default, arrives in the ``Sampling`` the
    engine samples by unchanged (HTTP body → wire ``Sampling`` → the worker's decode)."""
    sent = dict(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        seed=11,
        stop_token_ids=[5, 6],
        ignore_eos=True,
        min_tokens=3,
        logit_bias={7: -2.5},
        allowed_token_ids=[7, 8],
        prompt_logprobs=3,
    )
    constraint = {"structured_outputs": {"regex": "a+"}}
    body = decode_body(
        msgspec.json.encode({"prompt": [1], **sent, **constraint}), CompletionRequest
    )
    request = GenerateRequest(
        request_id="r", model="m", prompt_token_ids=[1], sampling=body.sampling(16, 2)
    )
    params = msgspec.json.decode(encode(request), type=GenerateRequest).sampling
    got = {name: getattr(params, name) for name in sent}
    assert got == sent
    assert params.logprobs == 2
    assert params.structured == StructuredOutput(regex="a+")
    defaults = Sampling()
    assert all(sent[name] != getattr(defaults, name) for name in sent)
    fields = {f.name for f in msgspec.structs.fields(Sampling)}
    # A new sampling field must be added above (bad words come as words: the gateway
    # tokenizes them, test_openai_api.py; constraints: test_structured_output.py).
    assert fields == set(sent) | {"logprobs", "bad_words_token_ids", "structured"}


def test_truncation_keeps_either_end_and_refuses_more_than_the_context():
    from lamina.services.gateway.errors import GenerationError
    from lamina.services.gateway.truncation import Truncation

    ids = list(range(10))
    assert Truncation(3).apply(ids, 100) == [7, 8, 9]
    assert Truncation(3, "right").apply(ids, 100) == [0, 1, 2]
    assert Truncation(30).apply(ids, 100) == ids
    assert Truncation(-1).apply(ids, 5) == [6, 7, 8, 9]
    assert Truncation(-1).apply(ids, 0) == ids  # no context known: the worker decides
    assert Truncation(0).apply(ids, 100) == []
    with pytest.raises(GenerationError) as refused:
        Truncation(101).apply(ids, 100)
    assert refused.value.param == "truncate_prompt_tokens"


def test_a_chats_template_options_become_its_prompt():
    body = decode_body(
        b'{"messages": [{"role": "user", "content": "a"}], "documents": [{"title": "t"}], '
        b'"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": false}, '
        b'"add_generation_prompt": false, "add_special_tokens": true}',
        ChatCompletionRequest,
    )
    body.refuse_unsupported()
    (prompt,) = body.chat_prompts()
    assert prompt.template_kwargs == {
        "enable_thinking": False,
        "documents": [{"title": "t"}],
        "reasoning_effort": "low",
    }
    assert (prompt.add_generation_prompt, prompt.add_special_tokens) == (False, True)
    reserved = decode_body(
        b'{"messages": [], "chat_template_kwargs": {"tools": [], "tokenize": true}}',
        ChatCompletionRequest,
    )
    with pytest.raises(InvalidRequest, match=r"\['tokenize', 'tools'\]") as refused:
        reserved.refuse_unsupported()
    assert refused.value.param == "chat_template_kwargs"
