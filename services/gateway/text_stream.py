"""An accepted request read as text: the worker's token events detokenized, stop strings
applied, tool calls parsed, as the deltas both client APIs stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from lamina.schemas.v1.generate import (
    Finished,
    FinishReason,
    PromptLogprobs,
    TokenLogprob,
    Tokens,
    Usage,
)
from lamina.services.gateway.detokenizer import IncrementalDetokenizer
from lamina.services.gateway.remote_request import RemoteRequest
from lamina.services.gateway.tool_calls import ToolCall, ToolParser


def _text_tokens(event: Tokens | Finished, include_stop: bool) -> list[int]:
    """The tokens of ``event`` that become text: not the stop token (EOS or one of
    ``stop_token_ids``) a request finished on, unless asked to (vLLM's
    ``include_stop_str_in_output``)."""
    finished_on_stop = isinstance(event, Finished) and event.finish_reason == FinishReason.STOP
    if finished_on_stop and not include_stop:
        return event.token_ids[:-1]
    return event.token_ids


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """A prompt's logprobs: for each token from the second, its logprob, top alternatives
    and rank (the first token has none)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    ranks: list[int]


@dataclass(slots=True)
class TextDelta:
    """New text and the tokens behind it; the last delta has ``finish_reason`` and usage."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | str | None = None
    """Why the stream ended; ``tool_calls`` is set by a tool parser, not by the wire."""
    usage: Usage | None = None
    tool_calls: list[ToolCall] | None = None
    """Calls a tool parser found in this delta's text (the text then holds the rest)."""
    prompt: ScoredPrompt | None = None
    """On the first delta, if asked for (``Sampling.prompt_logprobs``)."""


class TextStream:
    """An accepted request, read as text. Always :meth:`close` it (or use ``async with``)."""

    def __init__(
        self,
        remote: RemoteRequest,
        detokenizer: IncrementalDetokenizer,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.remote = remote
        self.detokenizer = detokenizer
        self.completion_tokens = 0
        self._on_close = on_close
        self.tool_parser: ToolParser | None = None
        """Where set, every delta's text is split into content and tool calls."""

    @property
    def request_id(self) -> str:
        return self.remote.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.remote.request.prompt_token_ids

    @property
    def prompt_tokens(self) -> int:
        return len(self.remote.request.prompt_token_ids)

    def usage_so_far(self) -> Usage:
        """The prompt's tokens and those generated up to the last delta."""
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    def deltas(self) -> AsyncIterator[TextDelta]:
        """The stream's deltas, each through :attr:`tool_parser` where one is set (without
        one, no generator stands between a token and its reader)."""
        parser = self.tool_parser
        return self._deltas() if parser is None else self._parsed(parser)

    async def _parsed(self, parser: ToolParser) -> AsyncIterator[TextDelta]:
        async for delta in self._deltas():
            yield parser.apply(delta)

    async def _deltas(self) -> AsyncIterator[TextDelta]:
        detok = self.detokenizer
        logprobs: list[TokenLogprob] = []
        ranks: list[int] = []
        prompt: ScoredPrompt | None = None
        async for event in self.remote.stream():
            if isinstance(event, PromptLogprobs):
                if event.start == 1:  # from the start again (a move before any token)
                    logprobs, ranks = [], []
                logprobs += event.logprobs
                ranks += event.ranks
                prompt_ids = self.remote.request.prompt_token_ids
                prompt = ScoredPrompt(prompt_ids, logprobs, ranks)
                continue
            self.completion_tokens += len(event.token_ids)
            text = detok.add(_text_tokens(event, detok.include_stop))
            if detok.stopped:  # a stop string matched: end here, cancel the rest
                self.remote.stop_early()
                yield TextDelta(
                    text,
                    event.token_ids,
                    event.logprobs,
                    FinishReason.STOP,
                    self.usage_so_far(),
                    prompt=prompt,
                )
                return
            if isinstance(event, Finished):
                text += detok.flush()  # may still find a stop string in held-back text
                reason = FinishReason.STOP if detok.stopped else event.finish_reason
                yield TextDelta(
                    text, event.token_ids, event.logprobs, reason, event.usage, prompt=prompt
                )
                return
            yield TextDelta(text, event.token_ids, event.logprobs, prompt=prompt)
            prompt = None  # on the first delta only

    async def close(self) -> None:
        """End the request wherever it is; what it held is given back at once (before the
        cancel and the record are sent), so the caller's next request finds it free."""
        on_close, self._on_close = self._on_close, lambda: None  # once, however often closed
        on_close()
        await self.remote.__aexit__(None, None, None)

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
