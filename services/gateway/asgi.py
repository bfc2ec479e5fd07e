"""The raw ASGI the completion routes speak, instead of Litestar's request and response.

Litestar routes every request, but the two completion endpoints are mounted as ASGI
handlers: Litestar's ``Request`` and ``Stream`` response (an anyio task group per
stream, to listen for the disconnect) add measurably to the time to first token on the
hottest path of the stack (``docs/performance.md``, "Stack overhead"). What they did for
these routes is here: read a bounded body, send JSON or server-sent events, and cancel
the work when the client goes away.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from litestar.utils.path import normalize_path

MAX_BODY_BYTES = 16 << 20
"""Largest request body accepted (a 128K-token prompt as token ids is ~1 MiB of JSON)."""

_json = msgspec.json.Encoder()
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client closed the connection before its request body arrived."""


class BodyTooLarge(Exception):
    """The request body is over :data:`MAX_BODY_BYTES`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over {limit} bytes")


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body; raises :class:`BodyTooLarge` or :class:`ClientDisconnected`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(
    send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A complete JSON response (``headers``: any besides its type and length)."""
    body = _json.encode(payload)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def start_events(send: Send, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Open a ``text/event-stream`` response (``headers``: any besides its own); then
    :func:`send_event` each event."""
    headers = _SSE_HEADERS + headers if headers else _SSE_HEADERS
    await send({"type": "http.response.start", "status": 200, "headers": headers})


def _event(payload: Any) -> bytes:
    """One server-sent event, ``data: <payload as JSON>`` (bytes are sent as they are)."""
    return b"data: " + (payload if isinstance(payload, bytes) else _json.encode(payload)) + b"\n\n"


async def send_event(send: Send, payload: Any) -> None:
    """Send one server-sent event (:func:`_event`)."""
    await send({"type": "http.response.body", "body": _event(payload), "more_body": True})


async def end_events(send: Send, *payloads: Any) -> None:
    """Send the last events of a response opened by :func:`start_events` and end it, all
    in one message."""
    await send({"type": "http.response.body", "body": b"".join(map(_event, payloads))})


async def end_body(send: Send) -> None:
    """End a response opened by :func:`start_events`."""
    await send({"type": "http.response.body", "body": b""})


class ClientWatch:
    """Cancels the task inside it when the client disconnects, and swallows that one
    cancellation on the way out; :attr:`disconnected` then says the client is gone.

    Enter it once the body is read (it takes over ``receive``) and leave it before the
    response's last message: once a response completes, the server reports a disconnect
    too.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.disconnected = False
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    def __enter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._wait())
        return self

    async def _wait(self) -> None:
        message: Message = await self._receive()
        while message["type"] != "http.disconnect":
            message = await self._receive()
        self.disconnected = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        assert self._task is not None and self._watcher is not None
        self._watcher.cancel()
        if self.disconnected and exc_type is asyncio.CancelledError:
            self._task.uncancel()
            return True
        return False


def direct_routes(routes: Mapping[str, ASGIApp], app: ASGIApp) -> ASGIApp:
    """``app`` (the router), with the HTTP requests to the paths in ``routes`` handed to
    their handlers without it. For the completion routes: Litestar's routing, its copy of
    the scope and its exception middleware cost each request tens of microseconds, and its
    wrapper of ``send`` each streamed chunk one more call. A handler served so answers its
    own errors, an unexpected one included (``CompletionsApi.serve``)."""

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http":  # the paths Litestar would match: "/v1/completions/" too
            path = scope["path"]
            route = routes.get(path) or routes.get(normalize_path(path))
        await (app if route is None else route)(scope, receive, send)

    return dispatch


REQUEST_ID = "lamina.request_id"
"""The scope key of the id an HTTP response's ``x-request-id`` header carries: the
client's, where its request had a valid one; a route may set it (None: a fresh one)."""

VISIBLE_ID = re.compile(r"^[\x21-\x7e]{1,256}$")
"""What a request id may be: up to 256 visible ASCII characters (safe in a header)."""


def with_request_ids(app: ASGIApp) -> ASGIApp:
    """``app``, with every HTTP response carrying ``x-request-id``: the request's own
    header echoed where it is valid (:data:`VISIBLE_ID`), else what the route put under
    :data:`REQUEST_ID`, else a fresh id (vLLM's ``--enable-request-id-headers``)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        text = given.decode("latin-1")
        scope[REQUEST_ID] = text if VISIBLE_ID.match(text) else None  # type: ignore[index]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = scope.get(REQUEST_ID) or uuid.uuid4().hex
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}  # type: ignore[assignment]
            await send(message)

        await app(scope, receive, send_with_id)

    return wrapped
