"""Service configuration from one frozen dataclass: CLI flags over ``LAMINA_*`` variables
over the field defaults. Each field's docstring-style comment is its ``--help`` text."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")

ENV_PREFIX = "LAMINA_"


def lamina_home() -> Path:
    """Lamina's cache root (default models, compiled kernels): ``$LAMINA_HOME``, by default
    ``~/.cache/lamina``."""
    return Path(os.environ.get("LAMINA_HOME", Path.home() / ".cache" / "lamina"))


def _base_type(annotation: Any) -> Any:
    """``int | None`` → ``int``; ``Path`` → ``Path``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _convert(kind: Any, raw: str, name: str) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: {raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {raw!r} is not a valid {kind.__name__}") from exc


def parse_config(
    cls: type[C],
    argv: list[str] | None = None,
    prog: str | None = None,
    env: dict[str, str] | None = None,
) -> C:
    """Build ``cls`` (a dataclass) from ``argv`` and the environment."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    for field in dataclasses.fields(cls):
        kind = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        env_name = ENV_PREFIX + field.name.upper()
        help_text += f" (env {env_name})"
        if kind is bool:
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                help=help_text,
                type=lambda raw, k=kind, n=field.name: _convert(k, raw, n),
            )
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        value = getattr(args, field.name)
        env_value = env.get(ENV_PREFIX + field.name.upper())
        if value is None and env_value not in (None, ""):
            kind = _base_type(hints[field.name])
            value = _convert(kind, env_value, ENV_PREFIX + field.name.upper())
        if value is not None:
            values[field.name] = value
    return cls(**values)


def option(default: Any, help: str) -> Any:
    """A dataclass field with ``--help`` text."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help})
