"""The HTTP server the gateway and telemetry run: uvicorn's httptools protocol, with what
a server exposed to clients needs and that protocol lacks.

- A header-read timeout: a connection that has not sent a whole request head within
  ``header_timeout`` seconds of connecting (or of starting its next request) gets a 408
  and is closed, so slow or silent clients (slowloris) cannot hold connections forever.
  Between requests, uvicorn's keep-alive timeout closes idle connections.
- A body-rate timeout: once the head is in, the body must keep arriving at
  ``min_body_rate`` bytes a second after the same grace (``header_timeout``), or the
  request gets a 408 and the connection is closed (a body trickled a byte every few
  seconds held its connection for as long as the client liked).
- A bound on open connections: beyond ``max_connections`` a new connection is answered
  503 and closed at once, so a crowd of idle sockets cannot take every file descriptor
  (uvicorn's ``limit_concurrency`` answers 503 only once a request arrives).
- A kept-alive connection whose next request came in time is not closed under it. When
  the loop stalls past a keep-alive deadline (a busy loop, a stopped or descheduled
  process), uvloop runs the due timers before it reads the sockets, so uvicorn's
  keep-alive timeout closed connections whose next request had arrived before the
  deadline but was not read yet: the client saw the connection reset or "Server
  disconnected without sending a response". The timeout now closes a connection only
  when nothing is waiting to be read on it.
- HTTP/1.0 framing: the protocol frames a response without ``Content-Length`` (a stream)
  as chunked whatever the client's version, and an HTTP/1.0 client does not know chunked
  encoding. For such a client the body is sent as it is and the connection closes after it,
  which is how HTTP/1.0 delimits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
MIN_BODY_RATE = 16 << 10
"""Bytes a second a request body must arrive at, after the header timeout's grace."""
MAX_CONNECTIONS = 4096
"""Open connections a server holds (a stream is one)."""


def _closing(status: bytes, text: bytes, *headers: bytes) -> bytes:
    """A whole response that closes its connection."""
    head = [b"HTTP/1.1 " + status, b"content-type: text/plain", *headers]
    head += [b"content-length: %d" % len(text), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + text


_TIMED_OUT = _closing(b"408 Request Timeout", b"request head took too long")
_BODY_TIMED_OUT = _closing(b"408 Request Timeout", b"request body took too long")
_BUSY = _closing(b"503 Service Unavailable", b"too many open connections", b"retry-after: 1")


class Protocol(HttpToolsProtocol):
    header_timeout: float = HEADER_TIMEOUT_S
    min_body_rate: float = MIN_BODY_RATE
    max_connections: int = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_received = 0
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(_BUSY)
            return
        self._await_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_head()

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.scope.get("http_version") == "1.0":
            _frame_for_http10(self.cycle)
        self._body_started, self._body_received = self.loop.time(), 0
        self._check_body()

    def on_body(self, body: bytes) -> None:
        self._body_received += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _await_head(self) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(self.header_timeout, self._refuse, _TIMED_OUT)

    def _check_body(self) -> None:
        """Cut the request off once its body is behind the rate; else look again when it
        would be (one timer per request, not one per chunk)."""
        self._timer = None
        due = self._body_started + self.header_timeout + self._body_received / self.min_body_rate
        if self.loop.time() >= due:
            self._refuse(_BODY_TIMED_OUT)
        else:
            self._timer = self.loop.call_at(due, self._check_body)

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout, but a request already waiting in the socket keeps
        the connection (the module's docstring): the next read delivers it."""
        if _unread(self.transport):
            self.timeout_keep_alive_task = None
            return
        super().timeout_keep_alive_handler()

    def _refuse(self, response: bytes) -> None:
        self._timer = None
        if not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.write(response)
            self.transport.close()


def _unread(transport: asyncio.Transport) -> bool:
    """Whether bytes wait to be read on ``transport``'s socket (a peek: nothing is taken)."""
    if transport.is_closing() or (fd := transport.get_extra_info("socket").fileno()) < 0:
        return False
    peek = socket.socket(fileno=fd)  # uvloop's socket object cannot recv; this one borrows the fd
    try:
        return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing to read (BlockingIOError), or the connection is gone
        return False
    finally:
        peek.detach()


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


def server_config(
    app: Any,
    host: str,
    port: int,
    header_timeout: float,
    max_connections: int = MAX_CONNECTIONS,
    min_body_rate: float = MIN_BODY_RATE,
    **options: Any,
):
    """A ``uvicorn.Config`` for ``app`` on this module's protocol; the process may then
    open the file descriptors ``max_connections`` needs (its soft limit raised toward its
    hard one)."""
    _raise_fd_limit(max_connections + 1024)
    settings = {
        "header_timeout": header_timeout,
        "max_connections": max_connections,
        "min_body_rate": min_body_rate,
    }
    protocol = type("Protocol", (Protocol,), settings)
    return uvicorn.Config(
        app, host=host, port=port, http=protocol, lifespan="off", access_log=False, **options
    )


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``: every process that binds
    it so listens on the one port, and the kernel spreads new connections among them (a
    server given it calls ``listen``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
