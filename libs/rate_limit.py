"""Per-principal rate limits: sequences and tokens per minute, concurrent sequences, for
an HTTP API key and a NATS API identity alike, answered as OpenAI does (429
``rate_limit_exceeded`` with ``Retry-After``; ``x-ratelimit-*`` headers on every HTTP
response of a limited key).

A request is charged as the sequences it runs (each prompt of a batch, times ``n``), not
as one call: each counts against ``concurrent`` while it runs and against ``rpm`` when it
is taken. Tokens are reserved when it is taken, each sequence's prompt plus the most it
may generate, and settled from its usage when it ends (what it did not use goes back).
A request is taken only when every limit holds all of it; one larger than a whole
limit can never be, and is refused as too large, without a time to retry.

Each per-minute limit is a token bucket that holds a minute's allowance and refills
continuously, so a principal may burst up to its allowance and then goes at its rate.
:class:`Quota` is pure (a clock is passed in); the gateway's ``Intake`` calls it where
it starts work, and :class:`RateLimitHeaders` puts a key's quota in the ASGI scope and
its figures on the responses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from lamina.libs.http_auth import ASGIApp, Limits, Scope


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

    def holds(self, amount: float) -> bool:
        self._refill()
        return self.level >= amount

    def take(self, amount: float) -> None:
        """Take ``amount`` (negative: give it back), the level capped at a full bucket."""
        self._refill()
        self.level = min(self.capacity, self.level - amount)

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


class RateLimited(Exception):
    """A request its principal's limits refuse: ``kind`` is OpenAI's error type
    (``requests`` or ``tokens``); ``wait_s`` is when it would be admitted (None: never,
    it is larger than the limit itself)."""

    def __init__(self, kind: str, message: str, wait_s: float | None) -> None:
        super().__init__(message)
        self.kind, self.message, self.wait_s = kind, message, wait_s


class Quota:
    """One principal's limits and what it holds of them."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = Bucket(rpm, clock) if rpm is not None else None
        self.tokens = Bucket(tpm, clock) if tpm is not None else None
        self.open = 0
        """Sequences taken and not yet released."""

    def take(self, sequences: int, tokens: int) -> None:
        """Take ``sequences`` reserving ``tokens`` between them, or raise
        :class:`RateLimited` (then nothing is taken). Each is released by
        :meth:`release`."""
        concurrent, rpm, tpm = (
            self.limits.concurrent,
            self.limits.requests_per_minute,
            self.limits.tokens_per_minute,
        )
        if concurrent is not None and self.open + sequences > concurrent:
            why = f"{sequences} sequences with {self.open} running exceed {concurrent} concurrent"
            raise RateLimited("requests", why, None if sequences > concurrent else 1.0)
        if self.tokens is not None and not self.tokens.holds(tokens):
            why = f"{tokens} tokens reserved (prompts and max_tokens) exceed {tpm} per minute"
            raise RateLimited("tokens", why, None if tokens > tpm else self.tokens.wait_s(tokens))
        if self.requests is not None and not self.requests.holds(sequences):
            why = f"{sequences} sequences exceed {rpm} requests per minute"
            wait = None if sequences > rpm else self.requests.wait_s(sequences)
            raise RateLimited("requests", why, wait)
        if self.requests is not None:
            self.requests.take(sequences)
        if self.tokens is not None:
            self.tokens.take(tokens)
        self.open += sequences

    def release(self, reserved: int, used: int) -> None:
        """One sequence ended, having reserved ``reserved`` tokens and used ``used``."""
        self.open -= 1
        if self.tokens is not None:
            self.tokens.take(used - reserved)

    def headers(self) -> list[tuple[bytes, bytes]]:
        found = []
        if self.requests is not None:
            found += self.requests.headers(b"requests")
        if self.tokens is not None:
            found += self.tokens.headers(b"tokens")
        return found


def quotas(limits: Mapping[str, Limits], clock: Callable[[], float] = time.monotonic) -> dict:
    """A :class:`Quota` per principal that has any limit."""
    return {name: Quota(lim, clock) for name, lim in limits.items() if lim.any}


class RateLimitHeaders:
    """``app`` with each API key's :class:`Quota` in the scope (``lamina.quota``, for the
    app to admit by) and its figures on every response (the key is the one ``ApiKeys``
    matched, ``scope["lamina.api_key"]``); requests of other keys pass untouched."""

    def __init__(self, app: ASGIApp, by_key: Mapping[str, Quota]) -> None:
        self.app = app
        self.by_key = by_key

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        quota = (
            self.by_key.get(scope.get("lamina.api_key", "")) if scope["type"] == "http" else None
        )
        if quota is None:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *quota.headers()]}
            await send(message)

        await self.app({**scope, "lamina.quota": quota}, receive, send_with_headers)
