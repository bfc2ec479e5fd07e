"""Every request field of vLLM's OpenAI completions and chat schemas is honoured or refused
by name, never silently ignored; a field neither knows is ignored and reported."""

from __future__ import annotations

import msgspec
import pytest

from lamina.services.gateway.completions import ignored_header
from lamina.services.gateway.protocol import (
    _NOT_SUPPORTED,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    decode_request,
)

# The fields of vLLM 0.34.0's ``CompletionRequest``, ``ChatCompletionRequest`` and
# ``BatchChatCompletionRequest`` (vllm/entrypoints/openai/{completion,chat_completion}/
# protocol.py), as facts.
VLLM_COMPLETION_FIELDS = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "prompt_embeds",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
]
VLLM_CHAT_FIELDS = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
]
VLLM_BATCH_CHAT_FIELDS = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "logprob_token_ids",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "temperature",
    "top_p",
    "user",
    "tool_choice",
    "include_reasoning",
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "early_stopping",
    "structured_outputs",
    "request_id",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "priority",
    "cache_salt",
    "include_stop_str_in_output",
    "guided_decoding_backend",
    "echo",
    "return_tokens_as_token_ids",
    "return_token_ids",
]
# Fields OpenAI or vLLM had and replaced (vLLM still names them when it refuses them).
RETIRED = ["functions", "function_call", "best_of", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"]  # fmt: skip


def declared(kind: type) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(kind)}


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (CompletionRequest, VLLM_COMPLETION_FIELDS),
        (ChatCompletionRequest, VLLM_CHAT_FIELDS),
        (BatchChatCompletionRequest, VLLM_BATCH_CHAT_FIELDS),
    ],
)
def test_every_vllm_field_is_declared_or_refused(kind, fields):
    unaccounted = set(fields) - declared(kind) - set(_NOT_SUPPORTED)
    assert not unaccounted
    assert not declared(kind) & set(_NOT_SUPPORTED)  # one or the other, never both
    assert set(RETIRED) <= set(_NOT_SUPPORTED)


@pytest.mark.parametrize("name", sorted(_NOT_SUPPORTED))
def test_a_field_not_implemented_is_refused_by_name_unless_it_asks_for_nothing(name):
    neutral, _ = _NOT_SUPPORTED[name]
    for value in neutral:  # what a client sends to mean "off" is accepted
        _, ignored = decode_request(
            msgspec.json.encode({"prompt": "x", name: value}), CompletionRequest
        )
        assert ignored == []
    asking = {"x": 1} if neutral != (None, {}) else {"on": True}
    for value in ("something", 7, [1], asking):
        if value in neutral:
            continue
        with pytest.raises(InvalidRequest) as refused:
            decode_request(msgspec.json.encode({"prompt": "x", name: value}), CompletionRequest)
        assert refused.value.param == name
        assert name in refused.value.message


def test_fields_nobody_knows_are_ignored_and_named():
    raw = b'{"prompt": "x", "bogus_field": 1, "another": {"deep": [1]}, "n": 2}'
    body, ignored = decode_request(raw, CompletionRequest)
    assert (body.prompt, body.n, ignored) == ("x", 2, ["another", "bogus_field"])
    _, ignored = decode_request(b'{"messages": [], "echo_back": true}', ChatCompletionRequest)
    assert ignored == ["echo_back"]


def test_the_ignored_fields_header_names_only_what_is_safe_in_a_header():
    assert ignored_header(["a", "b_c"]) == (b"x-lamina-ignored-fields", b"a, b_c")
    assert ignored_header(["ok", "bad\r\nSet-Cookie: x", "é"])[1] == b"ok, (2 more)"
    many = [f"f{i}" for i in range(40)]
    assert ignored_header(many)[1].endswith(b"f31, (8 more)")
    assert ignored_header(["\n"])[1] == b"(1 more)"


def test_a_body_that_is_not_an_object_or_not_json_is_refused():
    for raw in (b"[1, 2]", b"{", b'"text"'):
        with pytest.raises(InvalidRequest):
            decode_request(raw, CompletionRequest)
