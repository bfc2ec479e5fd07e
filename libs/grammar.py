"""Structured output constraints as the grammar engine (llguidance) reads them.

The one owner of the mapping from a wire :class:`StructuredOutput` to a grammar: the
gateway calls :func:`check` before any worker is used (no vocabulary needed), the worker
:func:`grammar_text` to build a matcher for its model's vocabulary.

llguidance was chosen over xgrammar by measurement (``benchmarks/structured.py
--engines``, ``docs/architecture.md``): it refuses a JSON Schema keyword it cannot
enforce (xgrammar accepts ``multipleOf`` or ``uniqueItems`` and ignores them, so output
could break the schema), it fills the masks of a whole batch in one call that releases the
GIL, and it installs without dependencies (xgrammar needs ``transformers`` and
``triton``: a gigabyte in every image).
"""

from __future__ import annotations

import json

import llguidance

from lamina.schemas.v1.generate import StructuredOutput

_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile or enforce."""


def grammar_text(spec: StructuredOutput) -> str:
    """``spec`` as an llguidance grammar (what ``LLMatcher`` takes); raises
    :class:`GrammarError` for one that does not even parse."""
    try:
        if spec.json is not None or spec.json_object:
            schema = _ANY_OBJECT if spec.json is None else _schema_text(spec.json)
            if spec.disable_any_whitespace:  # no optional whitespace: {"a":1}
                return llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False}
                )
            return llguidance.grammar_from("json_schema", schema)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        assert spec.grammar is not None  # StructuredOutput holds exactly one constraint
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark or GBNF
    except (ValueError, TypeError) as exc:
        raise GrammarError(_reason(spec, str(exc))) from exc


def check(spec: StructuredOutput) -> str:
    """``spec``'s grammar; raises :class:`GrammarError` naming what is wrong if it cannot
    be enforced (invalid, or a JSON Schema keyword the engine does not implement)."""
    grammar = grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(_reason(spec, error))
    return grammar


def _schema_text(text: str) -> str:
    """``text`` if it is a JSON Schema document (an object or a boolean)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a schema is an object or a boolean, not {type(schema).__name__}")
    return text


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object"}


def _reason(spec: StructuredOutput, message: str) -> str:
    """An engine message about ``spec`` on one line (it may quote the grammar over
    several), bounded, naming the kind of constraint it is about."""
    kind = spec.kinds[0]
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"{_KIND_NAMES.get(kind, kind)}: {text}"[:500]
