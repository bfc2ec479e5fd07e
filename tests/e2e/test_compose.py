"""``compose.yaml`` for real: the stack and Prometheus in containers built here
(``deploy/images/build.sh`` for the base, NATS and Prometheus images; compose builds
Lamina's from this checkout), two workers, requests through the published gateway port,
every shipped dashboard query answered by that Prometheus.

Runs where a Docker engine answers and ``LAMINA_COMPOSE_TEST=1`` (``.ci/run`` sets it once
it has started an engine and built the images). The collector, Tempo and Grafana have no
image that can be built here: they are not started (their configuration is checked in
``tests/unit/test_observability.py``), and the services export no spans.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.prometheus import PrometheusApi, burst
from tests.telemetry import vllm_0_33

ROOT = Path(__file__).resolve().parents[2]
IMAGES_ENV = ROOT / "deploy/images/env"
STARTED = ["credentials", "nats", "scheduler", "gateway", "worker", "telemetry", "prometheus"]
WORKERS = 2
REQUESTS = 12


def compose_command() -> list[str] | None:
    """Debian's ``docker-compose`` (1.29), or the ``docker compose`` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return ["docker", "compose"] if plugin.returncode == 0 else None


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    os.environ.get("LAMINA_COMPOSE_TEST") != "1" or not engine_answers(),
    reason="needs a Docker engine and LAMINA_COMPOSE_TEST=1 (.ci/run sets both up)",
)


@pytest.fixture(scope="module")
def compose():
    command = compose_command()
    assert command, "no docker-compose or docker compose plugin"
    assert IMAGES_ENV.is_file(), "run deploy/images/build.sh first"
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="")
    for line in IMAGES_ENV.read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    project = [
        *command,
        "-p",
        f"lamina-test-{os.getpid()}",
        "-f",
        str(ROOT / "compose.yaml"),
        "-f",
        str(ROOT / "tests/e2e/compose.test.yaml"),
        "--profile",
        "observability",
    ]

    def run(*args: str, timeout: float = 300) -> None:
        subprocess.run([*project, *args], env=env, cwd=ROOT, check=True, timeout=timeout)

    # --build: the Lamina image from this checkout (its layers are cached when unchanged).
    run("up", "-d", "--build", "--scale", f"worker={WORKERS}", *STARTED, timeout=900)
    try:
        yield
    finally:
        run("logs", "--tail", "30")
        run("down", "-v", "--remove-orphans")


def wait_until(check, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


def test_compose_stack_serves_through_both_workers_and_prometheus_sees_it(compose):
    wait_until(
        lambda: httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200,
        "the gateway",
    )
    cluster = "http://127.0.0.1:9400/v1/cluster"
    wait_until(
        lambda: httpx.get(cluster, timeout=2).json()["totals"]["workers_live"] == WORKERS,
        f"{WORKERS} live workers",
    )
    assert burst("http://127.0.0.1:8000", REQUESTS) == [12] * REQUESTS
    prometheus = PrometheusApi("http://127.0.0.1:9090")
    prometheus.wait_for_burst(REQUESTS)
    served_by = prometheus.query("sum by (worker_id) (lamina:request_outcome_total)")
    assert len(served_by) == WORKERS  # placement spread the burst over both
    prometheus.assert_every_dashboard_query_returns_data()
    for series in vllm_0_33.DASHBOARD_SERIES:
        assert prometheus.query(f'{series}{{model_name="lamina-tiny"}}'), series
