"""``lamina schemas export DIR``: JSON Schema for every v1 wire type.

Writes ``DIR/<TypeName>.json`` (one self-contained schema per concrete message type) and
``DIR/lamina.v1.json`` (every type at once: ``anyOf`` over the types, shared ``$defs``), so
clients in other languages can generate or validate against the same contract.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path
from typing import Union

import msgspec

from lamina.schemas import v1
from lamina.schemas.v1.base import Message

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
COMBINED_NAME = "lamina.v1.json"


def message_types() -> list[type[Message]]:
    """Every concrete v1 message type (a :class:`Message` subclass defined in a module of
    ``lamina.schemas.v1``), sorted by name. Tags are class names, so names are unique."""
    found: dict[str, type[Message]] = {}
    for info in pkgutil.iter_modules(v1.__path__, prefix=f"{v1.__name__}."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Message)
                and obj is not Message
                and obj.__module__ == module.__name__
            ):
                if name in found and found[name] is not obj:
                    raise RuntimeError(f"two v1 message types are called {name!r}")
                found[name] = obj
    return [found[name] for name in sorted(found)]


def type_schema(message_type: type[Message]) -> dict:
    """One type's schema, self-contained (its nested structs under ``$defs``)."""
    return {"$schema": JSON_SCHEMA_DIALECT, **msgspec.json.schema(message_type)}


def combined_schema(types: list[type[Message]]) -> dict:
    """Any v1 message: ``anyOf`` over every type with a ``discriminator`` on the ``type``
    tag, all definitions in one ``$defs``."""
    any_message = Union[tuple(types)]  # noqa: UP007 - built at runtime from a tuple
    (union,), components = msgspec.json.schema_components(
        [any_message], ref_template="#/$defs/{name}"
    )
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "lamina.v1",
        "description": "Any Lamina v1 wire message, tagged by class name in `type`.",
        **union,
        "$defs": components,
    }


def write(directory: Path) -> list[Path]:
    """Write every schema file into ``directory`` (created if missing); return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    types = message_types()
    documents = {f"{t.__name__}.json": type_schema(t) for t in types}
    documents[COMBINED_NAME] = combined_schema(types)
    written = []
    for filename, document in documents.items():
        path = directory / filename
        path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lamina schemas export",
        description="Write a JSON Schema file per v1 wire type, plus "
        f"{COMBINED_NAME} with all of them.",
    )
    parser.add_argument("dir", metavar="DIR", type=Path, help="output directory")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage error (2) or --help (0): argparse has printed why
        return int(exc.code or 0)
    written = write(args.dir)
    print(f"wrote {len(written)} schema files to {args.dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
