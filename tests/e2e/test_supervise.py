"""``lamina up`` keeps the stack up: a killed telemetry, a worker stopped by SIGTERM (it
drains first) and a killed ``nats-server`` are each started again, the rest keep
serving, and requests succeed afterwards; Ctrl-C still stops everything with exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lamina.libs.nats_server import free_port


def child(launcher: int, pattern: str) -> int:
    """The pid of the launcher's child whose command line contains ``pattern`` (read
    from ``/proc``, as ``pgrep -P`` would)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher and pattern in cmdline:
            found.append(int(entry.name))
    assert len(found) == 1, f"{pattern}: {found}"
    return found[0]


def until(probe, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if result := probe():
                return result
        except (httpx.HTTPError, AssertionError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def completes(base: str) -> bool:
    body = {"prompt": "Once", "max_tokens": 2}
    return httpx.post(base + "/v1/completions", json=body, timeout=10).status_code == 200


def test_lamina_up_restarts_what_exits_and_keeps_serving(tiny_model, tmp_path):
    port, metrics_port, nats_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-c", "from lamina.services.cli import main; main()", "up"]
    command += ["--model", str(tiny_model), "--http-port", str(port)]
    command += ["--metrics-port", str(metrics_port), "--nats-port", str(nats_port)]
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "LAMINA_HOME": str(tmp_path)},
    )
    base, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    try:
        # Up when the launcher says so (its own start-up checks end after the gateway's).
        up_log = tmp_path / "up.log"
        until(lambda: b"Ctrl-C stops everything." in up_log.read_bytes(), "the launcher")
        assert completes(base)
        telemetry = child(proc.pid, "lamina.services.telemetry")
        os.kill(telemetry, signal.SIGKILL)
        until(lambda: child(proc.pid, "lamina.services.telemetry") != telemetry, "telemetry")
        until(lambda: httpx.get(metrics + "/health").status_code == 200, "telemetry's /health")
        assert completes(base)  # the gateway kept serving meanwhile

        worker = child(proc.pid, "lamina.services.engine_worker")
        os.kill(worker, signal.SIGTERM)  # a rolling restart: it drains, exits 0, comes back
        until(lambda: child(proc.pid, "lamina.services.engine_worker") != worker, "the worker")
        until(lambda: completes(base), "requests on the new worker")
        restarted = 'lamina:service_restarts{instance="worker-0",service="worker"} 1.0'
        until(lambda: restarted in httpx.get(metrics + "/metrics").text, "the restart counted")

        nats = child(proc.pid, "nats-server")
        os.kill(nats, signal.SIGKILL)
        until(lambda: child(proc.pid, "nats-server") != nats, "nats-server")
        until(lambda: completes(base), "requests after the bus came back")

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "up.log").read_text(errors="replace")
    assert proc.returncode == 0, text
    for service in ("telemetry", "worker-0", "nats-server"):
        assert f"restarted {service} (restart 1)" in text, text
