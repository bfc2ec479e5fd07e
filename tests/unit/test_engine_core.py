"""The engine core stands alone: it imports no wire schema, no tracing, no NATS and none
of the services around it, so it changes only when the engine does."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys

import msgspec

import lamina.services.engine_worker.engine as core
from lamina.schemas.v1.generate import Sampling
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.engine.params import SamplingParams

_FORBIDDEN = ("lamina.schemas", "opentelemetry", "nats", "msgspec", "lamina.libs.spans")


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _outside(name: str) -> bool:
    """Whether ``name`` is a module the core must not import."""
    if name.startswith(_FORBIDDEN):
        return True
    packages = ("lamina.services", "lamina.services.engine_worker")  # the core's parents
    return (
        name.startswith("lamina.services")
        and not name.startswith(core.__name__)
        and name not in packages
    )


def test_no_core_module_imports_the_wire_tracing_nats_or_the_shell():
    modules = sorted(pathlib.Path(core.__file__).parent.glob("*.py"))
    assert len(modules) > 10
    found = {
        f"{path.name}: {name}" for path in modules for name in _imports(path) if _outside(name)
    }
    assert not found


def test_importing_the_whole_core_loads_none_of_them():
    """What the core's own imports (the kernels, ``lamina.libs``) bring in, too."""
    script = (
        "import importlib, pkgutil, sys\n"
        f"import {core.__name__} as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module(f'{core.__name__}.{m.name}')\n"
        "print('\\n'.join(sys.modules))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert f"{core.__name__}.engine" in loaded
    assert [name for name in loaded if _outside(name)] == []


def _knobs(sampling: Sampling) -> dict:
    return {k: v for k, v in msgspec.structs.asdict(sampling).items() if k != "structured"}


def test_the_wire_and_the_engine_declare_the_same_sampling_knobs():
    """A knob added to one and not the other, or a default that differs, fails here
    (``structured`` reaches the engine compiled, apart)."""
    assert _knobs(Sampling()) == dataclasses.asdict(SamplingParams())
    sampling = Sampling(max_tokens=7, temperature=0.5, stop_token_ids=[3], logit_bias={4: 1.0})
    assert dataclasses.asdict(wire.sampling_params(sampling)) == _knobs(sampling)
