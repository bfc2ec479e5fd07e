"""A TCP proxy that delays every byte by a fixed time in each direction: network latency
where the kernel has no ``netem`` qdisc.

    python benchmarks/delay_proxy.py --listen 10.0.0.1:6222 --to 10.0.0.1:6223 --delay-ms 2

Each chunk read from one side is written to the other ``delay`` seconds after it arrived,
in order; bandwidth is not limited (a chunk waits its delay, not behind its predecessors'
transfer). ``benchmarks/multi_host.py`` puts one in front of each NATS node's route port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float):
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay, data))
    except OSError:
        pass
    finally:
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(OSError):
            await sender
        writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pump(reader, upstream_writer, delay), _pump(upstream_reader, writer, delay)
        )

    server = await asyncio.start_server(on_connect, *listen)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port to accept on")
    parser.add_argument("--to", type=_address, required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="each way (default 2)")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.to, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
