"""Per-key rate limits for the HTTP API: requests and tokens per minute, concurrent
requests, answered as OpenAI does (429 ``rate_limit_exceeded`` with ``Retry-After``, and
``x-ratelimit-*`` headers on every response of a limited key).

Each limit per minute is a token bucket that holds a minute's allowance and refills
continuously, so a key may burst up to its allowance and then goes at its rate. A request
takes one from its requests bucket when it is admitted. Tokens (prompt and completion)
are charged when the request ends, from its usage, through ``scope["lamina.charge"]``; a
request is admitted while its key's token bucket is not empty, so one long request can
overdraw it, and the key then waits until its rate has paid the debt back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from lamina.libs.http_auth import ASGIApp, Limits, Scope, send_error


class Bucket:
    """A minute's allowance, refilled continuously at ``per_minute / 60`` per second."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.level = self.capacity
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def take(self, amount: float) -> bool:
        """Take ``amount`` if the bucket holds it."""
        self._refill()
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def charge(self, amount: float) -> None:
        """Take ``amount`` regardless (it was spent): the bucket may go below empty."""
        self._refill()
        self.level -= amount

    def wait_s(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount``."""
        self._refill()
        return max(0.0, (amount - self.level) / self.rate)

    def headers(self, what: bytes) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-<what>``: the reset is the time
        until the bucket is full again."""
        self._refill()
        reset = (self.capacity - self.level) / self.rate
        return [
            (b"x-ratelimit-limit-" + what, b"%d" % self.capacity),
            (b"x-ratelimit-remaining-" + what, b"%d" % max(0, math.floor(self.level))),
            (b"x-ratelimit-reset-" + what, _duration(reset).encode()),
        ]


def _duration(seconds: float) -> str:
    """``"250ms"``, ``"6.5s"``: the form OpenAI's reset headers take."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:.1f}".rstrip("0").rstrip(".") + "s"


class _KeyState:
    def __init__(self, limits: Limits, clock: Callable[[], float]) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = Bucket(rpm, clock) if rpm is not None else None
        self.tokens = Bucket(tpm, clock) if tpm is not None else None
        self.open = 0

    def refusal(self) -> tuple[str, str, float] | None:
        """Which limit a new request hits (OpenAI's error type), why, and for how long it
        must wait; None: admitted (and counted)."""
        concurrent = self.limits.concurrent
        if concurrent is not None and self.open >= concurrent:
            return "requests", f"{concurrent} concurrent requests, this key's limit, are open", 1.0
        if self.tokens is not None and (wait := self.tokens.wait_s(1)) > 0:
            limit = self.limits.tokens_per_minute
            return "tokens", f"this key's {limit} tokens per minute are used", wait
        if self.requests is not None and not self.requests.take(1):
            limit = self.limits.requests_per_minute
            why = f"this key's {limit} requests per minute are used"
            return "requests", why, self.requests.wait_s(1)
        return None

    def headers(self) -> list[tuple[bytes, bytes]]:
        found = []
        if self.requests is not None:
            found += self.requests.headers(b"requests")
        if self.tokens is not None:
            found += self.tokens.headers(b"tokens")
        return found


class RateLimits:
    """``app`` behind each API key's :class:`Limits` (the key is the one :class:`ApiKeys`
    matched, ``scope["lamina.api_key"]``); requests of other keys pass untouched."""

    def __init__(
        self,
        app: ASGIApp,
        limits: Mapping[str, Limits],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.keys = {key: _KeyState(lim, clock) for key, lim in limits.items() if lim.any}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        state = self.keys.get(scope.get("lamina.api_key", "")) if scope["type"] == "http" else None
        if state is None:
            await self.app(scope, receive, send)
            return
        refused = state.refusal()
        if refused is not None:
            kind, why, wait = refused
            headers = [(b"retry-after", b"%d" % max(1, math.ceil(wait))), *state.headers()]
            await send_error(
                send,
                429,
                f"rate limit reached: {why}; retry after {wait:.1f}s",
                "rate_limit_exceeded",
                headers,
                error_type=kind,
            )
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *state.headers()]}
            await send(message)

        def charge(tokens: int) -> None:
            if state.tokens is not None:
                state.tokens.charge(tokens)

        state.open += 1
        try:
            await self.app({**scope, "lamina.charge": charge}, receive, send_with_headers)
        finally:
            state.open -= 1
