"""Structured output requests: how OpenAI's ``response_format`` and vLLM's
``structured_outputs`` become the wire constraint, and which constraints the gateway
refuses before any worker is used (and with what message)."""

from __future__ import annotations

import json

import msgspec
import pytest

from lamina.libs import grammar
from lamina.schemas.v1.generate import Sampling, StructuredOutput
from lamina.services.gateway.errors import InvalidRequest
from lamina.services.gateway.protocol import (
    ChatCompletionRequest,
    decode_body,
    decode_request,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint(**body) -> StructuredOutput | None:
    request = decode_body(
        msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **body}),
        ChatCompletionRequest,
    )
    return request.sampling(None, None).structured


def test_response_format_and_structured_outputs_map_onto_one_constraint():
    assert constraint() is None
    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}) == StructuredOutput(json_object=True)
    got = constraint(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    )
    assert got is not None and json.loads(got.json) == SCHEMA
    assert constraint(structured_outputs={"json": SCHEMA}).json == got.json
    assert constraint(structured_outputs={"json": json.dumps(SCHEMA)}).json == json.dumps(SCHEMA)
    assert constraint(structured_outputs={"regex": "[a-z]+"}) == StructuredOutput(regex="[a-z]+")
    assert constraint(structured_outputs={"choice": ["x", "y"]}).choice == ["x", "y"]
    assert constraint(structured_outputs={"grammar": "start: /a+/"}).grammar == "start: /a+/"
    compact = constraint(structured_outputs={"json_object": True, "disable_any_whitespace": True})
    assert compact == StructuredOutput(json_object=True, disable_any_whitespace=True)
    # The same constraint asked for both ways is one constraint.
    both = constraint(
        response_format={"type": "json_object"}, structured_outputs={"json_object": True}
    )
    assert both == StructuredOutput(json_object=True)
    # Unknown fields are ignored, as OpenAI and vLLM ignore them.
    assert constraint(structured_outputs={"regex": "a", "whitespace_pattern": None}).regex == "a"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"structured_outputs": {}}, "structured_outputs", "needs one of"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "must be true"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "length"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "different constraints"),
        ({"guided_json": SCHEMA}, "guided_json", "use structured_outputs"),
    ],
)  # fmt: skip
def test_conflicting_or_empty_constraints_are_refused_naming_the_field(body, param, words):
    with pytest.raises(InvalidRequest) as refused:
        request, _ = decode_request(
            msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **body}),
            ChatCompletionRequest,
        )
        request.refuse_unsupported()
        request.sampling(None, None)
    assert refused.value.param == param
    assert words in refused.value.message, refused.value.message


def test_a_wrongly_typed_response_format_is_a_decode_error_naming_it():
    with pytest.raises(InvalidRequest) as refused:
        decode_body(b'{"messages": [], "response_format": {"type": "yaml"}}', ChatCompletionRequest)
    assert refused.value.param == "response_format.type"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput(json='{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (StructuredOutput(json='{"type": "array", "contains": {"type": "integer"}}'), "contains"),
        (StructuredOutput(json='{"type": "nope"}'), "nope"),
        (StructuredOutput(json='{"type": '), "not valid JSON"),
        (StructuredOutput(json="[1, 2]"), "object or a boolean"),
        (StructuredOutput(json="[" * 100_000 + "]" * 100_000), "JSON"),
        (StructuredOutput(regex="[a-"), "unclosed character class"),
        (StructuredOutput(grammar="root ::= undefined_rule"), "undefined_rule"),
        (StructuredOutput(grammar="start: @@@"), "grammar"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_says_what_is_wrong(spec, words):
    with pytest.raises(grammar.GrammarError) as refused:
        grammar.check(spec)
    assert words.lower() in str(refused.value).lower(), refused.value
    assert "\n" not in str(refused.value) and len(str(refused.value)) <= 500


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json=json.dumps(SCHEMA)),
        StructuredOutput(json="true"),
        StructuredOutput(json='{"type": "integer", "multipleOf": 3}'),  # enforced, not ignored
        StructuredOutput(json_object=True, disable_any_whitespace=True),
        StructuredOutput(regex=r"\d{3}-[a-z]+"),
        StructuredOutput(choice=['say "hi"\n', "\\"]),
        StructuredOutput(grammar='root ::= "yes" | "no"'),
        StructuredOutput(grammar='start: "a" B+\nB: "b"'),
    ],
)
def test_constraints_the_engine_enforces_pass_the_check(spec):
    grammar.check(spec)


def test_the_wire_constraint_holds_exactly_one_kind():
    for fields in ({}, {"regex": "a", "grammar": 'root ::= "a"'}):
        with pytest.raises(msgspec.ValidationError, match="exactly one"):
            msgspec.convert({"structured": fields}, Sampling)
    too_long = "a" * ((1 << 18) + 1)
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.convert({"structured": {"regex": too_long}}, Sampling)


def test_object_schemas_are_closed_unless_they_say_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "fixed": {"const": {"properties": {"kept": 1}}},
            "either": {"anyOf": [{"properties": {"y": {}}}, {"type": "string"}]},
        },
        "$defs": {"D": {"properties": {"z": {}}}},
    }
    closed = grammar._closed(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["fixed"] == {"const": {"properties": {"kept": 1}}}  # data, not a schema
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a mapping, not a schema
    assert grammar._closed(True) is True


def test_json_whitespace_is_bounded_unless_none_is_asked(tiny_model):
    import llguidance
    from tokenizers import Tokenizer

    path = tiny_model / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    vocab = llguidance.LLTokenizer(
        path.read_text(), n_vocab=tokenizer.get_vocab_size(), eos_token=[0]
    )

    def accepts(text: str, **options) -> bool:
        spec = StructuredOutput(json=json.dumps(SCHEMA), **options)
        matcher = llguidance.LLMatcher(vocab, grammar.check(spec), log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return matcher.consume_tokens(ids) and not matcher.is_error()

    assert accepts('{\n  "a": 1\n}') and accepts('{"a": 1}')
    assert not accepts("{" + " " * 17 + '"a": 1}')
    assert not accepts('{"a": 1, "b": 2}')  # closed: no invented key
    assert accepts('{"a":1}', disable_any_whitespace=True)
    assert not accepts('{"a": 1}', disable_any_whitespace=True)
