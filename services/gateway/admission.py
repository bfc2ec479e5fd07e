"""The gateway's core, shared by the HTTP and NATS APIs: token ids in, text deltas out."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from lamina.libs import grammar
from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus
from lamina.schemas.v1.generate import (
    Finished,
    FinishReason,
    GenerateRequest,
    PromptLogprobs,
    Sampling,
    Sla,
    StructuredOutput,
    TokenLogprob,
    Tokens,
    Usage,
)
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.gateway.detokenizer import IncrementalDetokenizer
from lamina.services.gateway.errors import GenerationError, invalid_request
from lamina.services.gateway.inbox import Inbox
from lamina.services.gateway.remote_request import RemoteRequest, RetryPolicy
from lamina.services.gateway.tokenize_pool import TokenizePool
from lamina.services.gateway.tokenizer import ModelTokenizer, TemplateError
from lamina.services.gateway.tool_calls import ToolCall, ToolParser

_CHECKED_CONSTRAINTS = 256
"""Structured output constraints a gateway remembers as checked (an agent sends the same
schema with every request)."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a chat's messages may have."""


def _text_tokens(event: Tokens | Finished, include_stop: bool) -> list[int]:
    """The tokens of ``event`` that become text: not the stop token (EOS or one of
    ``stop_token_ids``) a request finished on, unless asked to (vLLM's
    ``include_stop_str_in_output``)."""
    finished_on_stop = isinstance(event, Finished) and event.finish_reason == FinishReason.STOP
    if finished_on_stop and not include_stop:
        return event.token_ids[:-1]
    return event.token_ids


def check_roles(messages: list[dict[str, Any]]) -> None:
    """Every message's role is one of :data:`CHAT_ROLES` (a 400 naming the one that is not)."""
    for i, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise invalid_request(
                f"role {message['role']!r} is not supported; use one of " + ", ".join(CHAT_ROLES),
                f"messages[{i}].role",
            )


@dataclass(frozen=True, slots=True)
class PromptScores:
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
    prompt: PromptScores | None = None
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
    def prompt_tokens(self) -> int:
        return len(self.remote.request.prompt_token_ids)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        parser = self.tool_parser
        async for delta in self._deltas():
            yield delta if parser is None else parser.apply(delta)

    async def _deltas(self) -> AsyncIterator[TextDelta]:
        detok = self.detokenizer
        logprobs: list[TokenLogprob] = []
        ranks: list[int] = []
        prompt: PromptScores | None = None
        async for event in self.remote.stream():
            if isinstance(event, PromptLogprobs):
                if event.start == 1:  # from the start again (a move before any token)
                    logprobs, ranks = [], []
                logprobs += event.logprobs
                ranks += event.ranks
                prompt_ids = self.remote.request.prompt_token_ids
                prompt = PromptScores(prompt_ids, logprobs, ranks)
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
                    self._usage(),
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

    def _usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    async def close(self) -> None:
        on_close, self._on_close = self._on_close, lambda: None  # once, however often closed
        try:
            await self.remote.__aexit__(None, None, None)
        finally:
            on_close()

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass(frozen=True)
class AdmissionLimits:
    """What one gateway holds at once before it sheds new requests with a 429."""

    max_open_requests: int = 4096
    """Requests admitted and not yet finished."""
    max_open_prompt_tokens: int = 1 << 24
    """Their prompt tokens together."""


class Admission:
    """Builds wire requests and opens text streams for both client APIs."""

    def __init__(
        self,
        bus: Bus,
        inbox: Inbox,
        tokenizer: ModelTokenizer,
        model_name: str,
        settings: RetryPolicy,
        limits: AdmissionLimits | None = None,
        pool: TokenizePool | None = None,
    ) -> None:
        self.bus = bus
        self.inbox = inbox
        self.tokenizer = tokenizer
        self.pool = pool or TokenizePool(tokenizer)
        """Where prompts are tokenized: long ones off the event loop."""
        self.model_name = model_name
        self.settings = settings
        self.limits = limits or AdmissionLimits()
        self.open_requests = 0
        """Requests admitted and not yet closed (waiting, queued or streaming)."""
        self.open_prompt_tokens = 0
        """Their prompt tokens."""
        self.max_context = 0
        """The longest context any live worker of the model has (0: not known yet), from
        the cluster view: a prompt too long for it is refused before it is tokenized."""
        self.precisions: list[dict[str, Any]] = []
        """How the live workers of the model compute (:func:`precisions`), as
        ``/v1/models`` lists it."""
        self._cleanup: set[asyncio.Task] = set()
        self._checked: BoundedDict[bytes, None] = BoundedDict(_CHECKED_CONSTRAINTS)

    async def admit(
        self,
        model: str | None,
        prompt: str | list[int] | list[dict[str, Any]],
        sampling: Sampling,
        sla: Sla,
        stop: list[str],
        request_id: str | None = None,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        structured_param: str = "structured_outputs",
        tools: list[dict[str, Any]] | None = None,
        affinity: str | None = None,
        n: int = 1,
    ) -> TextStream:
        """Admit a request and wait until a worker accepts it: the one path both client
        APIs take, so they refuse the same request with the same error. ``prompt`` is text,
        token ids, or chat messages (``[{"role": ..., "content": ...}]``). Every refusal
        is a :class:`GenerationError`. ``include_stop`` and ``skip_special_tokens``: how the
        output becomes text (``IncrementalDetokenizer``). ``structured_param``: the field a
        refused constraint is named by. ``tools``: a chat's tool definitions, for its
        template. ``affinity``: requests with the same key are placed together (``n``);
        ``n``: the client's ``n``, for telemetry, on its first sequence only (0 on the
        others, so that a group's ``n`` is counted once)."""
        self.check_model(model)
        if sampling.structured is not None:
            await self._check_constraint(sampling.structured, structured_param)
        ids = await self._prompt_ids(prompt, tools)
        self._hold(len(ids))
        request = GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            model=self.model_name,
            prompt_token_ids=ids,
            sampling=sampling,
            sla=sla,
            affinity=affinity,
        )
        remote = RemoteRequest(self.bus, self.inbox, request, self.settings, n=n)
        stream = TextStream(
            remote,
            IncrementalDetokenizer(self.tokenizer, stop, include_stop, skip_special_tokens),
            lambda: self._release(len(ids)),
        )
        await remote.__aenter__()
        try:
            await remote.start()
        except BaseException:
            await stream.close()
            raise
        return stream

    def check_model(self, model: str | None) -> None:
        """A request naming a model this gateway does not serve is a 404 (none: ours)."""
        if model is not None and model != self.model_name:
            raise GenerationError(
                404,
                "not_found_error",
                f"model {model!r} does not exist; served: {self.model_name!r}",
                "model",
                "model_not_found",
            )

    async def _check_constraint(self, spec: StructuredOutput, param: str) -> None:
        """A constraint the grammar engine cannot enforce is a 400 naming what is wrong,
        before any worker is used (parsed off the event loop: a schema may be large)."""
        key = msgspec.json.encode(spec)
        if key in self._checked:
            self._checked.move_to_end(key)
            return
        try:
            await asyncio.to_thread(grammar.check, spec)
        except grammar.GrammarError as exc:
            raise invalid_request(f"invalid structured output: {exc}", param) from exc
        self._checked[key] = None

    def _hold(self, prompt_tokens: int) -> None:
        """Count a request in, or shed it (429) when this gateway already holds its most."""
        limits = self.limits
        if (
            self.open_requests >= limits.max_open_requests
            or self.open_prompt_tokens + prompt_tokens > limits.max_open_prompt_tokens
        ):
            raise GenerationError(
                429,
                "rate_limit_error",
                f"the gateway holds its most open requests ({self.open_requests}, "
                f"{self.open_prompt_tokens} prompt tokens); retry shortly",
                code="overloaded",
                retry_after_s=1.0,
            )
        self.open_requests += 1
        self.open_prompt_tokens += prompt_tokens

    def _release(self, prompt_tokens: int) -> None:
        self.open_requests -= 1
        self.open_prompt_tokens -= prompt_tokens

    def _refuse_hopeless_length(self, chars: int, param: str) -> None:
        """Text that cannot fit any worker's context, whatever it tokenizes to, is refused
        before it costs a tokenizer's time. The bound is generous (4x): a normalizer may
        drop characters."""
        limit = 4 * self.max_context * self.tokenizer.max_token_chars
        if self.max_context and chars > limit:
            raise invalid_request(
                f"the prompt ({chars} characters) cannot fit the longest context served "
                f"({self.max_context} tokens)",
                param,
            )

    async def _prompt_ids(
        self, prompt: str | list[int] | list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        try:
            if isinstance(prompt, str):
                self._refuse_hopeless_length(len(prompt), "prompt")
                ids = await self.pool.encode(prompt)
            elif prompt and isinstance(prompt[0], dict):
                check_roles(prompt)
                chars = sum(len(message.get("content") or "") for message in prompt)
                self._refuse_hopeless_length(chars, "messages")
                ids = await self.pool.encode(prompt, tools)
            else:
                ids = list(prompt)
        except TemplateError as exc:
            raise invalid_request(str(exc), "messages") from exc
        if not ids:
            raise invalid_request("the prompt is empty", "prompt")
        return ids

    def close_later(self, stream: TextStream) -> None:
        """Close ``stream`` from a fresh task: the caller may be inside a cancelled scope
        (a client disconnect), where awaiting the cancel publish would itself be cancelled."""
        task = asyncio.get_running_loop().create_task(stream.close())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)


def precisions(workers: list[WorkerStats]) -> list[dict[str, Any]]:
    """Each distinct way ``workers`` compute (weight, activation and KV cache dtypes, the
    cache's ``auto`` as the dtype it means) with how many workers do, most workers first:
    a quantized and an unquantized worker of one model show as two entries."""
    counts = Counter(
        (s.weight_dtype, s.dtype, s.dtype if s.kv_cache_dtype == "auto" else s.kv_cache_dtype)
        for s in workers
        if s.weight_dtype  # a worker still loading, or one that predates the fields
    )
    return [
        {"weight_dtype": w, "dtype": d, "kv_cache_dtype": kv, "workers": n}
        for (w, d, kv), n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ]
