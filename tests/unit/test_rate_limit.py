"""A principal's rate limits, charged by sequences and tokens, on a clock the test moves;
and the headers a limited key's responses carry."""

from __future__ import annotations

import asyncio

import pytest

from lamina.libs.http_auth import Limits
from lamina.libs.rate_limit import Quota, RateLimited, RateLimitHeaders, quotas


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal(quota: Quota, sequences: int, tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as refused:
        quota.take(sequences, tokens)
    return refused.value


def test_requests_per_minute_count_sequences_burst_then_refill_at_the_rate():
    clock = Clock()
    quota = Quota(Limits(requests_per_minute=6), clock)
    quota.take(4, 0)  # a batch of four prompts is four requests' worth
    quota.take(2, 0)
    refused = refusal(quota, 1)
    assert refused.kind == "requests" and "6 requests per minute" in refused.message
    assert refused.wait_s == pytest.approx(10.0)  # one every 10 s
    clock.now += 20
    refused = refusal(quota, 3)  # two are back, not three
    assert refused.wait_s == pytest.approx(10.0)
    quota.take(2, 0)
    assert refusal(quota, 7).wait_s is None  # more than a minute's allowance: never


def test_concurrent_counts_open_sequences_until_each_is_released():
    quota = Quota(Limits(concurrent=4))
    quota.take(3, 0)
    refused = refusal(quota, 2)
    assert (refused.kind, refused.wait_s) == ("requests", 1.0)
    assert "2 sequences with 3 running exceed 4 concurrent" in refused.message
    quota.release(0, 0)
    quota.take(2, 0)
    assert quota.open == 4
    assert refusal(quota, 5).wait_s is None  # a request wider than the limit itself


def test_tokens_are_reserved_at_admission_and_settled_from_usage():
    clock = Clock()
    quota = Quota(Limits(tokens_per_minute=3000), clock)
    # Four sequences of 2 prompt tokens that may generate 400 each: 1608 reserved.
    quota.take(4, 4 * 402)
    refused = refusal(quota, 4, 4 * 402)  # the second such request does not fit
    assert refused.kind == "tokens" and "3000 per minute" in refused.message
    assert refused.wait_s == pytest.approx((1608 - 1392) / 50)
    for _ in range(4):
        quota.release(402, 12)  # each stopped after 10 tokens: the rest goes back
    assert quota.tokens.level == pytest.approx(3000 - 48)
    quota.take(4, 4 * 402)
    assert refusal(quota, 1, 3001).wait_s is None  # larger than the whole allowance


def test_a_sequence_that_used_more_than_it_reserved_overdraws():
    clock = Clock()
    quota = Quota(Limits(tokens_per_minute=600), clock)
    quota.take(1, 100)
    quota.release(100, 700)  # max_tokens unknown when it was reserved
    assert refusal(quota, 1, 1).wait_s == pytest.approx(101 / 10)


def test_a_refused_request_takes_nothing():
    quota = Quota(Limits(requests_per_minute=10, tokens_per_minute=100, concurrent=5))
    refusal(quota, 2, 500)
    assert (quota.open, quota.requests.level, quota.tokens.level) == (0, 10, 100)


def test_only_principals_with_limits_get_a_quota():
    assert set(quotas({"a": Limits(concurrent=1), "b": Limits()})) == {"a"}


def test_a_limited_keys_responses_carry_its_figures_and_its_quota_reaches_the_app():
    quota = Quota(Limits(requests_per_minute=3, tokens_per_minute=600))
    seen: list = []

    async def app(scope, receive, send) -> None:
        seen.append(scope.get("lamina.quota"))
        if scope["lamina.quota"] is not None:
            scope["lamina.quota"].take(1, 300)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    wrapped = RateLimitHeaders(app, {"k": quota})

    def call(key: str) -> dict[bytes, bytes]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/", "headers": [], "lamina.api_key": key}
        if key == "other":
            scope["lamina.quota"] = None
        asyncio.run(wrapped(scope, None, send))
        return dict(sent[0]["headers"])

    headers = call("k")
    assert headers[b"x-ratelimit-limit-requests"] == b"3"
    assert headers[b"x-ratelimit-remaining-requests"] == b"2"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"300"
    assert headers[b"x-ratelimit-reset-tokens"] == b"30s"
    assert call("other") == {}  # a key without limits is not counted
    assert seen == [quota, None]
