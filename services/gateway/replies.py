"""What the gateway's HTTP routes share to answer: an error in OpenAI's shape
(``libs.errors.error_body``), ``Retry-After``, and a stream read whole."""

from __future__ import annotations

import math
from typing import Any

from lamina.libs.errors import error_body
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.text_stream import TextDelta, TextStream


def error_of(exc: GenerationError) -> dict[str, Any]:
    """``exc`` as OpenAI's error body."""
    return error_body(exc.error_type, exc.message, exc.param, exc.code)


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
