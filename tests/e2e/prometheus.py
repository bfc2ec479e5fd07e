"""A real Prometheus for the tests (Debian's ``prometheus`` package), and the shipped
dashboards' queries to ask it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai

from lamina.libs.nats_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
BINARY = shutil.which("prometheus")


def burst(base_url: str, requests: int, max_tokens: int = 12) -> list[int]:
    """``requests`` greedy completions streamed at once (prompts of a few lengths, so the
    token histograms spread); each one's completion tokens."""
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model="lamina-tiny",
            prompt=f"load {i} " * (1 + i % 4),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), 180)

    return asyncio.run(main())


def dashboard_queries() -> dict[str, str]:
    """Every Prometheus expression in every shipped dashboard, by ``dashboard / panel``."""
    queries = {}
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                if panel["datasource"]["type"] == "prometheus":
                    key = f"{dashboard['title']} / {panel['title']} / {target['refId']}"
                    queries[key] = target["expr"]
    return queries


class PrometheusApi:
    """Prometheus' HTTP API at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def exemplars(self, expr: str, seconds: float = 600) -> list[dict]:
        now = time.time()
        params = {"query": expr, "start": now - seconds, "end": now}
        response = httpx.get(f"{self.url}/api/v1/query_exemplars", params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]

    def wait_for(self, expr: str, minimum: float, timeout: float = 60) -> None:
        """Until ``expr``'s first value reaches ``minimum`` (the scrapes caught up)."""
        deadline, result = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result and float(result[0]["value"][1]) >= minimum:
                return
            time.sleep(0.5)
        raise AssertionError(f"{expr} did not reach {minimum} in {timeout}s: {result}")

    def wait_for_burst(self, requests: int) -> None:
        """Until the scrapes hold a :func:`burst` of ``requests`` (some of which waited in
        a scheduler's queue), and enough samples since for every rate."""
        self.wait_for("sum(lamina:request_outcome_total)", requests)
        self.wait_for("sum(lamina:scheduler_queue_wait_seconds_count)", 1)
        # Rates need two samples of each series since it appeared: a few more scrapes.
        self.wait_for("min(count_over_time(lamina:request_outcome_total[1m]))", 3)

    def assert_every_dashboard_query_returns_data(self) -> None:
        empty = {name: expr for name, expr in dashboard_queries().items() if not self.query(expr)}
        assert not empty, f"dashboard queries with no data: {json.dumps(empty, indent=1)}"


class Prometheus(PrometheusApi):
    """Debian's ``prometheus`` on a free loopback port, scraping ``targets`` every
    second, with exemplar storage on (as compose runs it)."""

    def __init__(self, targets: list[str], tmp: Path) -> None:
        port = free_port()
        super().__init__(f"http://127.0.0.1:{port}")
        config = tmp / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": "lamina-telemetry", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.args = [
            BINARY or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ]
        self.log = tmp / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=self.log.open("wb")
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready: {self.log.read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
