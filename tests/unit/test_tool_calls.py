"""Tool calls: the parsers (whole and streamed a character at a time alike), the
constraint a required call decodes under, and the default chat template, which renders
tools and calls exactly as ``transformers`` does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lamina.schemas.v1.generate import FinishReason
from lamina.services.gateway.text_stream import TextDelta
from lamina.services.gateway.tool_calls import (
    ConstrainedParser,
    HermesParser,
    Llama3JsonParser,
    ToolParser,
    tool_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather <in> a city & 'region'",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def run(parser: ToolParser, text: str, chunk: int, finish=FinishReason.STOP):
    """Feed ``text`` in ``chunk``-character deltas; (content, calls, finish reason)."""
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)] or [""]
    content, calls, finish_reason = [], [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = parser.apply(TextDelta(piece, [], None, finish if last else None))
        content.append(out.text)
        calls += out.tool_calls or []
        finish_reason = out.finish_reason
    return (
        "".join(content),
        [(c.index, c.name, json.loads(c.arguments)) for c in calls],
        finish_reason,
    )


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("chunk", [1, 3, 7, len(HERMES)])
def test_hermes_calls_are_found_however_the_text_is_split(chunk):
    content, calls, finish = run(HermesParser(), HERMES, chunk)
    assert content == "Let me check.\n\n"
    assert calls == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert finish == "tool_calls"


def test_hermes_holds_back_only_what_may_start_a_call():
    parser = HermesParser()
    out = parser.apply(TextDelta("a < b, and <tool", [], None))
    assert out.text == "a < b, and " and out.tool_calls is None
    out = parser.apply(TextDelta("box> is not a call", [], None))
    assert out.text == "<toolbox> is not a call"
    # Not a call inside the tags: content, as it was written; a plain stop stays stop.
    text = "<tool_call>not json</tool_call> done"
    assert run(HermesParser(), text, 2) == (text, [], FinishReason.STOP)
    # Stopped before the closing tag: the call still counts if its JSON is whole.
    truncated = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    assert run(HermesParser(), truncated, 4)[1] == [(0, "get_time", {})]
    # Cut off by max_tokens: what there is, as content, and finish "length".
    cut = '<tool_call>{"name": "get_we'
    assert run(HermesParser(), cut, 5, FinishReason.LENGTH) == (cut, [], FinishReason.LENGTH)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_llama3_json_calls_and_plain_text(chunk):
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    content, calls, finish = run(Llama3JsonParser(), text, chunk)
    assert content == "" and finish == "tool_calls"
    assert calls == [(0, "get_weather", {"city": "Oslo; Norway"}), (1, "get_time", {})]
    # Text that is not JSON streams as content at once, without waiting for the end.
    parser = Llama3JsonParser()
    assert parser.apply(TextDelta("Hello", [], None)).text == "Hello"
    assert run(Llama3JsonParser(), '{"not": "a call"}', chunk)[:2] == ('{"not": "a call"}', [])


def test_a_constrained_output_is_read_as_exactly_its_calls():
    required = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert run(ConstrainedParser(None), required, 4)[1] == [(0, "get_weather", {"city": "Rome"})]
    named = '{"city": "Lima", "unit": "C"}'
    assert run(ConstrainedParser("get_weather"), named, 3)[1] == [
        (0, "get_weather", {"city": "Lima", "unit": "C"})
    ]
    cut = '[{"name": "get_wea'
    assert run(ConstrainedParser(None), cut, 3, FinishReason.LENGTH)[:2] == (cut, [])


def test_the_required_constraint_admits_exactly_calls_of_the_given_tools():
    schema = json.loads(tool_constraint([WEATHER, TIME], None, parallel=True).json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    two = [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"c": 1}}]
    with pytest.raises(jsonschema.ValidationError):  # get_weather needs its city
        jsonschema.validate(two, schema)
    two[1]["parameters"] = {"city": "y"}
    jsonschema.validate(two, schema)
    unknown, incomplete = {"name": "other", "parameters": {}}, {"name": "get_weather"}
    for bad in ([], [unknown], [incomplete]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tool_constraint([WEATHER, TIME], None, parallel=False).json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    named = json.loads(tool_constraint([WEATHER], "get_weather", parallel=True).json)
    assert named == WEATHER["function"]["parameters"]
    assert json.loads(tool_constraint([TIME], "get_time", True).json) == {"type": "object"}


def test_the_default_template_renders_tools_and_calls_as_transformers_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from lamina.libs.default_tokenizer import CHAT_TEMPLATE, write_tokenizer
    from lamina.services.gateway.protocol import ChatCompletionRequest, decode_body
    from lamina.services.gateway.tokenizer import ModelTokenizer

    write_tokenizer(tmp_path)
    ours = ModelTokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=CHAT_TEMPLATE
    )
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        ],
        "tools": [WEATHER, TIME],
    }  # fmt: skip
    request = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
    messages, tools = request.chat_prompts()[0].messages, request.template_tools()
    rendered = ours.render_chat(messages, tools=tools)
    assert rendered == theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert json.dumps(WEATHER) in rendered  # the tool, as the client sent it
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\nnoon\n</tool_response>" in rendered
    # Without tools, the template is plain ChatML, as before.
    plain = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
