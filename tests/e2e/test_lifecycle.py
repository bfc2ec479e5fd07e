"""Every service as a real process on a bad day: with no NATS to reach it says so in one
line and exits 1 after its connect timeout, and SIGTERM stops it in every state (here:
waiting for NATS); children die with their parent, however it ends (a SIGKILLed gateway's
tokenizer processes, a SIGKILLed ``lamina up``'s services and ``nats-server``), and
``lamina up`` answers SIGTERM while it starts."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lamina.libs.nats_server import free_port

SERVICES = ("gateway", "scheduler", "telemetry", "engine_worker")


def _spawn(service: str, model, *args: str) -> subprocess.Popen:
    extra = {
        "gateway": ["--model", str(model), "--http-port", str(free_port())],
        "telemetry": ["--http-port", "0"],
        "engine_worker": ["--model", str(model)],
    }.get(service, [])
    command = [sys.executable, "-m", f"lamina.services.{service}", *extra, *args]
    return subprocess.Popen(
        [*command, "--nats-url", f"nats://127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_without_nats_says_so_once_and_exits_1(service, tiny_model):
    proc = _spawn(service, tiny_model, "--nats-connect-timeout", "2")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    lines = [line for line in output.splitlines() if "NATS" in line]
    assert len(lines) == 2, output  # "cannot reach ... yet", then why it exits
    assert "cannot reach NATS at nats://127.0.0.1:" in lines[-1] and "within 2s" in lines[-1]


@pytest.mark.parametrize("service", SERVICES)
def test_sigterm_stops_a_service_that_waits_for_nats(service, tiny_model):
    proc = _spawn(service, tiny_model)  # the default timeout: a minute of trying
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if "cannot reach NATS" in line:  # it is waiting now
            break
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "stopped" in output  # while starting; telemetry had started (its HTTP first)


def _descendants(pid: int) -> set[int]:
    """Every process under ``pid``, now."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = {int(c) for c in (task / "children").read_text().split()}
                todo += children - found
                found |= children
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie nobody reaped has ended)."""
    running = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.add(pid)
    return running


def _commands(pids: set[int]) -> dict[int, str]:
    """Each of ``pids``' command line (to name a survivor in a failure)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
    return {pid: command.decode(errors="replace") for pid, command in found.items()}


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def _read_until(proc: subprocess.Popen, marker: bytes, seconds: float) -> bytes:
    """Output up to ``marker`` (unbuffered: a chunk at a time)."""
    said, deadline = b"", time.monotonic() + seconds
    while marker not in said:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
            raise AssertionError(f"never said {marker!r}: {said!r}")
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            raise AssertionError(f"exited before saying {marker!r}: {said!r}")
        said += chunk
    return said


def test_a_killed_gateways_tokenizer_processes_die_with_it(nats_url, tiny_model):
    command = [sys.executable, "-m", "lamina.services.gateway", "--model", str(tiny_model)]
    command += ["--http-port", str(free_port()), "--nats-url", nats_url, "--tokenizer-workers", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _read_until(proc, b"gateway started", 60)  # its pool is warm by then
        children = _descendants(proc.pid)
        assert children, "the gateway has no tokenizer processes"
        proc.kill()
        proc.wait()
        assert _gone_within(children, 20) == set()
    finally:
        if proc.poll() is None:
            proc.kill()


def _lamina_up(tiny_model, home: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", "from lamina.services.cli import main; main()", "up"]
    command += ["--model", str(tiny_model), "--http-port", str(free_port())]
    command += ["--metrics-port", str(free_port()), "--nats-port", str(free_port())]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # signals reach the launcher alone, not its children
        env={**os.environ, "LAMINA_HOME": str(home)},
    )


def test_a_killed_lamina_up_leaves_nothing_running(tiny_model, tmp_path):
    proc = _lamina_up(tiny_model, tmp_path)
    try:
        _read_until(proc, b"Ctrl-C stops everything.", 120)
        children = _descendants(proc.pid)
        assert len(children) >= 5  # nats-server and the four services (and their helpers)
        commands = _commands(children)
        proc.kill()  # the supervisor itself: it cannot stop them
        proc.wait()
        survivors = _gone_within(children, 60)
        assert not survivors, {pid: commands.get(pid) for pid in survivors}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_stops_lamina_up_while_it_starts(tiny_model, tmp_path):
    proc = _lamina_up(tiny_model, tmp_path)
    try:
        deadline = time.monotonic() + 30
        while len(_descendants(proc.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # until its services are spawned, the worker still loading
        children = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert b"stopped during start-up" in output
        assert _gone_within(children, 10) == set()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
