"""The HTTP server under slow, silent and old clients: a real uvicorn on loopback, raw
sockets as the clients."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time

import uvicorn

from lamina.libs.http_server import server_config
from lamina.libs.nats_server import free_port

PARTS = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]


async def app(scope, receive, send) -> None:
    """``/stream``: three parts without a length; ``/echo``: the body's length; anything
    else: a short fixed body."""
    if scope["path"] == "/echo":
        size, message = 0, {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
        text = b"%d" % size
        headers = [(b"content-length", b"%d" % len(text))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": text})
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in PARTS:
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def serving(header_timeout: float = 0.5, **limits):
    port = free_port()
    server = uvicorn.Server(
        server_config(app, "127.0.0.1", port, header_timeout, log_level="error", **limits)
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    data = await asyncio.wait_for(reader.read(), 5)  # to EOF: the server closes
    writer.close()
    return data


def test_an_http10_client_gets_an_unframed_stream_then_the_close():
    async def main() -> None:
        server, task, port = await serving()
        old = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        new = await exchange(port, b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        server.should_exit = True
        await task
        head, body = old.split(b"\r\n\r\n", 1)
        assert b"chunked" not in head.lower() and b"connection: close" in head.lower()
        assert body == b"".join(PARTS)
        assert b"transfer-encoding: chunked" in new.lower()  # HTTP/1.1 keeps its framing

    asyncio.run(main())


def test_slow_and_silent_clients_are_cut_off_while_others_are_served():
    async def main() -> None:
        server, task, port = await serving(header_timeout=0.5)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(200)]
        slow = []
        for _ in range(20):  # slowloris: a head that never ends
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
            slow.append((reader, writer))
        answers = [await exchange(port, b"GET / HTTP/1.0\r\n\r\n") for _ in range(20)]
        cut = [await asyncio.wait_for(r.read(), 30) for r, _ in slow + idle]
        server.should_exit = True
        await task
        assert all(a.endswith(b"ok") for a in answers)  # served while the others were held
        assert all(c.startswith(b"HTTP/1.1 408") for c in cut)

    asyncio.run(main())


def test_a_head_dribbled_a_header_at_a_time_is_cut_off_all_the_same():
    async def main() -> tuple[bytes, bool]:
        server, task, port = await serving(header_timeout=0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        answer = asyncio.create_task(reader.read())  # read as it comes: before any reset
        writer.write(b"GET / HTTP/1.1\r\n")
        with contextlib.suppress(ConnectionError):
            while not answer.done() and time.monotonic() - started < 30:
                writer.write(b"x-slow: yes\r\n")
                await asyncio.sleep(0.1)
        cut_while_dribbling = answer.done()
        cut = await asyncio.wait_for(answer, 5)
        server.should_exit = True
        await task
        return cut, cut_while_dribbling

    cut, cut_while_dribbling = asyncio.run(main())
    # Cut off while headers still came (each one did not restart the clock).
    assert cut.startswith(b"HTTP/1.1 408") and cut_while_dribbling


def test_a_trickled_body_is_cut_off_and_a_steady_one_is_read():
    """After the head, a body must keep up ``min_body_rate`` (after the header timeout's
    grace): a byte every 0.2 s is cut off with a 408 while it still trickles; a body
    sent at a steady rate is read whole, however long it takes beyond the grace."""

    async def main() -> tuple[bytes, bool, bytes]:
        server, task, port = await serving(header_timeout=0.5, min_body_rate=1000)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        answer = asyncio.create_task(reader.read())
        with contextlib.suppress(ConnectionError):
            for _ in range(150):  # 30 s of trickling, if nothing cut it off
                if answer.done():
                    break
                writer.write(b"x")
                await asyncio.sleep(0.2)
        cut_while_trickling = answer.done()
        cut = await asyncio.wait_for(answer, 5)
        writer.close()
        body = b"y" * 1500  # 1.5 s at 1000 bytes/s: past the 0.5 s grace, at the rate
        steady_reader, steady = await asyncio.open_connection("127.0.0.1", port)
        steady.write(b"POST /echo HTTP/1.0\r\ncontent-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 300):
            steady.write(body[i : i + 300])
            await asyncio.sleep(0.1)
        read = await asyncio.wait_for(steady_reader.read(), 10)
        steady.close()
        server.should_exit = True
        await task
        return cut, cut_while_trickling, read

    cut, cut_while_trickling, read = asyncio.run(main())
    assert cut.startswith(b"HTTP/1.1 408") and b"body took too long" in cut
    assert cut_while_trickling
    assert read.endswith(b"\r\n\r\n1500")


def test_connections_beyond_the_bound_are_refused_at_once_and_others_served_after():
    async def main() -> tuple[list[bytes], bytes]:
        server, task, port = await serving(header_timeout=5.0, max_connections=10)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        refused = [await exchange(port, b"GET / HTTP/1.0\r\n\r\n") for _ in range(3)]
        for _, writer in held:
            writer.close()
        served = b""
        for _ in range(100):  # until the server has seen them go
            served = await exchange(port, b"GET / HTTP/1.0\r\n\r\n")
            if not served.startswith(b"HTTP/1.1 503"):
                break
            await asyncio.sleep(0.1)
        server.should_exit = True
        await task
        return refused, served

    refused, served = asyncio.run(main())
    assert all(r.startswith(b"HTTP/1.1 503") for r in refused)
    assert served.endswith(b"ok")


SERVER = """
import sys, uvicorn, uvloop
from lamina.libs.http_server import server_config
from tests.unit.test_http_server import app
config = server_config(app, "127.0.0.1", int(sys.argv[1]), 10.0, log_level="error",
                       timeout_keep_alive=1)
uvloop.run(uvicorn.Server(config).serve())
"""


def answer(sock: socket.socket) -> bytes:
    """The short fixed response read off ``sock`` (its head and body may come apart), or
    what came before the connection ended (``<reset>`` for a reset)."""
    data = b""
    try:
        while not data.endswith(b"\r\n\r\nok"):
            part = sock.recv(4096)
            if not part:
                break
            data += part
    except ConnectionResetError:
        data += b"<reset>"
    return data


def test_a_request_sent_in_time_is_answered_when_the_server_wakes_past_the_keep_alive():
    """A kept-alive connection's next request arrives within the keep-alive timeout while
    the server process is stopped (SIGSTOP; descheduled or frozen in the field) until
    after it. On uvloop, as the gateway runs, the due timer ran before the socket was read
    and the connection was closed under the request (the client: reset, or "Server
    disconnected without sending a response"); it is answered."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        for _ in range(3000):  # until it listens
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as kept:
            kept.sendall(request)
            assert answer(kept).endswith(b"ok")  # the keep-alive timer is armed now
            server.send_signal(signal.SIGSTOP)
            kept.sendall(request)  # in time: well within the second
            time.sleep(1.5)  # the timer falls due while the server is stopped
            server.send_signal(signal.SIGCONT)
            second = answer(kept)
        assert second.startswith(b"HTTP/1.1 200") and second.endswith(b"ok"), second
    finally:
        server.send_signal(signal.SIGCONT)
        server.terminate()
        server.wait(30)
