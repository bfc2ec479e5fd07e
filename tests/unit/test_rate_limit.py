"""Per-key rate limits on an ASGI app, on a clock the test moves."""

from __future__ import annotations

import asyncio
import json

from lamina.libs.http_auth import Limits
from lamina.libs.rate_limit import RateLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def app(scope, receive, send) -> None:
    """Spends 300 tokens (what the gateway charges from a finished request's usage)."""
    if "lamina.charge" in scope:  # a key with limits
        scope["lamina.charge"](300)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(limits: RateLimits, key: str = "k") -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [], "lamina.api_key": key}
    asyncio.run(limits(scope, None, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_requests_per_minute_burst_then_refill_at_the_rate():
    clock = Clock()
    limits = RateLimits(app, {"k": Limits(requests_per_minute=3)}, clock=clock)
    statuses = [call(limits)[0] for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    status, headers, body = call(limits)
    error = json.loads(body)["error"]
    assert status == 429 and error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests" and "3 requests per minute" in error["message"]
    assert headers[b"retry-after"] == b"20"  # one request every 20 s
    assert headers[b"x-ratelimit-limit-requests"] == b"3"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"60s"  # until all 3 are back
    clock.now += 20
    status, headers, _ = call(limits)
    assert status == 200 and headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert call(limits, key="other")[0] == 200  # a key without limits is not counted


def test_tokens_are_charged_after_the_request_and_a_debt_is_waited_out():
    clock = Clock()
    limits = RateLimits(app, {"k": Limits(tokens_per_minute=600)}, clock=clock)
    assert [call(limits)[0] for _ in range(3)] == [200, 200, 429]  # 600 spent by two
    status, headers, body = call(limits)
    error = json.loads(body)["error"]
    assert (
        status == 429 and error["type"] == "tokens" and "600 tokens per minute" in error["message"]
    )
    assert headers[b"x-ratelimit-remaining-tokens"] == b"0"
    clock.now += 0.2  # 2 tokens back: the bucket is not empty, the request is admitted
    assert call(limits)[0] == 200
    status, headers, _ = call(limits)  # ...and overdrew it: ~298 tokens of debt
    assert status == 429 and int(headers[b"retry-after"]) == 30


def test_concurrent_requests_beyond_the_limit_are_refused_until_one_ends():
    release = asyncio.Event()

    async def slow(scope, receive, send) -> None:
        await release.wait()
        await app(scope, receive, send)

    limits = RateLimits(slow, {"k": Limits(concurrent=2)})

    async def main() -> list[int]:
        statuses: list[int] = []

        async def one() -> None:
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "path": "/", "headers": [], "lamina.api_key": "k"}
            await limits(scope, None, send)
            statuses.append(sent[0]["status"])

        first = [asyncio.create_task(one()) for _ in range(2)]
        await asyncio.sleep(0)
        await one()  # the third, while two are open
        release.set()
        await asyncio.gather(*first)
        await one()  # after they ended
        return statuses

    assert asyncio.run(main()) == [429, 200, 200, 200]
