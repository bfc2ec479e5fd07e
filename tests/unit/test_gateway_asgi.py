"""The gateway's raw-ASGI pieces against scripted ``receive`` callables."""

from __future__ import annotations

import asyncio

import pytest

from lamina.services.gateway.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    ClientWatch,
    read_body,
)


def script(*messages: dict, then: asyncio.Event | None = None):
    """A ``receive`` that returns ``messages`` in order, then waits for ``then`` and
    reports a disconnect (a server does the same once the body is read)."""
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        await (then or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return receive


def body(chunk: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": chunk, "more_body": more}


def test_read_body_joins_chunks_and_enforces_the_limit():
    async def main() -> None:
        assert await read_body(script(body(b"ab", True), body(b"cd", False))) == b"abcd"
        assert await read_body(script(body(b"abcd", False)), limit=4) == b"abcd"
        with pytest.raises(BodyTooLarge):
            await read_body(script(body(b"abc", True), body(b"de", False)), limit=4)
        with pytest.raises(ClientDisconnected):
            await read_body(script(body(b"ab", True), {"type": "http.disconnect"}))

    asyncio.run(main())


def test_a_disconnect_cancels_the_work_inside_the_watch_and_nothing_else():
    async def main() -> tuple[bool, bool]:
        gone = asyncio.Event()
        with ClientWatch(script(then=gone)) as client:
            asyncio.get_running_loop().call_later(0.01, gone.set)
            await asyncio.sleep(10)  # the work: cancelled when the client leaves
        await asyncio.sleep(0)  # the cancellation was swallowed: awaiting still works
        return client.disconnected, asyncio.current_task().cancelling() == 0

    assert asyncio.run(asyncio.wait_for(main(), 5)) == (True, True)


def test_work_that_ends_first_is_not_cancelled():
    async def main() -> bool:
        gone = asyncio.Event()
        with ClientWatch(script(then=gone)) as client:
            await asyncio.sleep(0.01)
        gone.set()  # e.g. the response completed
        # The barrier: the watcher has ended, so nothing it could still do is missed.
        await asyncio.gather(client._watcher, return_exceptions=True)
        return client.disconnected

    assert asyncio.run(main()) is False
