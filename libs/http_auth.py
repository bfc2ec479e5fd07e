"""API keys for the HTTP services: ``Authorization: Bearer <key>``, as vLLM's ``--api-key``.

:class:`ApiKeys` wraps an ASGI app. Every HTTP request outside ``open_paths`` must carry
one of the keys; otherwise it is answered 401 in OpenAI's error shape (``code``
``invalid_api_key``) with ``WWW-Authenticate: Bearer``, before the app sees it. The key
is compared with every configured key in constant time (``hmac.compare_digest``, no early
exit), so timing tells nothing about which key, or how much of one, was right.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Any]

_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "missing or incorrect API key: send Authorization: Bearer <key>",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


def load_keys(keys: str, keys_file: str = "") -> list[str]:
    """Keys from a comma-separated list and a file of one key per line (``#`` comments
    and blank lines ignored). Raises ``ValueError`` for an unreadable file."""
    found = [k.strip() for k in keys.split(",") if k.strip()]
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {keys_file}: {exc}") from exc
        found += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return found


class ApiKeys:
    """The ASGI app ``app``, open only to requests that carry one of ``keys``."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        self.open_paths = frozenset(open_paths)

    def allowed(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        matched = False
        for key in self.keys:  # every key, always: no early exit
            matched |= hmac.compare_digest(token.strip(), key)
        return matched

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.allowed(headers.get(b"authorization", b"")):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(_UNAUTHORIZED)),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
