"""A client request's way in, shared by the HTTP and NATS APIs: the model, roles,
constraint and size checked, prompts tokenized, load shed past the gateway's limits, the
caller's quota charged, and one :class:`TextStream` started per sequence."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec

from lamina.libs import grammar
from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus
from lamina.libs.rate_limit import Quota, RateLimited
from lamina.schemas.v1.generate import (
    GenerateRequest,
    Sampling,
    Sla,
    StructuredOutput,
)
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.gateway.detokenizer import IncrementalDetokenizer
from lamina.services.gateway.errors import GenerationError, InvalidRequest
from lamina.services.gateway.inbox import Inbox
from lamina.services.gateway.remote_request import RemoteRequest, RetryPolicy
from lamina.services.gateway.text_stream import TextStream
from lamina.services.gateway.tokenize_pool import TokenizePool
from lamina.services.gateway.tokenizer import ChatPrompt, ModelTokenizer, Prompt, TemplateError
from lamina.services.gateway.truncation import Truncation
from lamina.services.gateway.worker_watch import WorkerWatch

_CHECKED_CONSTRAINTS = 256
"""Structured output constraints a gateway remembers as checked (an agent sends the same
schema with every request)."""

SHOWN_MODELS = 8
"""Models (the served one, then adapters) a ``model_not_found`` message names."""


ROLE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
"""What a chat message's role may be: a name (vLLM passes any role to the template, which
decides; a name cannot smuggle a template's own markup into the prompt)."""


def check_roles(messages: list[dict[str, Any]]) -> None:
    """Every message's role is a name (:data:`ROLE`; a 400 naming the one that is not);
    whether the template takes it is the template's to say."""
    for i, message in enumerate(messages):
        if not ROLE.match(message["role"]):
            raise InvalidRequest(
                f"role {message['role'][:80]!r} is not a role name (letters, digits, _ and -, "
                "at most 64)",
                f"messages[{i}].role",
            )


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
class IntakeLimits:
    """What one gateway holds at once before it sheds new requests with a 429."""

    max_open_requests: int = 4096
    """Requests admitted and not yet finished."""
    max_open_prompt_tokens: int = 1 << 24
    """Their prompt tokens together."""
    max_sequences_per_request: int = 256
    """Sequences one request may ask for (its prompts times ``n``)."""


class Intake:
    """Starts the sequences of client requests for both client APIs (:meth:`start`)."""

    def __init__(
        self,
        bus: Bus,
        inbox: Inbox,
        workers: WorkerWatch,
        tokenizer: ModelTokenizer,
        model_name: str,
        retry: RetryPolicy,
        limits: IntakeLimits | None = None,
        pool: TokenizePool | None = None,
    ) -> None:
        self.bus = bus
        self.inbox = inbox
        self.workers = workers
        self.tokenizer = tokenizer
        self.pool = pool or TokenizePool(tokenizer)
        """Where prompts are tokenized: long ones off the event loop."""
        self.model_name = model_name
        self.retry = retry
        self.limits = limits or IntakeLimits()
        self.open_requests = 0
        """Requests started and not yet closed (waiting, queued or streaming)."""
        self.open_prompt_tokens = 0
        """Their prompt tokens."""
        self.max_context = 0
        """The longest context any live worker of the model has (0: not known yet), from
        the cluster view: a prompt too long for it is refused before it is tokenized."""
        self.adapters: list[str] = []
        """The LoRA adapters of the model live workers hold, from the cluster view: a
        request may name one as its ``model``."""
        self.lora_workers: list[str] = []
        """The live workers of the model that serve adapters (run-time loads go there)."""
        self.precisions: list[dict[str, Any]] = []
        """How the live workers of the model compute (:func:`precisions`), as
        ``/v1/models`` lists it."""
        self._cleanup: set[asyncio.Task] = set()
        self._checked: BoundedDict[bytes, None] = BoundedDict(_CHECKED_CONSTRAINTS)

    async def start(
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
        """Start a request's sequences together and wait until a worker accepts each: the
        one path both client APIs take, so they refuse the same request with the same
        error, and one refused sequence refuses them all. A sequence's prompt is text,
        token ids, or chat messages (``[{"role": ..., "content": ...}]``). Every refusal
        is a :class:`GenerationError`. ``caller``: whose request it is (its best
        priority and its rate limits, charged by sequences and tokens).
        ``include_stop`` and ``skip_special_tokens``: how the output becomes text
        (``IncrementalDetokenizer``). ``structured_param`` and ``priority_param``: the
        fields a refused constraint or priority is named by."""
        model = self.check_model(model)
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
            raise InvalidRequest("the prompt is empty", "truncate_prompt_tokens")
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
            self._stream(
                model, spec, ids, tokens, sla, stop, include_stop, skip_special_tokens, caller
            )
            for spec, ids, tokens in zip(sequences, prompts, reserved, strict=True)
        ]
        for stream in streams:
            await stream.remote.__aenter__()
        if len(streams) == 1:  # (most requests: no task to run one start)
            started: list[object] = [None]
            try:
                await streams[0].remote.start()
            except Exception as exc:
                started = [exc]
        else:
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
            quota.take(sequences, tokens)
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
        model: str,
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
            model=model,
            prompt_token_ids=ids,
            sampling=spec.sampling,
            sla=sla,
            affinity=spec.affinity,
        )
        remote = RemoteRequest(self.bus, self.inbox, self.workers, request, self.retry, n=spec.n)

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
        started as the sequences it is, and one refused sequence throws away the work of
        all the others."""
        most = self.limits.max_sequences_per_request
        if prompts * n > most:
            raise InvalidRequest(
                f"the request asks for {prompts} prompt(s) x n={n}, {prompts * n} sequences; "
                f"at most {most} are allowed per request",
                "n" if n > 1 and prompts <= most else "prompt",
            )

    def check_model(self, model: str | None) -> str:
        """The model a request runs on: the one it names (ours, or an adapter of ours a
        live worker holds), ours when it names none; a 404 for any other."""
        if model is None or model == self.model_name:
            return self.model_name
        if model in self.adapters:
            return model
        names = [self.model_name, *self.adapters]
        served = ", ".join(repr(m) for m in names[:SHOWN_MODELS])
        if len(names) > SHOWN_MODELS:  # adapters may be many: the message stays short
            served += f" and {len(names) - SHOWN_MODELS} more (GET /v1/models)"
        raise GenerationError(
            404,
            "not_found_error",
            f"model {model!r} does not exist; served: {served}",
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
            raise InvalidRequest(f"invalid structured output: {exc}", param) from exc
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
            raise InvalidRequest(
                f"the prompt ({chars} characters) cannot fit the longest context served "
                f"({self.max_context} tokens)",
                param,
            )

    async def prompts_ids(self, prompts: list[Prompt | list[int]]) -> list[list[int]]:
        """Each prompt's token ids; a prompt given several times (a prompt's ``n``
        sequences) is tokenized once."""
        once = {id(p): p for p in prompts}
        if len(once) == 1:  # (most requests: no task to tokenize one prompt)
            return [await self._prompt_ids(prompts[0])] * len(prompts)
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
            raise InvalidRequest(str(exc), "messages") from exc
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        return ids

    def close_later(self, stream: TextStream) -> None:
        """Close ``stream`` from a fresh task: the caller may be inside a cancelled scope
        (a client disconnect), where awaiting the cancel publish would itself be cancelled."""
        task = asyncio.get_running_loop().create_task(stream.close())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)


def precisions(workers: list[WorkerStats]) -> list[dict[str, Any]]:
    """Each distinct way ``workers`` compute (weight, activation and KV cache dtypes, the
    cache's ``auto`` as the dtype it means, and how the model is split across ranks) with
    how many workers do, most workers first: a quantized and an unquantized worker of one
    model show as two entries, and so do one process and a tensor-parallel group."""
    counts = Counter(
        (
            s.weight_dtype,
            s.dtype,
            s.dtype if s.kv_cache_dtype == "auto" else s.kv_cache_dtype,
            s.tensor_parallel_size,
            s.pipeline_parallel_size,
        )
        for s in workers
        if s.weight_dtype  # a worker still loading, or one that predates the fields
    )
    return [
        {"weight_dtype": w, "dtype": d, "kv_cache_dtype": kv}
        | {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "workers": n}
        for (w, d, kv, tp, pp), n in sorted(counts.items(), key=lambda i: (-i[1], i[0]))
    ]
