"""OpenAI's Responses API through the ``openai`` client: text, streamed events, a tool
call, structured output, and ``previous_response_id`` over stored responses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

GREEDY = {"temperature": 0, "max_output_tokens": 8}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}


def test_text_is_the_chat_completions_text_and_the_response_is_stored(client, stack):
    response = client.responses.create(model="lamina-tiny", input="Tell me a story.", **GREEDY)
    chat = client.chat.completions.create(
        model="lamina-tiny",
        messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=0,
        max_tokens=8,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 8
    assert response.status == "incomplete"  # it ran out of max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(response.id).output_text == response.output_text
    deleted = httpx.delete(f"{stack.base_url}/v1/responses/{response.id}", timeout=10)
    assert deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_instructions_and_input_items_become_the_chat(client):
    response = client.responses.create(
        model="lamina-tiny",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
        **GREEDY,
    )
    chat = client.chat.completions.create(
        model="lamina-tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ],
        temperature=0,
        max_tokens=8,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_response(client):
    events = list(
        client.responses.create(
            model="lamina-tiny", input="Tell me a story.", stream=True, **GREEDY
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text
    whole = client.responses.create(model="lamina-tiny", input="Tell me a story.", **GREEDY)
    assert text == whole.output_text
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.output_item.done"):  # fmt: skip
        assert kind in kinds


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_is_a_function_call_item(client, stream):
    created = client.responses.create(
        model="lamina-tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: an unbounded array could outrun the budget
        temperature=0,
        stream=stream,
    )
    if stream:
        events = list(created)
        assert "response.function_call_arguments.done" in [e.type for e in events]
        created = events[-1].response
    calls = [item for item in created.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The call's output goes back as an input item, and the conversation continues.
    follow = client.responses.create(
        model="lamina-tiny",
        previous_response_id=created.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        **GREEDY,
    )
    assert follow.previous_response_id == created.id and follow.output_text


def test_text_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}},
        "required": ["name"],
    }
    response = client.responses.create(
        model="lamina-tiny",
        input="A city, as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        max_output_tokens=256,  # room for the most whitespace the bound allows
        temperature=0,
    )
    value = json.loads(response.output_text)
    jsonschema.validate(value, schema)
    assert set(value) == {"name"}


def test_previous_response_id_continues_the_stored_conversation(client, stack):
    first = client.responses.create(model="lamina-tiny", input="Tell me a story.", **GREEDY)
    second = client.responses.create(
        model="lamina-tiny", previous_response_id=first.id, input="And then?", **GREEDY
    )
    chat = client.chat.completions.create(
        model="lamina-tiny",
        messages=[
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        temperature=0,
        max_tokens=8,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(
            model="lamina-tiny", previous_response_id="resp_nope", input="x", **GREEDY
        )
    assert missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="lamina-tiny", input="x", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_what_it_cannot_do_is_a_400_naming_the_field(stack):
    url = stack.base_url + "/v1/responses"
    for body, param in (
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ):
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.json()
