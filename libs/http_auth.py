"""API keys for the HTTP services: ``Authorization: Bearer <key>``, as vLLM's ``--api-key``.

:class:`ApiKeys` wraps an ASGI app. Every HTTP request outside ``open_paths`` must carry
one of the keys; otherwise it is answered 401 in OpenAI's error shape (``code``
``invalid_api_key``) with ``WWW-Authenticate: Bearer``, before the app sees it. The key
is compared with every configured key in constant time (``hmac.compare_digest``, no early
exit), so timing tells nothing about which key, or how much of one, was right.

A key may carry the best (lowest) ``priority`` its requests may ask for: the app finds it
in the scope under ``lamina.best_priority`` (None: any).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
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


def load_keys(keys: str, keys_file: str = "") -> dict[str, int | None]:
    """``{key: best priority or None}`` from a comma-separated list (no priority) and a
    file of one ``key [best_priority]`` per line (``#`` comments and blank lines
    ignored). Raises ``ValueError`` for an unreadable file or a bad line."""
    found: dict[str, int | None] = {k.strip(): None for k in keys.split(",") if k.strip()}
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {keys_file}: {exc}") from exc
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2 or (len(fields) == 2 and not fields[1].lstrip("-").isdigit()):
                raise ValueError(f"{keys_file}:{number}: expected 'key [best_priority]'")
            found[fields[0]] = int(fields[1]) if len(fields) == 2 else None
    return found


class ApiKeys:
    """The ASGI app ``app``, open only to requests that carry one of ``keys``."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Mapping[str, int | None] | Iterable[str],
        open_paths: Iterable[str],
    ) -> None:
        self.app = app
        priorities = keys if isinstance(keys, Mapping) else dict.fromkeys(keys)
        self.keys = [(k.encode(), p) for k, p in priorities.items()]
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        self.open_paths = frozenset(open_paths)

    def match(self, authorization: bytes) -> tuple[bool, int | None]:
        """Whether the header carries a key, and that key's best priority."""
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        matched, best = False, None
        for key, priority in self.keys:  # every key, always: no early exit
            equal = hmac.compare_digest(token.strip(), key)
            matched |= equal
            best = priority if equal else best
        return matched, best

    def allowed(self, authorization: bytes) -> bool:
        return self.match(authorization)[0]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        matched, best = self.match(headers.get(b"authorization", b""))
        if matched:
            await self.app({**scope, "lamina.best_priority": best}, receive, send)
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
