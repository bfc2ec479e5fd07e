"""Bus tier: a real nats-server, the telemetry service in-process, records over NATS, HTTP out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import prometheus_client
import pytest

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import parse_config
from lamina.libs.nats_server import NatsServer, free_port
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord
from lamina.services.telemetry.service import TelemetryConfig, TelemetryService
from tests.telemetry.helpers import make_record, make_stats

DEADLINE_S = 10.0


async def poll(probe: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait (bounded) until ``probe()`` is true."""
    deadline = time.monotonic() + DEADLINE_S
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def status(http: httpx.AsyncClient, path: str) -> int:
    return (await http.get(path)).status_code


async def scenario() -> str:
    nats_port = free_port()
    service = TelemetryService(
        TelemetryConfig(nats=NatsConfig(f"nats://127.0.0.1:{nats_port}"), http_port=0)
    )
    server = NatsServer(port=nats_port)
    await service.start()
    base = f"http://127.0.0.1:{service.http_port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5.0) as http:
            # Up but not ready until NATS is there.
            assert await status(http, "/health") == 200
            assert await status(http, "/ready") == 503

            await asyncio.to_thread(server.start)
            await poll(lambda: _is(http, "/ready", 200), "/ready 200")

            bus = await Bus.connect(server.url, "telemetry-test")
            try:
                # A long interval: a slow machine must not see the worker die mid-test.
                stats = make_stats("w1", heartbeat_interval_s=60.0)
                await bus.publish(subjects.worker_stats("w1"), stats)
                await bus.publish(subjects.EVENTS_REQUEST, make_record())
                await bus.publish(
                    subjects.EVENTS_PLACEMENT,
                    PlacementRecord(request_id="r1", worker_id="w1", reason="placed", candidates=1),
                )
                await bus.flush()
            finally:
                await bus.close()

            wanted = {
                'lamina:worker_up{model="tiny",worker_id="w1"} 1.0',
                'lamina:num_requests_running{model="tiny",worker_id="w1"} 2.0',
                "lamina:cluster_workers_live 1.0",
                'lamina:request_outcome_total{model="tiny",outcome="finished",worker_id="w1"} 1.0',
                'lamina:e2e_request_latency_seconds_count{model="tiny",worker_id="w1"} 1.0',
                'lamina:placements_total{policy="unknown",reason="placed"} 1.0',
            }

            async def metrics_arrived() -> bool:
                response = await http.get("/metrics")
                assert response.status_code == 200
                assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
                return wanted <= set(response.text.splitlines())

            await poll(metrics_arrived, "metrics from the published records")

            cluster = (await http.get("/v1/cluster")).json()
            (worker,) = cluster["workers"]
            assert worker["worker_id"] == "w1"
            assert worker["alive"] is True
            assert worker["free_kv_blocks"] == stats.free_kv_blocks
            assert abs(worker["last_seen_ms"] - time.time() * 1000) < 60_000
            assert cluster["totals"]["workers_live"] == 1
            assert cluster["totals"]["requests_running"] == 2

            # Draining drops the bus (not ready) but keeps serving until close.
            await service.drain()
            assert await status(http, "/ready") == 503
            assert await status(http, "/health") == 200
    finally:
        await service.close()
        await asyncio.to_thread(server.stop)
    return base


async def _is(http: httpx.AsyncClient, path: str, code: int) -> bool:
    return await status(http, path) == code


def test_service_serves_metrics_from_the_bus():
    base = asyncio.run(asyncio.wait_for(scenario(), 60))
    with pytest.raises(httpx.ConnectError):  # closed: nothing listens any more
        httpx.get(f"{base}/health", timeout=2.0)


def test_close_without_nats_is_prompt():
    async def start_and_close() -> None:
        config = TelemetryConfig(nats=NatsConfig(f"nats://127.0.0.1:{free_port()}"), http_port=0)
        service = TelemetryService(config)
        await service.start()
        await service.drain()
        await service.close()

    started = time.monotonic()
    asyncio.run(asyncio.wait_for(start_and_close(), 20))
    assert time.monotonic() - started < 10


def test_config_from_flags_and_environment():
    config = parse_config(
        TelemetryConfig, ["--http-port", "9500"], env={"LAMINA_NATS_URL": "nats://n:4222"}
    )
    assert config == TelemetryConfig(nats=NatsConfig("nats://n:4222"), http_port=9500)
    assert TelemetryConfig().http_host == "127.0.0.1"
    assert TelemetryConfig().http_port == 9400


def test_metrics_behind_their_own_key_and_probes_open(nats_url):
    async def main() -> dict[str, int]:
        config = TelemetryConfig(nats=NatsConfig(nats_url), http_port=0, metrics_api_key="scrape")
        service = TelemetryService(config)
        await service.start()
        try:
            base = f"http://127.0.0.1:{service.http_port}"
            async with httpx.AsyncClient(base_url=base, timeout=5.0) as http:
                keyed = {"Authorization": "Bearer scrape"}
                return {
                    "health": await status(http, "/health"),
                    "metrics": await status(http, "/metrics"),
                    "cluster": await status(http, "/v1/cluster"),
                    "metrics with key": (await http.get("/metrics", headers=keyed)).status_code,
                }
        finally:
            await service.close()

    assert asyncio.run(main()) == {
        "health": 200,
        "metrics": 401,
        "cluster": 401,
        "metrics with key": 200,
    }
