"""Bus errors: each carries the data needed to act on it."""

from __future__ import annotations

from typing import Any

import msgspec


def error_body(
    error_type: str, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, the one every HTTP error of Lamina's takes; ``code`` is a
    string (a machine-readable reason) or null."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_field(exc: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error is about (``max_tokens``, ``messages[0].role``),
    from its ``- at `$.<path>``` suffix; None when it is about the whole value."""
    text = str(exc)
    if "`$." not in text:
        return None
    return text.split("`$.", 1)[1].split("`", 1)[0]


class CannotStart(Exception):
    """A service cannot start, for a reason its message says in full (a traceback would
    add nothing): reported in one line, and the service exits 1."""


class BusError(Exception):
    """Base of every error the bus library raises."""


class NotAdmitted(BusError):
    """The NATS server refused this process's credential (or its lack of one)."""

    def __init__(self, url: str, error: str) -> None:
        super().__init__(
            f"the NATS server at {url} refused the connection ({error}): pass the "
            "credential it admits with --nats-credential / LAMINA_NATS_CREDENTIAL"
        )
        self.url = url


class Unreachable(BusError):
    """No NATS server answered within the time a process gives its first connection."""

    def __init__(self, url: str, timeout: float, error: str) -> None:
        super().__init__(f"cannot reach NATS at {url} within {timeout:g}s ({error})")
        self.url = url
        self.timeout = timeout


class NoResponders(BusError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"no service is subscribed to {subject!r}")
        self.subject = subject


class RequestTimeout(BusError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(f"no reply on {subject!r} within {timeout:g}s")
        self.subject = subject
        self.timeout = timeout


class PayloadTooLarge(BusError):
    def __init__(self, subject: str, size: int, max_payload: int) -> None:
        super().__init__(
            f"message for {subject!r} is {size} bytes, over the server's max_payload "
            f"({max_payload} bytes)"
        )
        self.subject = subject
        self.size = size
        self.max_payload = max_payload


class BadReply(BusError):
    """A reply arrived but did not decode as the expected type."""

    def __init__(self, subject: str, error: str) -> None:
        super().__init__(f"reply on {subject!r} did not decode: {error}")
        self.subject = subject
        self.error = error
