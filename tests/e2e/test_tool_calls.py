"""Tool calls through the running stack with the official ``openai`` client: a required or
named call is guaranteed and its arguments validate against the function's parameters;
with ``auto``, the Hermes parser finds calls in the text, streamed as OpenAI streams
tool-call deltas; a conversation carrying calls and their results reaches the template."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_valid_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_makes_calls_whose_arguments_validate(client, seed):
    reply = client.chat.completions.create(
        model="lamina-tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)
    one = client.chat.completions.create(
        model="lamina-tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=seed,
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_named_function_is_the_call_streamed_or_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model="lamina-tiny", messages=ASK, tools=TOOLS, tool_choice=choice, seed=4
    )
    (call,) = reply.choices[0].message.tool_calls
    assert_valid_calls([call], {"get_time"})
    chunks = list(
        client.chat.completions.create(
            model="lamina-tiny", messages=ASK, tools=TOOLS, tool_choice=choice, seed=4, stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].function.name == "get_time"
    assert deltas[0].function.arguments == call.function.arguments  # seeded: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


HERMES_CALL = (
    r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "unit": "C"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_hermes_calls_in_the_text(client, stream):
    # The random-weights model is made to write a Hermes call (a regex constraint); the
    # parser, not the constraint, turns it into a tool call.
    kwargs = dict(
        model="lamina-tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, calls = message.content, message.tool_calls
    else:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert content == "Checking. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})
    ]
    # Without tools, the same text is only content.
    plain = client.chat.completions.create(
        model="lamina-tiny",
        messages=ASK,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content


def test_a_conversation_with_calls_and_results_reaches_the_template(client, stack, tiny_model):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 and sunny"},
    ]  # fmt: skip
    # The reference: transformers' rendering (arguments as an object, as vLLM passes them).
    hf = AutoTokenizer.from_pretrained(tiny_model)
    as_template = [
        ASK[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather",
                                  "arguments": {"city": "Paris", "unit": "C"}}}
        ]},
        messages[2],
    ]  # fmt: skip
    text = hf.apply_chat_template(
        as_template, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert "18 and sunny" in text and '"arguments": {"city": "Paris", "unit": "C"}' in text
    reply = client.chat.completions.create(
        model="lamina-tiny", messages=messages, tools=TOOLS, max_tokens=3, temperature=0
    )
    assert reply.usage.prompt_tokens == len(expected)
    tokenized = httpx.post(
        stack.base_url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=10
    ).json()
    assert tokenized["tokens"] == expected


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not a tool"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json_object": True}},
         "cannot both"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "use tools"),
    ],
)  # fmt: skip
def test_inconsistent_tool_requests_are_400s(client, body, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="lamina-tiny", messages=ASK, extra_body=body)
    error = refused.value.body
    assert words in error["message"] or words == error["param"].split("[")[0], error


FORECAST = {  # parameters that refer to their own $defs, as pydantic writes them
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "options": {"$ref": "#/$defs/Options"}},
            "required": ["city", "options"],
            "$defs": {"Options": {"type": "object", "properties": {"days": {"enum": [1, 2, 3]}},
                                  "required": ["days"]}},
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_required_calls_with_defs_and_a_response_format_validate(client, seed):
    reply = client.chat.completions.create(
        model="lamina-tiny",
        messages=ASK,
        tools=[WEATHER, FORECAST],
        tool_choice="required",
        response_format={"type": "json_object"},  # for a reply that is not a call
        seed=seed,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls"
    schemas = {"get_weather": WEATHER, "get_forecast": FORECAST}
    for call in calls:
        parameters = schemas[call.function.name]["function"]["parameters"]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, parameters)
        if call.function.name == "get_forecast":  # closed objects: only the listed keys
            assert set(arguments) <= {"city", "options"} and set(arguments["options"]) == {"days"}
