"""``/health`` and ``/ready`` for the services that serve no HTTP otherwise (the scheduler,
the engine workers), so an orchestrator can probe them as it probes the gateway.

``GET /health`` is 200 while the process's event loop runs (a liveness probe); ``GET
/ready`` is 200 while ``ready()`` says so and 503 otherwise (a readiness probe). Nothing
else is served. It is a bare asyncio server, not the gateway's HTTP stack: two fixed
answers, one short request per connection, a bounded head read with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

HEAD_LIMIT = 4096
"""Bytes of request head read at most."""
HEAD_TIMEOUT_S = 5.0


class HealthServer:
    """``/health`` and ``/ready`` on ``host:port`` (port 0: any free port, see ``port``)."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool]) -> None:
        self.host, self.port, self.ready = host, port, ready
        self._server: asyncio.Server | None = None

    async def start(self) -> HealthServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            writer.write(self.answer(head.split(b"\r\n", 1)[0]))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    def answer(self, request_line: bytes) -> bytes:
        """The whole response to one request line (``GET /ready HTTP/1.1``)."""
        method, _, rest = request_line.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            status, body = "405 Method Not Allowed", {"error": "only GET"}
        elif path == b"/health":
            status, body = "200 OK", {"status": "ok"}
        elif path == b"/ready":
            ok = self.ready()
            status, body = ("200 OK" if ok else "503 Service Unavailable"), {"ready": ok}
        else:
            status, body = "404 Not Found", {"error": "only /health and /ready"}
        payload = json.dumps(body).encode()
        head = (
            f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
        ).encode()
        return head + (b"" if method == b"HEAD" else payload)
