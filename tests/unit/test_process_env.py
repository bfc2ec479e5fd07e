"""Every ``LAMINA_*`` variable a process reads is declared in one place, ``libs/config``:
a service's settings as its config's fields, the process-wide ones as ``ProcessEnv``."""

from __future__ import annotations

import pathlib
import re

import pytest

from lamina.libs.config import ProcessEnv, env_name, process_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
_READS = re.compile(r"""(environ(\.get)?\s*[(\[]|getenv\s*\()\s*["']LAMINA_""")


def test_each_field_is_read_from_its_variable_and_checked():
    env = {
        "LAMINA_LOG_FORMAT": "json",
        "LAMINA_RESTARTS": "3",
        "LAMINA_KERNELS": " triton ",
        "LAMINA_PARENT_PID": "",
    }
    assert process_env(env) == ProcessEnv(log_format="json", restarts=3, kernels="triton")
    with pytest.raises(ValueError, match="LAMINA_LOG_FORMAT: 'xml' is not one of text, json"):
        process_env({"LAMINA_LOG_FORMAT": "xml"})
    with pytest.raises(ValueError, match="LAMINA_RESTARTS"):
        process_env({"LAMINA_RESTARTS": "many"})
    assert env_name("parent_pid") == "LAMINA_PARENT_PID"


def test_no_module_but_libs_config_reads_a_lamina_variable():
    readers = [
        str(path.relative_to(ROOT))
        for tree in ("services", "libs", "kernels")
        for path in (ROOT / tree).rglob("*.py")
        if path != ROOT / "libs" / "config.py" and _READS.search(path.read_text())
    ]
    assert readers == []
    assert _READS.search('os.environ.get("LAMINA_KERNELS", "")')  # the check can fail
