"""The HTTP server the gateway and telemetry run: uvicorn's httptools protocol, with what
a server exposed to clients needs and that protocol lacks.

- A header-read timeout: a connection that has not sent a whole request head within
  ``header_timeout`` seconds of connecting (or of starting its next request) gets a 408
  and is closed, so slow or silent clients (slowloris) cannot hold connections forever.
  Between requests, uvicorn's keep-alive timeout closes idle connections.
- HTTP/1.0 framing: the protocol frames a response without ``Content-Length`` (a stream)
  as chunked whatever the client's version, and an HTTP/1.0 client does not know chunked
  encoding. For such a client the body is sent as it is and the connection closes after it,
  which is how HTTP/1.0 delimits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
    b"content-length: 26\r\nconnection: close\r\n\r\nrequest head took too long"
)


class Protocol(HttpToolsProtocol):
    header_timeout: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._await_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_head()

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.scope.get("http_version") == "1.0":
            _frame_for_http10(self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.write(_TIMED_OUT)
            self.transport.close()


def _frame_for_http10(cycle: Any) -> None:
    """Send ``cycle``'s response unframed when it has no ``Content-Length``: the body as it
    is, then close (the cycle of an HTTP/1.0 request does not keep the connection alive)."""
    send, unframed = cycle.send, False

    async def framed_send(message: dict) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            if b"content-length" not in names:
                unframed = True
                cycle.chunked_encoding = False
                cycle.expected_content_length = sys.maxsize
        elif unframed and message["type"] == "http.response.body" and not message.get("more_body"):
            # uvicorn checks the body against the length it expected: the last part ends it.
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = framed_send


def server_config(app: Any, host: str, port: int, header_timeout: float, **options: Any):
    """A ``uvicorn.Config`` for ``app`` on this module's protocol."""
    protocol = type("Protocol", (Protocol,), {"header_timeout": header_timeout})
    return uvicorn.Config(
        app, host=host, port=port, http=protocol, lifespan="off", access_log=False, **options
    )
