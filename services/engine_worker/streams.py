"""Each request's event stream back to its gateway: what the engine's steps produced, as
``Tokens``, ``PromptLogprobs``, ``Finished`` and ``Failed`` in ``seq`` order, and a
keep-alive for a stream that waits.

Used on the engine thread only (``EngineThread``): it owns the streams' state and hands
back the messages to publish, as ``(subject, message, trace context)``.

With a stream interval of ``n`` (vLLM's ``--stream-interval``), a decoding stream's
tokens leave every ``n`` tokens instead of every step: its first tokens go at once (the
time to first token is not held back), and what is held goes with its end (``Finished``,
or ahead of a ``Failed``, so a request that moves on resumes after every token it made)
and with a keep-alive. Fewer, larger events: a bus message, a gateway wake-up and an SSE
write per ``n`` tokens instead of per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, StatusCode

from lamina.schemas.v1.generate import (
    Failed,
    Finished,
    FinishReason,
    PromptLogprobs,
    RejectReason,
    TokenLogprob,
    Tokens,
    Usage,
)
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.engine.outputs import RequestOutput
from lamina.services.engine_worker.engine.request import RankedLogprob

Outgoing = tuple[str, Any, Any]  # (subject, message, trace context or None)

PROMPT_LOGPROB_PAIRS = 8192
"""(token, logprob) pairs per ``PromptLogprobs`` message: about 250 KB of JSON, well
under the bus's smallest usual ``max_payload`` (1 MB)."""


@dataclass
class Stream:
    """Where one request's events go, and how many have gone."""

    reply: str
    context: Any
    """The trace context its events carry: its span here, when it is traced."""
    seq: int = 1  # 0 was Accepted
    span: Span | None = None
    """The worker's side of the request, from the engine taking it to its end."""
    scheduled: bool = False
    """It has run in a step since it was (re)admitted."""
    prefilled: bool = False
    """It has produced a token since it was (re)admitted: its steps now are decodes."""
    tokens_sent: bool = False
    """Any output has gone to its client (what a ``Failed`` tells)."""
    sent_at: float = field(default_factory=time.monotonic)
    """When its last event went (``Accepted`` was sent as it was added)."""
    held: list[int] = field(default_factory=list)
    """Tokens made but not sent yet (a stream interval above 1)."""
    held_logprobs: list[TokenLogprob] | None = None
    """Their logprobs, when the request asked for them."""

    def end(self, status: str, **attributes: Any) -> None:
        """End the span (if any) with how the request ended here."""
        if self.span is None:
            return
        self.span.set_attributes({"lamina.end": status, **attributes})
        if status in ("failed", "deadline_exceeded"):
            self.span.set_status(StatusCode.ERROR, status)
        self.span.end()
        self.span = None

    def next_seq(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def hold(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        self.held += token_ids
        if logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + logprobs

    def release(self) -> tuple[list[int], list[TokenLogprob] | None]:
        """What was held, now to be sent."""
        held, logprobs = self.held, self.held_logprobs
        self.held, self.held_logprobs = [], None
        return held, logprobs


class Streams(dict[str, Stream]):
    """The open streams by request id, and the messages that move them on."""

    def __init__(self, interval: int = 1) -> None:
        super().__init__()
        if interval < 1:
            raise ValueError(f"a stream interval is at least 1 token, not {interval}")
        self.interval = interval
        """Tokens a decoding stream sends at once (1: every step's)."""

    def outputs(self, outputs: list[RequestOutput]) -> list[Outgoing]:
        """Each request's new tokens (or its end) from one step, for its reply inbox;
        a stream that ended is closed."""
        batch: list[Outgoing] = []
        now = time.monotonic()
        for out in outputs:
            stream = self.get(out.request_id)
            if stream is None:
                continue
            if not stream.tokens_sent and stream.span is not None:
                stream.span.add_event("first_token")
            first = not stream.tokens_sent
            stream.prefilled = stream.tokens_sent = True
            if out.prompt_logprobs is not None:
                for message in _prompt_logprobs(out.request_id, stream, out.prompt_logprobs):
                    batch.append((stream.reply, message, stream.context))
            if out.error is None:
                stream.hold(out.new_token_ids, wire.token_logprobs(out.new_logprobs))
                if not first and not out.finished and len(stream.held) < self.interval:
                    continue
            stream.sent_at = now
            batch += [(stream.reply, m, stream.context) for m in self._messages(out, stream)]
        return batch

    def _messages(self, out: RequestOutput, stream: Stream) -> list[Tokens | Finished | Failed]:
        rid = out.request_id
        if out.error is not None:
            del self[rid]
            stream.end("failed", **{"error.type": out.error[:200]})
            return _after_held(
                rid, stream, message=out.error, retryable=False, tokens_sent=stream.tokens_sent
            )
        token_ids, logprobs = stream.release()  # what it held, this step's last
        if not out.finished:
            return [
                Tokens(
                    request_id=rid, seq=stream.next_seq(), token_ids=token_ids, logprobs=logprobs
                )
            ]
        del self[rid]
        reason = FinishReason(str(out.finish_reason))
        stream.end(
            "finished",
            **{
                "gen_ai.response.finish_reasons": [str(reason)],
                "gen_ai.usage.output_tokens": out.num_output_tokens,
                "lamina.cached_tokens": out.num_cached_tokens,
            },
        )
        finished = Finished(
            request_id=rid,
            seq=stream.next_seq(),
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
            ),
            token_ids=token_ids,
            logprobs=logprobs,
            timings=wire.timings(out.timings) if out.timings is not None else None,
        )
        return [finished]

    def fail(
        self,
        request_id: str,
        message: str,
        *,
        retryable: bool,
        reason: RejectReason | None = None,
        status: str = "failed",
    ) -> list[Outgoing]:
        """Close a request's stream with a ``Failed`` (nothing if it has none)."""
        stream = self.pop(request_id, None)
        if stream is None:
            return []
        if status == "failed":
            stream.end(status, **{"error.type": message[:200]})
        else:
            stream.end(status)
        messages = _after_held(
            request_id,
            stream,
            message=message,
            retryable=retryable,
            tokens_sent=stream.tokens_sent,
            reason=reason,
        )
        return [(stream.reply, m, stream.context) for m in messages]

    def keepalives(self, now: float, silence_s: float) -> list[Outgoing]:
        """An empty ``Tokens`` to every stream silent for ``silence_s``: its gateway learns
        that it waits here and is not lost."""
        batch: list[Outgoing] = []
        for rid, stream in self.items():
            if now - stream.sent_at >= silence_s:  # what it holds, or nothing
                token_ids, logprobs = stream.release()
                tokens = Tokens(
                    request_id=rid, seq=stream.next_seq(), token_ids=token_ids, logprobs=logprobs
                )
                batch.append((stream.reply, tokens, stream.context))
                stream.sent_at = now
        return batch


def _after_held(request_id: str, stream: Stream, **failed: Any) -> list[Tokens | Failed]:
    """A ``Failed`` (of ``failed``'s fields), after a ``Tokens`` of what ``stream`` held
    if anything: the gateway that moves the request on resumes after every token made."""
    messages: list[Tokens | Failed] = []
    if stream.held:
        token_ids, logprobs = stream.release()
        seq = stream.next_seq()
        messages.append(
            Tokens(request_id=request_id, seq=seq, token_ids=token_ids, logprobs=logprobs)
        )
    return [*messages, Failed(request_id=request_id, seq=stream.next_seq(), **failed)]


def _prompt_logprobs(
    request_id: str, stream: Stream, logprobs: list[RankedLogprob]
) -> list[PromptLogprobs]:
    """A request's prompt logprobs as messages, numbered from ``stream.seq`` on."""
    width = 1 + max((len(top) for _, _, top in logprobs), default=0)
    per_message = max(1, PROMPT_LOGPROB_PAIRS // width)
    return [
        PromptLogprobs(
            request_id=request_id,
            seq=stream.next_seq(),
            start=start + 1,
            logprobs=[TokenLogprob(lp, top) for lp, _, top in part],
            ranks=[rank for _, rank, _ in part],
        )
        for start in range(0, len(logprobs), per_message)
        for part in [logprobs[start : start + per_message]]
    ]
