"""Service configuration from frozen dataclasses: CLI flags over ``LAMINA_*`` variables over
the field defaults.

A field whose type is itself a dataclass (the worker's ``engine: EngineConfig``) is
flattened: each of its fields is a flag and a variable of its own (``--max-num-seqs``,
``LAMINA_MAX_NUM_SEQS``), so a setting is declared once, where it is used, and is reachable
from every command that embeds it. A field's ``--help`` text is its ``option(help=...)`` or
else its attribute docstring (the string literal on the line after it). A dataclass with a
``parse`` classmethod is one flag instead, parsed from its text (the engine's
``--speculative-config``, JSON), and its ``str`` is that text again.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import itertools
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")

ENV_PREFIX = "LAMINA_"


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """Settings every Lamina process reads from its environment (``LAMINA_<FIELD>``), not
    from flags: they reach code below any service's config (the kernels' dispatch) or are
    needed before a config is parsed (logging). Declared here and read only here, by
    :func:`process_env`; a service's own settings are its config's fields."""

    home: str = ""
    """Lamina's cache root (default models, compiled kernels); empty: ``~/.cache/lamina``."""
    log_format: typing.Literal["text", "json"] = "text"
    """Log lines as text, or as JSON objects."""
    log_level: str = "INFO"
    trace_file: str = ""
    """Also write every span to this file, one JSON object a line (the tests' trace store)."""
    kernels: str = ""
    """The kernel backend (``lamina.kernels.dispatch.BACKENDS``); empty: by device and dtype."""
    cpu_linear: str = ""
    """What runs an fp32 linear on the CPU (``lamina.kernels.linear.CHOICES``); empty: the
    fastest available."""
    restarts: int = 0
    """How many times ``lamina up`` has restarted this service (set by it; telemetry counts
    them)."""
    parent_pid: int = 0
    """The supervisor this service dies with (set by ``lamina up``; 0: none)."""


def env_name(field: str) -> str:
    """The variable a :class:`ProcessEnv` field (or a config field) is read from."""
    return ENV_PREFIX + field.upper()


def process_env(env: typing.Mapping[str, str] | None = None) -> ProcessEnv:
    """The process's :class:`ProcessEnv` (read at each call: it is a few lookups, and a
    test may change the environment)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(ProcessEnv)
    values = {}
    for field in dataclasses.fields(ProcessEnv):
        name = env_name(field.name)
        raw = env.get(name, "").strip()
        if raw:
            values[field.name] = _convert(hints[field.name], raw, name)
    return ProcessEnv(**values)


def lamina_home() -> Path:
    """Lamina's cache root (default models, compiled kernels): ``$LAMINA_HOME``, by default
    ``~/.cache/lamina``."""
    return Path(process_env().home or Path.home() / ".cache" / "lamina")


def option(default: Any, help: str) -> Any:
    """A dataclass field with ``--help`` text."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One flag: a leaf field of a (possibly nested) config dataclass."""

    path: tuple[str, ...]
    """Attribute names from the top-level config down to the field."""
    kind: Any
    """The field's type without ``| None``."""
    help: str
    default: Any = None
    """The field's default (None: none worth showing)."""

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.name)

    def value(self, config: Any) -> Any:
        for attr in self.path:
            config = getattr(config, attr)
        return config


def settings(cls: type) -> list[Setting]:
    """Every flag of config class ``cls``, nested dataclasses flattened, in field order."""
    return list(_settings(cls, ()))


def _settings(cls: type, prefix: tuple[str, ...]) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    for field in dataclasses.fields(cls):
        kind = _base_type(hints[field.name])
        if _nested(kind):
            yield from _settings(kind, (*prefix, field.name))
        else:
            help_text = field.metadata.get("help") or docs.get(field.name, "")
            default = field.default
            if field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            yield Setting((*prefix, field.name), kind, plain(help_text), default)


def _attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for fields followed by a string literal in ``cls``'s source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen app): flags without help text
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_MARKUP = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without Sphinx markup (``:mod:`x```, double backticks), for ``--help``."""
    return _MARKUP.sub(lambda m: m.group(1) or m.group(2), text)


def _help(setting: Setting) -> str:
    """A flag's ``--help`` line: what it does, its default where it has one worth showing,
    and its environment variable (``%`` escaped for argparse)."""
    shown = setting.default
    if shown in (None, "", dataclasses.MISSING) or isinstance(shown, list | dict | set):
        extra = f"env {setting.env}"
    else:
        if isinstance(shown, bool):
            shown = "yes" if shown else "no"
        extra = f"default: {shown}; env {setting.env}"
    return f"{setting.help} ({extra})".lstrip().replace("%", "%%")


def _base_type(annotation: Any) -> Any:
    """``int | None`` → ``int``; ``Path`` → ``Path``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _nested(kind: Any) -> bool:
    """Whether a field of type ``kind`` is a config of its own, whose fields are flags;
    not one that parses from one flag's text (a ``parse`` classmethod, such as JSON)."""
    return dataclasses.is_dataclass(kind) and not hasattr(kind, "parse")


def _convert(kind: Any, raw: str, name: str) -> Any:
    if hasattr(kind, "parse"):  # its own text form (its ``str`` gives it back)
        return kind.parse(raw)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: {raw!r} is not a boolean")
    choices = _choices(kind)
    if choices is not None:  # a closed set: a Literal of strings or a string enum
        if raw in choices:
            return kind(raw) if isinstance(kind, type) else raw
        raise ValueError(f"{name}: {raw!r} is not one of {', '.join(choices)}")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {raw!r} is not a valid {kind.__name__}") from exc


def _choices(kind: Any) -> tuple[str, ...] | None:
    """The values of a closed set (``Literal["a", "b"]``, a ``StrEnum``), or None."""
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return tuple(str(member.value) for member in kind)
    return None


def _argument(kind: Any, name: str) -> Callable[[str], Any]:
    """An argparse ``type`` that says what is wrong with a value (argparse would say
    only "invalid value")."""

    def convert(raw: str) -> Any:
        try:
            return _convert(kind, raw, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def parse_config(
    cls: type[C],
    argv: list[str] | None = None,
    prog: str | None = None,
    env: dict[str, str] | None = None,
) -> C:
    """Build ``cls`` (a dataclass) from ``argv`` and the environment."""
    description = plain(" ".join((cls.__doc__ or "").split()))
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    return from_arguments(cls, parser.parse_args(argv), env)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag on ``parser`` for every setting of config class ``cls`` (left unset when not
    given, for :func:`from_arguments` to fill)."""
    for setting in settings(cls):
        help_text = _help(setting)
        if setting.kind is bool:
            action: Any = argparse.BooleanOptionalAction
            parser.add_argument(setting.flag, dest=setting.name, action=action, help=help_text)
        elif hasattr(setting.kind, "NARGS"):  # several values, parsed as one text
            parser.add_argument(setting.flag, dest=setting.name, help=help_text, nargs="+")
        else:
            parser.add_argument(
                setting.flag,
                dest=setting.name,
                help=help_text,
                type=_argument(setting.kind, setting.name),
            )


def from_arguments(
    cls: type[C],
    args: argparse.Namespace,
    env: typing.Mapping[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> C:
    """``cls`` from parsed flags (:func:`add_arguments`): a flag over its ``LAMINA_*``
    variable over ``defaults`` (by field name: a command's own, such as ``lamina ctl``'s
    bus of the running ``lamina up``) over the field's default."""
    env = os.environ if env is None else env
    defaults = defaults or {}
    values: dict[tuple[str, ...], Any] = {}
    for setting in settings(cls):
        value = getattr(args, setting.name, None)
        if isinstance(value, list):  # a flag of several values (NARGS)
            value = _convert(setting.kind, " ".join(value), setting.name)
        raw = env.get(setting.env)
        if value is None and raw not in (None, ""):
            value = _convert(setting.kind, raw, setting.env)
        if value is None:
            value = defaults.get(setting.name)
        if value is not None:
            values[setting.path] = value
    return _build(cls, values, ())


def _build(cls: type[C], values: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> C:
    """``cls`` from the values set, nested dataclasses built from theirs."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        path, kind = (*prefix, field.name), _base_type(hints[field.name])
        if _nested(kind):
            kwargs[field.name] = _build(kind, values, path)
        elif path in values:
            kwargs[field.name] = values[path]
    return cls(**kwargs)


def to_argv(config: Any) -> list[str]:
    """The flags that rebuild ``config`` with :func:`parse_config` (those not at their
    default), so a launcher can hand its settings to the services it starts."""
    default = type(config)()
    argv: list[str] = []
    for setting in settings(type(config)):
        value = setting.value(config)
        if value == setting.value(default):
            continue
        if value is None:
            raise ValueError(f"{setting.name}: None has no flag (its default is not None)")
        if setting.kind is bool:
            argv.append(setting.flag if value else "--no-" + setting.flag[2:])
        else:
            argv += [setting.flag, str(value)]
    return argv
