"""Structured outputs through the running stack, with the official ``openai`` client and
the NATS request API: on the random-weights default model, the output is an instance of
the schema; a schema the engine cannot enforce is a 400 before any worker is used."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from lamina.schemas.v1.api import ApiError, ApiFinished, ApiRequest
from lamina.schemas.v1.generate import Sampling, StructuredOutput
from tests.e2e.test_nats_api import call

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "wet"]}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.mark.parametrize("seed", [0, 1])
def test_chat_response_format_json_schema_streamed_and_not(client, seed):
    reply = client.chat.completions.create(
        model="lamina-tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, seed=seed
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = client.chat.completions.create(
        model="lamina-tiny",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        seed=seed,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # seeded: the same instance either way


def test_json_object_and_vllms_structured_outputs_on_completions(client):
    obj = client.chat.completions.create(
        model="lamina-tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        max_tokens=800,
        seed=3,
    )
    if obj.choices[0].finish_reason == "stop":  # random weights may fill a string for long
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for seed in range(3):
        regex = client.completions.create(
            model="lamina-tiny",
            prompt="A code:",
            extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}},
            seed=seed,
        )
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.choices[0].text), regex.choices[0].text
        choice = client.completions.create(
            model="lamina-tiny",
            prompt="Pick:",
            extra_body={"structured_outputs": {"choice": ["left", "right"]}},
            seed=seed,
            stream=True,
        )
        assert "".join(c.choices[0].text for c in choice) in ("left", "right")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "array", "uniqueItems": True}}}},
            "response_format",
            "uniqueItems",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "nowhere"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_it(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="lamina-tiny", messages=MESSAGES, extra_body=body)
    error = refused.value.body
    assert error["param"] == param, error
    assert words in error["message"], error


def test_the_nats_api_takes_the_same_constraint_and_refuses_the_same_way(stack):
    spec = StructuredOutput(json=json.dumps(SCHEMA))
    events = call(
        stack.nats_url,
        ApiRequest(messages=MESSAGES, sampling=Sampling(max_tokens=None, seed=5, structured=spec)),
    )
    final = events[-1]
    assert isinstance(final, ApiFinished) and final.finish_reason == "stop", final
    jsonschema.validate(json.loads("".join(e.text for e in events)), SCHEMA)
    bad = StructuredOutput(json='{"type": "array", "contains": {"type": "integer"}}')
    (error,) = call(stack.nats_url, ApiRequest(prompt="x", sampling=Sampling(structured=bad)))
    assert isinstance(error, ApiError) and error.code == 400, error
    # Named as the NATS API's own field (the HTTP API's is structured_outputs).
    assert error.param == "sampling.structured" and "contains" in error.message
