"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``), as vLLM serves it: text, streamed events, function tools,
structured output (``text.format``) and ``previous_response_id`` over stored responses.

A response is a chat completion underneath: its input items (and, with
``previous_response_id``, the stored conversation before them) become chat messages, its
tools and ``text.format`` the chat's ``tools`` and ``response_format``, and the one
stream the chat opens is read into output items (a ``message`` with ``output_text``,
``function_call`` items) or, streamed, into the Responses API's events. Stored responses
live in the gateway that answered them (bounded, least recently used first out): with
several gateways, a ``previous_response_id`` must reach the same one (sticky routing),
or it is a 404.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from litestar.types import Receive, Scope, Send

from lamina.libs.bounded import BoundedDict
from lamina.schemas.v1.generate import FinishReason, MaxTokens, Temperature, TopP, Usage
from lamina.services.gateway.asgi import (
    REQUEST_ID,
    ClientWatch,
    end_body,
    send_json,
    start_events,
)
from lamina.services.gateway.errors import GenerationError, InvalidRequest
from lamina.services.gateway.protocol import ChatCompletionRequest
from lamina.services.gateway.replies import error_of, retry_headers, whole
from lamina.services.gateway.text_stream import TextDelta, TextStream

if TYPE_CHECKING:
    from lamina.services.gateway.completions import CompletionsApi

STORED_RESPONSES = 1024
"""Responses one gateway keeps for ``previous_response_id`` and ``GET``."""

_json = msgspec.json.Encoder()


class FormatSpec(msgspec.Struct, kw_only=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: FormatSpec | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A function tool, the Responses API's flat form."""

    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``' body (the fields Lamina serves; others are refused or
    ignored as for chat completions)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    """A system message before the input (not carried over by ``previous_response_id``)."""
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Annotated[str, msgspec.Meta(max_length=512)]] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    """``auto`` (drop the oldest input to fit) is not implemented."""
    background: Literal[False] | None = None
    """Background responses are not implemented."""


@dataclass
class Stored:
    """A stored response: its body, and the conversation that continues from it."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    """The chat messages it answered, then its own output as an assistant message."""


def _text_of(content: Any, where: str) -> str:
    """A message's content: text, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise InvalidRequest("only text content parts are supported", f"{where}[{i}]")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequest("content must be text or a list of text parts", where)


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages: messages, function calls (an assistant message's
    ``tool_calls``, consecutive calls in one) and their outputs (``tool`` messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise InvalidRequest("a message needs a role", f"input[{i}].role")
            content = _text_of(item.get("content", ""), f"input[{i}].content")
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": str(item.get("name")), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": output if isinstance(output, str) else _json.encode(output).decode(),
                }
            )
        else:
            raise InvalidRequest(
                f"input items of type {str(kind)[:64]!r} are not supported (message, "
                "function_call, function_call_output)",
                f"input[{i}].type",
            )
    return messages


def _chat_body(request: ResponsesRequest, asked: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion a response is, as a body (``asked``: the conversation)."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"messages": [*messages, *asked]}
    for name, value in (
        ("model", request.model),
        ("max_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("parallel_tool_calls", request.parallel_tool_calls),
        ("user", request.user),
    ):
        if value is not None:
            body[name] = value
    if request.tools:  # the chat's nested form of each function tool
        body["tools"] = [
            {"type": "function", "function": _without(msgspec.to_builtins(tool), "type")}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    spec = request.text.format if request.text else None
    if spec is not None and spec.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif spec is not None and spec.type == "json_schema":
        schema = {"name": spec.name or "output", "schema": spec.schema, "strict": spec.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def _without(fields: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k != name and v is not None}


@dataclass
class _Output:
    """A response's output items as they are built (streamed or not)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    message: dict[str, Any] | None = None
    """The open message item, while text comes."""

    def open_message(self) -> dict[str, Any]:
        self.message = {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(self.message)
        return self.message

    def close_message(self) -> dict[str, Any] | None:
        message, self.message = self.message, None
        if message is not None:
            message["status"] = "completed"
            message["content"] = [_output_text("".join(self.text))]
        return message

    def call(self, call: Any) -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        return item


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesApi:
    """The Responses API's routes over one :class:`CompletionsApi` (its intake, its
    tool-call parser) and a bounded store of responses."""

    def __init__(self, api: CompletionsApi) -> None:
        self.api = api
        self.stored: BoundedDict[str, Stored] = BoundedDict(STORED_RESPONSES)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``, body to last byte, as the completion routes serve."""
        read = await self.api.read_request(scope, receive, send, lambda _: ResponsesRequest)
        if read is None:
            return
        request, headers = read
        key = uuid.uuid4().hex
        if scope.get(REQUEST_ID) is None:
            scope[REQUEST_ID] = key
        response_id = "resp_" + key
        status, payload = 200, None
        with ClientWatch(receive) as client:
            try:
                chat, asked = self._chat(request)
                (stream,) = await self.api.open_in_callers_trace(chat, scope, key)
            except GenerationError as exc:
                status, payload = exc.status, error_of(exc)
                headers += retry_headers(exc)
            else:
                body = self._envelope(request, response_id)

                def finish(output: _Output, last: TextDelta) -> dict[str, Any]:
                    return self._finish(body, output, last, request, asked)

                try:
                    if request.stream:
                        await self._stream(stream, body, send, headers, finish)
                    else:
                        try:
                            delta = await whole(stream)
                        except GenerationError as exc:
                            status, payload = exc.status, error_of(exc)
                        else:
                            output = _Output()
                            if delta.text:
                                output.open_message()
                                output.text.append(delta.text)
                                output.close_message()
                            for call in delta.tool_calls or ():
                                output.call(call)
                            payload = finish(output, delta)
                finally:
                    self.api.intake.close_later(stream)
        if client.disconnected:
            return
        if payload is not None:
            await send_json(send, status, payload, headers)
        else:
            await end_body(send)

    def _chat(self, request: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict]]:
        """The chat completion ``request`` is, and the conversation it asks about (the
        stored one before it, then its input), without the instructions."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.stored.get(request.previous_response_id)
            if stored is None:
                raise GenerationError(
                    404,
                    "not_found_error",
                    f"previous response {request.previous_response_id[:80]!r} is not stored "
                    "on this gateway",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            self.stored.move_to_end(request.previous_response_id)
            history = [m for m in stored.messages if m["role"] != "system"]
        try:
            asked = [*history, *_messages(request.input)]
            chat = msgspec.convert(_chat_body(request, asked), ChatCompletionRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid request body: {exc}") from exc
        return chat, asked

    def _envelope(self, request: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object as it stands before any output (``in_progress``)."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.api.intake.model_name,
            "output": [],
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": [msgspec.to_builtins(t) for t in request.tools or ()],
            "tool_choice": msgspec.to_builtins(request.tool_choice or "auto"),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": msgspec.to_builtins(request.text)
            if request.text
            else {"format": {"type": "text"}},
            "store": request.store,
            "metadata": request.metadata or {},
            "truncation": "disabled",
            "incomplete_details": None,
            "error": None,
            "usage": None,
            "user": request.user,
        }

    def _finish(
        self,
        body: dict[str, Any],
        output: _Output,
        last: TextDelta,
        request: ResponsesRequest,
        asked: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The completed response (stored, where asked)."""
        body["output"] = output.items
        body["usage"] = _usage(last.usage)
        if last.finish_reason == FinishReason.LENGTH:
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        if request.store:
            said = "".join(output.text) or None
            calls = [
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
                for item in output.items
                if item["type"] == "function_call"
            ]
            reply: dict[str, Any] = {"role": "assistant", "content": said}
            if calls:
                reply["tool_calls"] = calls
            self.stored[body["id"]] = Stored(body, [*asked, reply])
        return body

    async def _stream(
        self,
        stream: TextStream,
        body: dict[str, Any],
        send: Send,
        headers: list[tuple[bytes, bytes]],
        finish: Callable[[_Output, TextDelta], dict[str, Any]],
    ) -> None:
        """The Responses API's events, from ``response.created`` to ``response.completed``
        (or an ``error`` event); ``finish`` completes the response from its output."""
        await start_events(send, headers)
        sequence = 0

        async def emit(kind: str, **fields: Any) -> None:
            nonlocal sequence
            event = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            data = b"event: " + kind.encode() + b"\ndata: " + _json.encode(event) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await emit("response.created", response=body)
        await emit("response.in_progress", response=body)
        output, last = _Output(), TextDelta("", [], None)

        async def close_message() -> None:
            index = len(output.items) - 1
            message = output.close_message()
            if message is None:
                return
            part = message["content"][0]
            ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
            await emit("response.output_text.done", text=part["text"], logprobs=[], **ids)
            await emit("response.content_part.done", part=part, **ids)
            await emit("response.output_item.done", output_index=index, item=message)

        try:
            async for delta in stream.deltas():
                last = delta
                if delta.text:
                    if output.message is None:
                        message = output.open_message()
                        index = len(output.items) - 1
                        await emit("response.output_item.added", output_index=index, item=message)
                        await emit(
                            "response.content_part.added",
                            item_id=message["id"],
                            output_index=index,
                            content_index=0,
                            part=_output_text(""),
                        )
                    output.text.append(delta.text)
                    await emit(
                        "response.output_text.delta",
                        item_id=output.message["id"],  # type: ignore[index]
                        output_index=len(output.items) - 1,
                        content_index=0,
                        delta=delta.text,
                        logprobs=[],
                    )
                for call in delta.tool_calls or ():
                    await close_message()
                    item = output.call(call)
                    index = len(output.items) - 1
                    added = item | {"arguments": "", "status": "in_progress"}
                    await emit("response.output_item.added", output_index=index, item=added)
                    ids = {"item_id": item["id"], "output_index": index}
                    await emit(
                        "response.function_call_arguments.delta", delta=call.arguments, **ids
                    )
                    await emit(
                        "response.function_call_arguments.done", arguments=call.arguments, **ids
                    )
                    await emit("response.output_item.done", output_index=index, item=item)
            await close_message()
        except GenerationError as exc:
            error = error_of(exc)["error"]
            await emit("error", code=error["code"], message=error["message"], param=error["param"])
            return
        done = finish(output, last)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        await emit(kind, response=done)

    # ------------------------------------------------------------------- stored responses
    def get(self, response_id: str) -> dict[str, Any] | None:
        stored = self.stored.get(response_id)
        return None if stored is None else stored.body

    def delete(self, response_id: str) -> bool:
        return self.stored.pop(response_id, None) is not None
