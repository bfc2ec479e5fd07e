"""The launcher's guard against a second start (no processes are spawned here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lamina.services.launcher import Stack, UpConfig, stack_of


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


def test_lamina_up_hands_its_keys_and_policies_to_the_gateway_and_telemetry():
    keyed = UpConfig(api_key="k1", api_key_file="keys", api_client_file="clients")
    stack = stack_of(keyed, Path("model"))
    assert stack.gateway_args == [
        "--api-key", "k1", "--api-key-file", "keys", "--api-client-file", "clients"
    ]  # fmt: skip
    # Its cluster is not shown to whoever asks: the gateway's keys, unless its own.
    assert stack.telemetry_args == ["--metrics-api-key", "k1", "--metrics-api-key-file", "keys"]
    own = stack_of(UpConfig(api_key="k1", metrics_api_key="m"), Path("model"))
    assert own.telemetry_args == ["--metrics-api-key", "m"]
    assert stack_of(UpConfig(), Path("model")).telemetry_args == []
