"""The NATS request API (``lamina.v1.api.generate``) for clients that speak NATS."""

from __future__ import annotations

import msgspec

from lamina.schemas.v1.base import Id, Message, Text
from lamina.schemas.v1.generate import FinishReason, Sampling, Sla, Usage


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Id
    content: str


class ApiRequest(Message):
    """Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    model: Id | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sla: Sla = msgspec.field(default_factory=Sla)
    stop: list[str] = []
    request_id: Id | None = None
    """Echoed on the request's events (default: the id the gateway runs it under). Only
    the client's own label: it names nothing on the bus."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string (or the stop token's text) at the end of the output."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (vLLM's default)."""


class ApiDelta(Message):
    """New text (and the tokens behind it) for the request."""

    request_id: Id
    seq: int
    text: str
    token_ids: list[int]


class ApiFinished(Message):
    request_id: Id
    seq: int
    text: str
    finish_reason: FinishReason
    usage: Usage


class ApiError(Message):
    """The request failed, as the HTTP API would say it: ``code`` is the HTTP status (400,
    503, ...), ``error_type``, ``param`` and ``error_code`` are OpenAI's error ``type``,
    ``param`` and ``code`` (e.g. ``model_not_found``)."""

    request_id: Id | None
    code: int
    error_type: Id
    message: Text
    param: Id | None = None
    error_code: Id | None = None
    retry_after_s: float | None = None
    """For 429 (``overloaded``, ``deadline_unmeetable``): when to try again."""


ApiEvent = ApiDelta | ApiFinished | ApiError
