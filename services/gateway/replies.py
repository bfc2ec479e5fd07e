"""What the gateway's HTTP routes share to answer: OpenAI's error body, ``Retry-After``,
and a stream read whole."""

from __future__ import annotations

import math
from typing import Any

from lamina.services.gateway.admission import TextDelta, TextStream
from lamina.services.gateway.errors import GenerationError


def error_body(
    status: int, error_type: str, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape; ``code`` is a string (a machine-readable reason) or null."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_of(exc: GenerationError) -> dict[str, Any]:
    """``exc`` as OpenAI's error body."""
    return error_body(exc.status, exc.error_type, exc.message, exc.param, exc.code)


def retry_headers(exc: GenerationError) -> list[tuple[bytes, bytes]]:
    """``Retry-After`` (whole seconds, rounded up) when the refusal says when."""
    if exc.retry_after_s is None:
        return []
    return [(b"retry-after", b"%d" % max(1, math.ceil(exc.retry_after_s)))]


async def whole(stream: TextStream) -> TextDelta:
    """A stream's text, tokens and logprobs in one delta, with its finish and usage."""
    text, ids, lps, calls, last, prompt = [], [], [], [], None, None
    async for delta in stream.deltas():
        text.append(delta.text)
        ids += delta.token_ids
        if delta.logprobs is not None:
            lps += delta.logprobs
        calls += delta.tool_calls or ()
        prompt = prompt or delta.prompt
        last = delta
    return TextDelta(
        "".join(text), ids, lps or None, last.finish_reason, last.usage, calls or None, prompt
    )
