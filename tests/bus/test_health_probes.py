"""``/health`` and ``/ready`` of the services without an HTTP API (``libs/health.py``): the
bare server's answers, and a real scheduler's readiness on a real nats-server."""

from __future__ import annotations

import asyncio

import httpx

from lamina.libs import health
from lamina.libs.bus import NatsConfig
from lamina.libs.health import HealthServer
from lamina.libs.nats_server import NatsServer
from lamina.services.scheduler.service import SchedulerConfig, SchedulerService


def test_health_is_always_ok_and_ready_follows_its_predicate():
    async def main() -> list[tuple[str, int]]:
        state = {"ready": False}
        server = await HealthServer("127.0.0.1", 0, lambda: state["ready"]).start()
        seen = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            for path in ("/health", "/ready", "/metrics"):
                seen.append((path, (await client.get(path)).status_code))
            state["ready"] = True
            response = await client.get("/ready?verbose=1")
            seen.append(("/ready", response.status_code))
            assert response.json() == {"ready": True}
            seen.append(("POST /ready", (await client.post("/ready")).status_code))
        await server.stop()
        return seen

    assert asyncio.run(main()) == [
        ("/health", 200),
        ("/ready", 503),
        ("/metrics", 404),
        ("/ready", 200),
        ("POST /ready", 405),
    ]


def test_a_client_that_never_sends_its_head_is_dropped(monkeypatch):
    monkeypatch.setattr(health, "HEAD_TIMEOUT_S", 0.2)

    async def main() -> bytes:
        server = await HealthServer("127.0.0.1", 0, lambda: True).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health HTTP/1.1\r\n")  # and nothing more
        closed = await asyncio.wait_for(reader.read(), 2)
        writer.close()
        await server.stop()
        return closed

    assert asyncio.run(main()) == b""


def test_a_scheduler_is_ready_once_on_the_bus_and_not_while_the_bus_is_gone():
    async def main(server: NatsServer) -> list[int]:
        config = SchedulerConfig(
            nats=NatsConfig(server.url), scheduler_id="probed", health_host="127.0.0.1"
        )
        scheduler = SchedulerService(config)
        # --health-port 0 is "off": the test binds the probe to a free port itself.
        scheduler.health = await HealthServer("127.0.0.1", 0, scheduler.ready).start()
        url = f"http://127.0.0.1:{scheduler.health.port}/ready"
        codes = []
        async with httpx.AsyncClient() as client:
            codes.append((await client.get(url)).status_code)  # not started
            await scheduler.start()
            codes.append((await client.get(url)).status_code)
            server.stop()
            await asyncio.sleep(0.3)
            codes.append((await client.get(url)).status_code)  # the bus is gone
            server.start()
            for _ in range(50):
                if scheduler.bus.nc.is_connected:
                    break
                await asyncio.sleep(0.1)
            codes.append((await client.get(url)).status_code)
            await scheduler.close()
        return codes

    with NatsServer() as server:
        assert asyncio.run(main(server)) == [503, 200, 503, 200]
