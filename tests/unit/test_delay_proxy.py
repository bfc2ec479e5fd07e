"""``benchmarks/delay_proxy.py``, the latency the multi-host benchmark adds: every byte
arrives, in order, ``delay`` later in each direction."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

from lamina.libs.nats_server import free_port

_SPEC = importlib.util.spec_from_file_location(
    "delay_proxy", Path(__file__).resolve().parents[2] / "benchmarks" / "delay_proxy.py"
)
delay_proxy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(delay_proxy)


def test_bytes_cross_intact_and_a_round_trip_takes_twice_the_delay():
    async def main() -> tuple[bool, list[float]]:
        async def echo(reader, writer) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = upstream.sockets[0].getsockname()[:2]
        port = free_port()
        proxy = asyncio.create_task(delay_proxy.serve(("127.0.0.1", port), target, 0.02))
        for _ in range(100):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.01)
        payload, received, trips = bytes(range(256)) * 4096, b"", []
        writer.write(payload)  # 1 MiB, in many chunks
        while len(received) < len(payload):
            received += await reader.read(65536)
        for _ in range(3):
            started = time.perf_counter()
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            trips.append(time.perf_counter() - started)
        writer.close()
        proxy.cancel()
        upstream.close()
        return received == payload, trips

    intact, trips = asyncio.run(main())
    assert intact
    assert all(0.04 <= trip < 0.2 for trip in trips), trips
