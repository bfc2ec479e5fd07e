"""The embedded nats-server runner and the bus across a server restart."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import nats
import nats.errors
import pytest

from lamina.libs.bus import Bus
from lamina.libs.nats_server import NatsServer, free_port
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.records import BusHealth
from lamina.services.launcher import NATS_PROCS, Stack


def test_the_bus_reconnects_and_resubscribes_when_the_server_comes_back():
    """... and counts it, and tells the cluster (``BusHealth`` on ``events.service``)."""
    port = free_port()

    async def main() -> tuple[list[str], BusHealth]:
        got: asyncio.Queue[Cancel] = asyncio.Queue()
        healths: asyncio.Queue[BusHealth] = asyncio.Queue()

        async def handler(message: Cancel, _msg) -> None:
            got.put_nowait(message)

        async def on_health(health: BusHealth, _msg) -> None:
            healths.put_nowait(health)

        server = NatsServer(port=port).start()
        bus = await Bus.connect(server.url, "test-reconnect")
        bus.report_health("gateway", "gw-1", period=0.05)
        await bus.subscribe("t.again", Cancel, handler)
        await bus.subscribe(subjects.EVENTS_SERVICE, BusHealth, on_health)
        await bus.publish("t.again", Cancel(request_id="before"))
        received = [(await asyncio.wait_for(got.get(), 5)).request_id]
        server.stop()
        while bus.nc.is_connected:
            await asyncio.sleep(0.02)
        server = NatsServer(port=port).start()  # the same address, a fresh server
        try:
            while not bus.nc.is_connected:
                await asyncio.sleep(0.05)
            await bus.publish("t.again", Cancel(request_id="after"))
            received.append((await asyncio.wait_for(got.get(), 5)).request_id)
            health = await asyncio.wait_for(healths.get(), 5)
            while not health.reconnects:  # sent between the reconnect and its callback
                health = await asyncio.wait_for(healths.get(), 5)
            await bus.drain()
        finally:
            server.stop()
        return received, health

    received, health = asyncio.run(asyncio.wait_for(main(), 30))
    assert received == ["before", "after"]
    assert (health.service, health.instance) == ("gateway", "gw-1")
    assert health.disconnects >= 1 and health.reconnects == 1


def test_jetstream_is_there_when_asked_for_and_its_store_goes_with_the_server():
    async def main(url: str) -> int:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="records", subjects=["t.records"])
        ack = await js.publish("t.records", b"kept")
        await nc.drain()
        return ack.seq

    server = NatsServer(jetstream=True).start()
    store = server._store.name
    try:
        assert asyncio.run(main(server.url)) == 1
    finally:
        server.stop()
    assert not Path(store).exists()

    async def without(url: str) -> None:
        nc = await nats.connect(url)
        try:
            await nc.jetstream().add_stream(name="records", subjects=["t.records"])
        finally:
            await nc.close()

    with NatsServer() as plain, pytest.raises(nats.errors.Error):  # no JetStream there
        asyncio.run(without(plain.url))


def test_the_server_runs_its_go_code_on_the_threads_it_is_given():
    """``procs`` is the server's ``GOMAXPROCS`` (its own ``/varz`` says so); without it Go
    picks, and the launcher's stack gives its embedded server ``NATS_PROCS``."""

    def gomaxprocs(server: NatsServer) -> int:
        url = f"http://127.0.0.1:{server.monitor_port}/varz"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)["gomaxprocs"]

    with NatsServer(monitor_port=free_port(), procs=1) as one:
        assert gomaxprocs(one) == 1
    with NatsServer(monitor_port=free_port()) as chosen:
        assert gomaxprocs(chosen) >= 1
    stack = Stack(model=Path("unused"), services=frozenset())  # its NATS server alone
    with stack:
        environ = Path(f"/proc/{stack.nats.pid}/environ").read_bytes().split(b"\0")
    assert f"GOMAXPROCS={NATS_PROCS}".encode() in environ and NATS_PROCS == 1
