"""The gateway with API keys: no key and a wrong key are 401 in OpenAI's shape, either
configured key works, the OpenAI client sends it as it should, probes stay open, and a
key that carries a best priority cannot ask for a better one (403), and a key's rate
limit answers as OpenAI's does (429, ``Retry-After``, ``x-ratelimit-*``)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.e2e.conftest import make_stack


def test_the_gateway_takes_only_requests_with_a_key(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(  # tenant: 5 at best
        "from-file\ntenant 5\nmetered rpm=2 tpm=600\nnarrow concurrent=2\nbudget tpm=3000\n"
    )
    stack = make_stack(
        tiny_model, tmp_path, gateway_args=["--api-key", "k1", "--api-key-file", str(keys)]
    )
    body = {"prompt": "Once", "max_tokens": 2}
    with stack:
        url = stack.base_url
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(url + "/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        for key in ("k1", "from-file"):
            response = httpx.post(
                url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
        tenant = {"Authorization": "Bearer tenant"}
        for priority, status in ((5, 200), (9, 200), (0, 403)):
            response = httpx.post(
                url + "/v1/completions", json=body | {"priority": priority}, headers=tenant
            )
            assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == "priority_not_allowed"
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert client.completions.create(model="lamina-tiny", **body).choices
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="lamina-tiny", **body)
        metered = {"Authorization": "Bearer metered"}
        long = body | {"max_tokens": 50}  # 50 tokens reserved: five seconds of the rate
        first, second, third = (
            httpx.post(url + "/v1/completions", json=long, headers=metered) for _ in range(3)
        )
        assert (first.status_code, second.status_code) == (200, 200)
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(second.headers["x-ratelimit-remaining-tokens"]) < 600  # reserved
        assert third.status_code == 429 and third.headers["retry-after"] in ("29", "30")
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        check_sequences_and_tokens_are_charged(url)


def check_sequences_and_tokens_are_charged(url: str) -> None:
    """A batch is charged as its sequences (``concurrent`` counts them) and its tokens are
    reserved at admission (prompts plus ``max_tokens``), so two batches that together
    would overspend ``tpm`` are not both admitted."""
    batch = {"prompt": ["Once"] * 4, "max_tokens": 400, "ignore_eos": True}
    wide = httpx.post(
        url + "/v1/completions", json=batch, headers={"Authorization": "Bearer narrow"}
    )
    assert wide.status_code == 429 and "retry-after" not in wide.headers  # never fits
    assert "4 sequences with 0 running exceed 2 concurrent" in wide.json()["error"]["message"]

    async def both() -> list[httpx.Response]:
        budget = {"Authorization": "Bearer budget"}
        async with httpx.AsyncClient(base_url=url, headers=budget, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=batch) for _ in range(2))
            )

    responses = asyncio.run(both())
    assert sorted(r.status_code for r in responses) == [200, 429]
    (refused,) = (r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "tokens"
    (served,) = (r for r in responses if r.status_code == 200)
    usage = served.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 3000
