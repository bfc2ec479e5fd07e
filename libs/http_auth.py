"""API keys for the HTTP services: ``Authorization: Bearer <key>``, as vLLM's ``--api-key``.

:class:`ApiKeys` wraps an ASGI app. Every HTTP request outside ``open_paths`` must carry
one of the keys; otherwise it is answered 401 in OpenAI's error shape (``code``
``invalid_api_key``) with ``WWW-Authenticate: Bearer``, before the app sees it. The key
is compared with every configured key in constant time (``hmac.compare_digest``, no early
exit), so timing tells nothing about which key, or how much of one, was right.

A key may carry the best (lowest) ``priority`` its requests may ask for, which the app
finds in the scope under ``lamina.best_priority`` (None: any), and rate limits
(``lamina.libs.rate_limit``), which find the key under ``lamina.api_key``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lamina.libs.errors import error_body

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Any]


@dataclass(frozen=True)
class Limits:
    """One key's rate limits (None: unlimited); enforced by ``lamina.libs.rate_limit``."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent: int | None = None

    @property
    def any(self) -> bool:
        return (self.requests_per_minute, self.tokens_per_minute, self.concurrent) != (None,) * 3


@dataclass(frozen=True)
class KeyPolicy:
    """What a key may do."""

    best_priority: int | None = None
    limits: Limits = field(default_factory=Limits)


POLICY_LINE = "{what} [best_priority] [rpm=N] [tpm=N] [concurrent=N]"
_LIMIT_FIELDS = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute"}
_LIMIT_FIELDS["concurrent"] = "concurrent"


def load_keys(keys: str, keys_file: str = "") -> dict[str, KeyPolicy]:
    """Every key and its policy, from a comma-separated list (no priority, no limits) and
    a file of one ``key [best_priority] [rpm=N] [tpm=N] [concurrent=N]`` per line (``#``
    comments and blank lines ignored). Raises ``ValueError`` for an unreadable file or a
    bad line."""
    found = {k.strip(): KeyPolicy() for k in keys.split(",") if k.strip()}
    return found | (load_policies(keys_file, "key") if keys_file else {})


def load_policies(path: str, what: str) -> dict[str, KeyPolicy]:
    """A file of one ``<what> [best_priority] [rpm=N] [tpm=N] [concurrent=N]`` per line
    (``#`` comments and blank lines ignored): each name's policy. Raises ``ValueError``
    for an unreadable file or a bad line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    found = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            try:
                found[fields[0]] = _policy(fields[1:])
            except ValueError as exc:
                line_form = POLICY_LINE.format(what=what)
                raise ValueError(f"{path}:{number}: expected '{line_form}'") from exc
    return found


def _policy(fields: list[str]) -> KeyPolicy:
    best, limits = None, {}
    for position, item in enumerate(fields):
        name, equals, value = item.partition("=")
        if not equals and position == 0:
            best = int(item)
        elif name in _LIMIT_FIELDS and value.isdigit() and int(value) > 0:
            limits[_LIMIT_FIELDS[name]] = int(value)
        else:
            raise ValueError(item)
    return KeyPolicy(best, Limits(**limits))


async def send_error(
    send: Any,
    status: int,
    message: str,
    code: str,
    headers: list[tuple[bytes, bytes]],
    error_type: str = "invalid_request_error",
) -> None:
    """An error response in OpenAI's shape, before any app has answered."""
    body = json.dumps(error_body(error_type, message, code=code)).encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeys:
    """The ASGI app ``app``, open only to requests that carry one of ``keys``."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Mapping[str, KeyPolicy] | Iterable[str],
        open_paths: Iterable[str],
    ) -> None:
        self.app = app
        policies = keys if isinstance(keys, Mapping) else dict.fromkeys(keys, KeyPolicy())
        self.keys = [(k.encode(), p.best_priority) for k, p in policies.items()]
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        self.open_paths = frozenset(open_paths)

    def match(self, authorization: bytes) -> tuple[bytes | None, int | None]:
        """The key the header carries (None: none of ours), and its best priority."""
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        matched, best = None, None
        for key, priority in self.keys:  # every key, always: no early exit
            equal = hmac.compare_digest(token.strip(), key)
            matched = key if equal else matched
            best = priority if equal else best
        return matched, best

    def allowed(self, authorization: bytes) -> bool:
        return self.match(authorization)[0] is not None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        matched, best = self.match(headers.get(b"authorization", b""))
        if matched is not None:
            scope = {**scope, "lamina.best_priority": best, "lamina.api_key": matched.decode()}
            await self.app(scope, receive, send)
            return
        await send_error(
            send,
            401,
            "missing or incorrect API key: send Authorization: Bearer <key>",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )
