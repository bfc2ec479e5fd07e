"""API keys in front of an ASGI app: the right key passes, anything else is a 401 in
OpenAI's shape, and the open paths stay open."""

from __future__ import annotations

import asyncio
import json

import pytest

from lamina.libs.http_auth import ApiKeys, KeyPolicy, Limits, load_keys


async def app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(guard: ApiKeys, path: str, authorization: bytes | None) -> tuple[int, dict, bytes]:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope = {"type": "http", "path": path, "headers": headers}
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.mark.parametrize(
    "authorization", [None, b"Bearer nope", b"Basic k1", b"Bearer ", b"k1", b"Bearer k1k1"]
)
def test_a_missing_or_wrong_key_is_a_401_in_openais_shape(authorization):
    guard = ApiKeys(app, ["k1", "k2"], open_paths=["/health"])
    status, headers, body = call(guard, "/v1/completions", authorization)
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer"
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )


@pytest.mark.parametrize("authorization", [b"Bearer k1", b"Bearer k2", b"bearer k2"])
def test_any_configured_key_passes(authorization):
    guard = ApiKeys(app, ["k1", "k2"], open_paths=[])
    assert call(guard, "/v1/models", authorization)[0] == 200


def test_the_matched_keys_best_priority_reaches_the_app():
    seen = {}

    async def remember(scope, receive, send) -> None:
        seen["best"] = scope["lamina.best_priority"]
        await app(scope, receive, send)

    guard = ApiKeys(remember, {"tenant": KeyPolicy(5), "admin": KeyPolicy()}, open_paths=[])
    assert call(guard, "/v1/completions", b"Bearer tenant")[0] == 200 and seen["best"] == 5
    assert call(guard, "/v1/completions", b"Bearer admin")[0] == 200 and seen["best"] is None


def test_open_paths_need_no_key():
    guard = ApiKeys(app, ["k1"], open_paths=["/health", "/ready"])
    assert call(guard, "/health", None)[0] == 200
    assert call(guard, "/ready", None)[0] == 200
    assert call(guard, "/metrics", None)[0] == 401


def test_keys_come_from_the_flag_and_a_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(
        "# team a\nfile-key-1\n\n  file-key-2  5\nbatch 9 rpm=60 tpm=10000 concurrent=2\n"
        "capped concurrent=1\n"
    )
    assert load_keys(" a, b ,", str(keys)) == {
        "a": KeyPolicy(),
        "b": KeyPolicy(),
        "file-key-1": KeyPolicy(),
        "file-key-2": KeyPolicy(5),  # it may ask for priority 5 or worse (higher), no better
        "batch": KeyPolicy(
            9, Limits(requests_per_minute=60, tokens_per_minute=10000, concurrent=2)
        ),
        "capped": KeyPolicy(None, Limits(concurrent=1)),
    }
    assert load_keys("") == {}
    for bad in ("k1 high", "k1 5 6", "k1 rpm=0", "k1 rpm=x", "k1 burst=5"):
        keys.write_text(bad + "\n")
        with pytest.raises(ValueError, match="expected 'key \\[best_priority\\] \\[rpm=N\\]"):
            load_keys("", str(keys))
    with pytest.raises(ValueError, match=r"cannot read .*missing"):
        load_keys("", str(tmp_path / "missing"))
    with pytest.raises(ValueError):
        ApiKeys(app, [], open_paths=[])
