"""The launcher's guard against a second start (no processes are spawned here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lamina.services.launcher import Stack


def test_a_started_stack_refuses_a_second_start():
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stack = Stack(model=Path("unused"), nats_url="nats://127.0.0.1:1")
    stack.procs["scheduler"] = running
    try:
        with pytest.raises(RuntimeError, match="already started"):
            stack.start()
        assert list(stack.procs) == ["scheduler"]  # nothing else was spawned
    finally:
        stack.stop(timeout=5)
    assert running.poll() is not None
