"""The gateway's raw-ASGI pieces against scripted ``receive`` callables."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from lamina.services.gateway.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    ClientWatch,
    direct_routes,
    read_body,
)
from lamina.services.gateway.completions import CompletionsApi
from lamina.services.gateway.protocol import CompletionRequest
from lamina.services.gateway.tokenizer import ModelTokenizer


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


def test_direct_routes_take_their_paths_as_the_router_would_and_leave_it_the_rest():
    calls: list[str] = []

    def app(name: str):
        async def handle(scope, receive, send) -> None:
            calls.append(f"{name} {scope['path']}")

        return handle

    front = direct_routes({"/v1/completions": app("direct")}, app("router"))

    async def main() -> None:
        for path in ("/v1/completions", "/v1/completions/", "//v1//completions", "/v1/models"):
            await front({"type": "http", "path": path}, script(), None)
        await front({"type": "lifespan", "path": "/v1/completions"}, script(), None)

    asyncio.run(main())
    assert calls == [
        "direct /v1/completions",
        "direct /v1/completions/",
        "direct //v1//completions",
        "router /v1/models",
        "router /v1/completions",
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_in_a_completion_route_is_a_500_in_openais_shape(tiny_model, stream):
    """The completion routes are not Litestar's (``direct_routes``): an unexpected error
    before the response started is answered by the route itself, as Litestar would."""
    intake = SimpleNamespace(tokenizer=ModelTokenizer(tiny_model), model_name="lamina-tiny")
    api = CompletionsApi(intake)  # type: ignore[arg-type]

    async def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    api.open_in_callers_trace = broken  # type: ignore[method-assign]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    payload = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(api.serve(scope, script(body(payload, False)), send, lambda _: CompletionRequest))
    start, last = sent
    assert start["status"] == 500
    assert json.loads(last["body"])["error"]["type"] == "api_error"
