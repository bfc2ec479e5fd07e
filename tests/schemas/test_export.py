"""``lamina schemas export DIR``: one JSON Schema per v1 type plus a combined one."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

import pytest

from lamina.schemas import v1
from lamina.schemas.export import COMBINED_NAME, JSON_SCHEMA_DIALECT, main, message_types
from lamina.schemas.v1.base import Message
from lamina.services import cli

GOLDEN_DIR = Path(__file__).parent / "golden"


def all_subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in (direct, *all_subclasses(direct))}


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("schemas") / "out"  # missing: export creates it
    assert main([str(out)]) == 0
    return out


def test_discovers_every_v1_message_type() -> None:
    for info in pkgutil.iter_modules(v1.__path__, prefix=f"{v1.__name__}."):
        importlib.import_module(info.name)
    in_v1 = {t for t in all_subclasses(Message) if t.__module__.startswith(f"{v1.__name__}.")}
    assert set(message_types()) == in_v1
    assert len(in_v1) >= 20  # sanity: the discovery really walked the package


def test_writes_one_file_per_type_and_a_combined_one(exported: Path) -> None:
    expected = {f"{t.__name__}.json" for t in message_types()} | {COMBINED_NAME}
    assert {p.name for p in exported.iterdir()} == expected


@pytest.mark.parametrize("message_type", message_types(), ids=lambda t: t.__name__)
def test_type_schema_is_a_self_contained_json_schema(exported: Path, message_type: type) -> None:
    name = message_type.__name__
    schema = json.loads((exported / f"{name}.json").read_text())
    assert schema["$schema"] == JSON_SCHEMA_DIALECT
    assert schema["$ref"] == f"#/$defs/{name}"
    definition = schema["$defs"][name]
    assert definition["title"] == name
    assert definition["type"] == "object"
    assert definition["properties"]["type"] == {"enum": [name]}  # the wire tag
    assert "type" in definition["required"]
    for ref in refs(schema):
        assert ref.startswith("#/$defs/") and ref.removeprefix("#/$defs/") in schema["$defs"]
    # The golden payload fits: it names only known fields and has every required one.
    golden = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    assert set(golden) <= set(definition["properties"])
    assert set(definition["required"]) <= set(golden)


def test_combined_schema_names_every_type_once(exported: Path) -> None:
    schema = json.loads((exported / COMBINED_NAME).read_text())
    names = [t.__name__ for t in message_types()]
    assert schema["$schema"] == JSON_SCHEMA_DIALECT
    assert [entry["$ref"] for entry in schema["anyOf"]] == [f"#/$defs/{n}" for n in names]
    assert schema["discriminator"]["propertyName"] == "type"
    assert sorted(schema["discriminator"]["mapping"]) == sorted(names)
    for ref in refs(schema):
        assert ref.removeprefix("#/$defs/") in schema["$defs"]


def test_export_is_deterministic(exported: Path, tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    for path in exported.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_missing_dir_is_a_usage_error(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: lamina schemas export" in err and "DIR" in err


def test_lamina_cli_dispatches_to_export(tmp_path: Path) -> None:
    assert cli.main(["schemas", "export", str(tmp_path)]) == 0
    assert (tmp_path / COMBINED_NAME).exists()
