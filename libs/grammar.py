"""Structured output constraints as the grammar engine (llguidance) reads them.

The one owner of the mapping from a wire :class:`StructuredOutput` to a grammar: the
gateway calls :func:`check` before any worker is used (no vocabulary needed), the worker
:func:`grammar_text` to build a matcher for its model's vocabulary.

llguidance was chosen over xgrammar by measurement (``benchmarks/structured.py
--engines``, ``docs/architecture.md``, "Decisions"): it refuses a JSON Schema keyword it cannot
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

WHITESPACE = r"[\n\t ]{0,16}"
"""What may stand between a JSON value's tokens by default: enough to pretty-print, not
enough for a model to fill its budget with blanks inside a valid object (Outlines bounds
it too; ``disable_any_whitespace`` allows none)."""


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile or enforce."""


def grammar_text(spec: StructuredOutput) -> str:
    """``spec`` as an llguidance grammar (what ``LLMatcher`` takes); raises
    :class:`GrammarError` for one that does not even parse."""
    try:
        if spec.json is not None or spec.json_object:
            schema = _ANY_OBJECT if spec.json is None else _schema_text(spec.json)
            if schema in ("true", "false"):  # no object to carry options: nothing to bound
                return llguidance.grammar_from("json_schema", schema)
            if spec.disable_any_whitespace:  # no optional whitespace: {"a":1}
                defaults: dict[str, object] = {"whitespace_flexible": False}
            else:
                defaults = {"whitespace_pattern": WHITESPACE}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
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
    """``text`` as a JSON Schema document (an object or a boolean), its objects closed
    where they do not say otherwise (:func:`_closed`)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a schema is an object or a boolean, not {type(schema).__name__}")
    try:
        return json.dumps(_closed(schema))
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` (or ``patternProperties``) and says nothing of others: the listed keys
    only, as vLLM's default backend and OpenAI's strict mode read a schema (JSON Schema
    itself would allow any other key, which a model then invents). Only subschemas are
    visited: a ``const``, ``enum`` or ``default`` value is data, left as it is."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            closed[key] = _closed(schema[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_closed(item) for item in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed(sub) for name, sub in schema[key].items()}
    listed = "properties" in schema or "patternProperties" in schema
    if listed and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object"}


def _reason(spec: StructuredOutput, message: str) -> str:
    """An engine message about ``spec`` on one line (it may quote the grammar over
    several), bounded, naming the kind of constraint it is about."""
    kind = spec.kinds[0]
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"{_KIND_NAMES.get(kind, kind)}: {text}"[:500]
