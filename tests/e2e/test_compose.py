"""``docker compose up`` smoke test: only where a Docker engine is reachable."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import docker_reachable

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not docker_reachable(), reason="no Docker engine reachable (as on CI)")
def test_compose_stack_serves_one_request():
    from testcontainers.compose import DockerCompose

    with DockerCompose(str(ROOT), compose_file_name="compose.yaml", build=True, wait=False):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the compose stack did not become ready in 10 minutes")
        response = httpx.post(
            "http://127.0.0.1:8000/v1/completions",
            timeout=60,
            json={"prompt": "hello", "max_tokens": 4},
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
