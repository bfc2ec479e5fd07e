"""Tool calls: the constraint a ``tool_choice`` asks for, and the parsers that find tool
calls in generated text, streamed (vLLM's parsers, by vLLM's names).

A parser sees the text of a chat stream delta by delta and splits it into content, which
may go to the client at once, and complete tool calls; it holds back only what could
still turn out to be part of a call. With ``tool_choice`` ``required`` or a named
function, the request carries a structured output constraint (:func:`tool_constraint`)
that guarantees the call, and its output is read as exactly that call.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

from lamina.schemas.v1.generate import FinishReason, StructuredOutput


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; ``arguments`` is JSON text (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    index: int = 0
    """Its place among the stream's calls (a streamed delta names it)."""

    def body(self, streaming: bool = False) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with its ``index`` in a streamed delta)."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"index": self.index, **call} if streaming else call


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` as a call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # already JSON text (some models write it so)
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """Splits a stream's text into content and tool calls; :meth:`apply` maps one
    stream delta."""

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """More generated text: (content to send now, calls completed in it)."""

    @abstractmethod
    def flush(self) -> tuple[str, list[ToolCall]]:
        """The stream ended: what was held back, as content or calls."""

    def apply(self, delta: Any) -> Any:
        """``delta`` (a ``TextDelta``) with its text split into content and
        ``tool_calls``; a stream that made calls and stopped finishes ``tool_calls``."""
        text, calls = self.feed(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            held, more = self.flush()
            text, calls = text + held, calls + more
        calls = [replace(call, index=self.calls + i) for i, call in enumerate(calls)]
        self.calls += len(calls)
        if finish == FinishReason.STOP and self.calls:
            finish = "tool_calls"
        return replace(delta, text=text, tool_calls=calls or None, finish_reason=finish)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the text
    (Hermes, Qwen; vLLM's ``hermes``). A call that does not parse stays content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        buffer, content, calls = self._held + text, [], []
        while True:
            if not self._inside:
                start = buffer.find(self.START)
                if start < 0:  # keep back what may be the start of a START
                    keep = _partial_suffix(buffer, self.START)
                    content.append(buffer[: len(buffer) - keep])
                    buffer = buffer[len(buffer) - keep :]
                    break
                content.append(buffer[:start])
                buffer, self._inside = buffer[start + len(self.START) :], True
            end = buffer.find(self.END)
            if end < 0:
                break
            body = buffer[:end]
            call = _call(_loads(body))
            if call is None:
                content.append(self.START + body + self.END)
            else:
                calls.append(call)
            buffer, self._inside = buffer[end + len(self.END) :], False
        self._held = buffer
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        held, inside = self._held, self._inside
        self._held, self._inside = "", False
        if inside:  # the model stopped before the closing tag
            call = _call(_loads(held))
            return ("", [call]) if call else (self.START + held, [])
        return held, []


class Llama3JsonParser(ToolParser):
    """Output that is JSON calls, ``{"name": ..., "parameters": {...}}``, several joined
    by ``;`` (Llama 3.1+; vLLM's ``llama3_json``), optionally after ``<|python_tag|>``.
    Text that does not start with ``{`` is content, streamed as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._mode: str | None = None  # None: undecided, "json" or "text"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._held += text
        head = self._held.lstrip()
        if head.startswith(self.TAG):
            head = head[len(self.TAG) :].lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return "", []  # undecided yet
        if head.startswith("{"):
            self._mode = "json"
            return "", []
        self._mode, held, self._held = "text", self._held, ""
        return held, []

    def flush(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._mode != "json":
            return held, []
        body = held.lstrip().removeprefix(self.TAG)
        calls = [_call(_loads(part), "parameters") for part in _split_calls(body)]
        if calls and all(calls):
            return "", calls  # type: ignore[return-value]
        return held, []


class ConstrainedParser(ToolParser):
    """Output made under :func:`tool_constraint`: a JSON array of calls
    (``required``) or one function's arguments (a named function)."""

    def __init__(self, function: str | None) -> None:
        super().__init__()
        self.function = function
        self._held: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held.append(text)
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        text, self._held = "".join(self._held), []
        value = _loads(text)
        if self.function is not None:
            if isinstance(value, dict):
                return "", [ToolCall(self.function, json.dumps(value, ensure_ascii=False))]
            return text, []
        calls = [_call(c, "parameters") for c in value] if isinstance(value, list) else []
        if calls and all(calls):
            return "", calls  # type: ignore[return-value]
        return text, []  # cut short (length): the text as it is


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
"""Parsers for ``tool_choice: auto``, by vLLM's ``--tool-call-parser`` names."""


def tool_constraint(
    tools: list[dict[str, Any]], function: str | None, parallel: bool
) -> StructuredOutput:
    """The constraint that makes the output a call: of ``function`` (its arguments, as
    its parameters schema says), or of any of ``tools`` (``required``: a JSON array of
    ``{"name", "parameters"}``, one call unless ``parallel``)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if function is not None:
        return StructuredOutput(json=json.dumps(params[function] or {"type": "object"}))
    # Each tool's parameters become a definition of the array's schema, their own local
    # references rebased onto it: a "#/$defs/X" inside them means the tool's own $defs,
    # not the array's.
    defs = {
        f"tool{i}": _rebased(schema, f"#/$defs/tool{i}") for i, schema in enumerate(params.values())
    }
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, name in enumerate(params)
    ]
    array: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": one_of},
        "minItems": 1,
        "$defs": defs,
    }
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput(json=json.dumps(array))


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` (``{}``: any object) with every local ``$ref`` (``#...``) made relative
    to ``root``, where the schema now lives inside a larger one."""
    if schema == {}:
        return {"type": "object"}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: walk(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out

    return walk(schema)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _split_calls(body: str) -> list[str]:
    """``body``'s JSON objects, split where ``;`` separates them (not inside strings)."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
