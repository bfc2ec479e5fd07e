"""The gateway's core, shared by the HTTP and NATS APIs: token ids in, text deltas out."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from lamina.libs import grammar
from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus
from lamina.libs.rate_limit import Quota, RateLimited
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
from lamina.services.gateway.tokenizer import ChatPrompt, ModelTokenizer, Prompt, TemplateError
from lamina.services.gateway.tool_calls import ToolCall, ToolParser
from lamina.services.gateway.truncation import Truncation

_CHECKED_CONSTRAINTS = 256
"""Structured output constraints a gateway remembers as checked (an agent sends the same
schema with every request)."""

ROLE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
"""What a chat message's role may be: a name (vLLM passes any role to the template, which
decides; a name cannot smuggle a template's own markup into the prompt)."""


def _text_tokens(event: Tokens | Finished, include_stop: bool) -> list[int]:
    """The tokens of ``event`` that become text: not the stop token (EOS or one of
    ``stop_token_ids``) a request finished on, unless asked to (vLLM's
    ``include_stop_str_in_output``)."""
    finished_on_stop = isinstance(event, Finished) and event.finish_reason == FinishReason.STOP
    if finished_on_stop and not include_stop:
        return event.token_ids[:-1]
    return event.token_ids


def check_roles(messages: list[dict[str, Any]]) -> None:
    """Every message's role is a name (:data:`ROLE`; a 400 naming the one that is not);
    whether the template takes it is the template's to say."""
    for i, message in enumerate(messages):
        if not ROLE.match(message["role"]):
            raise invalid_request(
                f"role {message['role'][:80]!r} is not a role name (letters, digits, _ and -, "
                "at most 64)",
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
    def prompt_token_ids(self) -> list[int]:
        return self.remote.request.prompt_token_ids

    @property
    def prompt_tokens(self) -> int:
        return len(self.remote.request.prompt_token_ids)

    def usage_so_far(self) -> Usage:
        """The prompt's tokens and those generated up to the last delta."""
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

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


@dataclass(frozen=True, slots=True)
class Sequence:
    """One sequence a request asks for: a prompt, sampled one way."""

    prompt: Prompt | list[int]
    """Text, a chat, or token ids."""
    sampling: Sampling
    request_id: str | None = None
    """The id it runs under on the bus (default: a fresh one); always the gateway's."""
    affinity: str | None = None
    """Sequences with the same key are placed together (a prompt's ``n``)."""
    n: int = 1
    """The client's ``n``, for telemetry, on a group's first sequence (0 on the others,
    so that a group's ``n`` is counted once)."""
    truncation: Truncation | None = None
    """Keep only this many of the prompt's tokens (vLLM's ``truncate_prompt_tokens``)."""


@dataclass(frozen=True)
class Caller:
    """Who asks: an HTTP API key or a NATS API identity, with what it may do."""

    best_priority: int | None = None
    """The lowest (best) ``priority`` it may ask for (None: any)."""
    quota: Quota | None = None
    """Its rate limits (None: unlimited)."""

    def check_priority(self, priority: int, param: str) -> None:
        """A priority better than the caller may ask for is a 403 naming ``param``."""
        if self.best_priority is not None and priority < self.best_priority:
            raise GenerationError(
                403,
                "permission_error",
                f"priority {priority} is better than this caller may ask for "
                f"({self.best_priority})",
                param,
                "priority_not_allowed",
            )


@dataclass(frozen=True)
class AdmissionLimits:
    """What one gateway holds at once before it sheds new requests with a 429."""

    max_open_requests: int = 4096
    """Requests admitted and not yet finished."""
    max_open_prompt_tokens: int = 1 << 24
    """Their prompt tokens together."""
    max_sequences_per_request: int = 256
    """Sequences one request may ask for (its prompts times ``n``)."""


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
        sequences: list[Sequence],
        sla: Sla,
        stop: list[str],
        *,
        caller: Caller = Caller(),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        structured_param: str = "structured_outputs",
        priority_param: str = "priority",
    ) -> list[TextStream]:
        """Admit a request's sequences together and wait until a worker accepts each: the
        one path both client APIs take, so they refuse the same request with the same
        error, and one refused sequence refuses them all. A sequence's prompt is text,
        token ids, or chat messages (``[{"role": ..., "content": ...}]``). Every refusal
        is a :class:`GenerationError`. ``caller``: whose request it is (its best
        priority and its rate limits, charged by sequences and tokens).
        ``include_stop`` and ``skip_special_tokens``: how the output becomes text
        (``IncrementalDetokenizer``). ``structured_param`` and ``priority_param``: the
        fields a refused constraint or priority is named by."""
        self.check_model(model)
        caller.check_priority(sla.priority, priority_param)
        for structured in {
            msgspec.json.encode(s.sampling.structured): s.sampling.structured
            for s in sequences
            if s.sampling.structured is not None
        }.values():
            await self._check_constraint(structured, structured_param)
        prompts = await self.prompts_ids([s.prompt for s in sequences])
        prompts = [
            ids if s.truncation is None else s.truncation.apply(ids, self.max_context)
            for s, ids in zip(sequences, prompts, strict=True)
        ]
        if not all(prompts):  # truncated to nothing
            raise invalid_request("the prompt is empty", "truncate_prompt_tokens")
        reserved = [
            len(ids) + self._most_generated(s.sampling, len(ids))
            for s, ids in zip(sequences, prompts, strict=True)
        ]
        self._hold(len(sequences), sum(map(len, prompts)))
        try:
            if caller.quota is not None:
                self.charge(caller.quota, len(sequences), sum(reserved))
        except GenerationError:
            self._release(len(sequences), sum(map(len, prompts)))
            raise
        streams = [
            self._stream(spec, ids, tokens, sla, stop, include_stop, skip_special_tokens, caller)
            for spec, ids, tokens in zip(sequences, prompts, reserved, strict=True)
        ]
        for stream in streams:
            await stream.remote.__aenter__()
        started = await asyncio.gather(
            *(stream.remote.start() for stream in streams), return_exceptions=True
        )
        failure = next((e for e in started if isinstance(e, BaseException)), None)
        if failure is not None:
            for stream in streams:
                self.close_later(stream)
            raise failure
        return streams

    @staticmethod
    def charge(quota: Quota, sequences: int, tokens: int) -> None:
        """Take ``sequences`` reserving ``tokens`` from a caller's ``quota``, or refuse
        them with a 429 that says when to retry."""
        try:
            quota.admit(sequences, tokens)
        except RateLimited as exc:
            raise GenerationError(
                429,
                exc.kind,
                f"rate limit reached: {exc.message}",
                code="rate_limit_exceeded",
                retry_after_s=exc.wait_s,
            ) from exc

    def _stream(
        self,
        spec: Sequence,
        ids: list[int],
        reserved: int,
        sla: Sla,
        stop: list[str],
        include_stop: bool,
        skip_special_tokens: bool,
        caller: Caller,
    ) -> TextStream:
        """One sequence's stream, not yet submitted; closing it gives back what it holds of
        the gateway's capacity and of its caller's quota (the tokens it did not use)."""
        request = GenerateRequest(
            request_id=spec.request_id or uuid.uuid4().hex,
            model=self.model_name,
            prompt_token_ids=ids,
            sampling=spec.sampling,
            sla=sla,
            affinity=spec.affinity,
        )
        remote = RemoteRequest(self.bus, self.inbox, request, self.settings, n=spec.n)

        def release() -> None:
            self._release(1, len(ids))
            if caller.quota is not None:
                used = len(ids) + stream.completion_tokens if remote.worker_id else 0
                caller.quota.release(reserved, used)

        detokenizer = IncrementalDetokenizer(
            self.tokenizer, stop, include_stop, skip_special_tokens
        )
        stream = TextStream(remote, detokenizer, release)
        return stream

    def _most_generated(self, sampling: Sampling, prompt_tokens: int) -> int:
        """The most tokens a sequence may generate: ``max_tokens``, bounded by the longest
        context served (what a rate limit reserves for it)."""
        room = max(self.max_context - prompt_tokens, 0) if self.max_context else None
        if sampling.max_tokens is None:
            return room or 0
        return sampling.max_tokens if room is None else min(sampling.max_tokens, room)

    def check_sequences(self, prompts: int, n: int) -> None:
        """A request of ``prompts`` prompts with ``n`` sequences each asks for at most
        ``max_sequences_per_request`` (a 400 naming ``prompt`` or ``n``): a batch is
        admitted as the sequences it is, and one refused sequence throws away the work of
        all the others."""
        most = self.limits.max_sequences_per_request
        if prompts * n > most:
            raise invalid_request(
                f"the request asks for {prompts} prompt(s) x n={n}, {prompts * n} sequences; "
                f"at most {most} are allowed per request",
                "n" if n > 1 and prompts <= most else "prompt",
            )

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

    def _hold(self, sequences: int, prompt_tokens: int) -> None:
        """Count a request's sequences in, or shed it (429) when this gateway already
        holds its most."""
        limits = self.limits
        if (
            self.open_requests + sequences > limits.max_open_requests
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
        self.open_requests += sequences
        self.open_prompt_tokens += prompt_tokens

    def _release(self, sequences: int, prompt_tokens: int) -> None:
        self.open_requests -= sequences
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

    async def prompts_ids(self, prompts: list[Prompt | list[int]]) -> list[list[int]]:
        """Each prompt's token ids; a prompt given several times (a prompt's ``n``
        sequences) is tokenized once."""
        once = {id(p): p for p in prompts}
        ids = await asyncio.gather(*(self._prompt_ids(p) for p in once.values()))
        by_prompt = dict(zip(once, ids, strict=True))
        return [by_prompt[id(p)] for p in prompts]

    async def _prompt_ids(self, prompt: Prompt | list[int]) -> list[int]:
        try:
            if isinstance(prompt, list):
                ids = list(prompt)
            else:
                if isinstance(prompt, ChatPrompt):
                    check_roles(prompt.messages)
                self._refuse_hopeless_length(
                    prompt.chars, "messages" if isinstance(prompt, ChatPrompt) else "prompt"
                )
                ids = await self.pool.encode(prompt)
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
