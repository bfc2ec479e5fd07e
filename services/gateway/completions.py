"""Serving OpenAI's completion routes (``/v1/completions``, ``/v1/chat/completions``,
its batch, SageMaker's ``/invocations``): a body decoded and checked, its sequences started
through the :class:`Intake`, and the answer streamed (SSE) or collected whole, in OpenAI's
shape (``completion_bodies``); a beam search (``use_beam_search``) is served whole.
Bodies are decoded with msgspec by hand so that every error, from malformed JSON to an
overlong prompt, comes back in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar.types import Receive, Scope, Send
from opentelemetry import context as otel_context
from opentelemetry import propagate

from lamina.libs.bounded import BoundedDict
from lamina.libs.errors import error_body
from lamina.schemas.v1.generate import FinishReason, Sampling, Usage
from lamina.services.gateway.asgi import (
    REQUEST_ID,
    BodyTooLarge,
    ClientDisconnected,
    ClientWatch,
    end_events,
    read_body,
    send_event,
    send_json,
    start_events,
)
from lamina.services.gateway.beam_search import Found, search
from lamina.services.gateway.completion_bodies import (
    Bodies,
    Reply,
    TextChunks,
    add_token_ids,
    indexed,
    sum_usage,
    usage_body,
)
from lamina.services.gateway.errors import GenerationError, InvalidRequest
from lamina.services.gateway.intake import Caller, Intake, Sequence
from lamina.services.gateway.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from lamina.services.gateway.replies import error_of, retry_headers, whole
from lamina.services.gateway.text_stream import TextDelta, TextStream
from lamina.services.gateway.tokenizer import Prompt, TextPrompt
from lamina.services.gateway.tool_calls import PARSERS, ConstrainedParser, ToolParser

log = logging.getLogger("lamina.gateway.http")

IGNORED_HEADER = b"x-lamina-ignored-fields"
"""The response header that lists a body's fields that neither Lamina nor vLLM knows."""
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MAX_NAMED = 32


def ignored_header(names: list[str]) -> tuple[bytes, bytes]:
    """``names`` as a header value: those safe in a header (at most 32), then how many
    others there were."""
    safe = [n for n in names if _SAFE_NAME.match(n)][:_MAX_NAMED]
    value = ", ".join(safe)
    if len(safe) < len(names):
        value += f"{', ' if safe else ''}({len(names) - len(safe)} more)"
    return IGNORED_HEADER, value.encode()


async def _merged(streams: list[TextStream]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Each stream's deltas with its index, as they come; the first error ends it. One
    stream is read directly (no task, no queue between its tokens and the client)."""
    if len(streams) == 1:
        async for delta in streams[0].deltas():
            yield 0, delta
        return
    events: asyncio.Queue[tuple[int, TextDelta | Exception | None]] = asyncio.Queue()

    async def read(index: int, stream: TextStream) -> None:
        try:
            async for delta in stream.deltas():
                await events.put((index, delta))
        except Exception as exc:  # raised to the reader of the merge
            await events.put((index, exc))
        await events.put((index, None))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event = await events.get()
            if event is None:
                open_streams -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield index, event
    finally:
        for reader in readers:
            reader.cancel()


def _sequence(sampling: Sampling, index: int) -> Sampling:
    """Sequence ``index``'s sampling among a prompt's ``n``: its own seed (``seed +
    index``, wrapped into 64 bits), so that each is reproducible and none repeats another.
    Only the first scores the prompt (``prompt_logprobs``): the others share its scores,
    and their prompt, read from the prefix cache, is not computed again."""
    if index == 0:
        return sampling
    seed = None if sampling.seed is None else (sampling.seed + index + 2**63) % 2**64 - 2**63
    return msgspec.structs.replace(sampling, seed=seed, prompt_logprobs=None)


def _session_affinity(session_id: str | None) -> str | None:
    """The placement key of a vLLM ``session_id``: its requests go to one worker while it
    can take them (a digest: any string a client sends becomes a bounded wire id)."""
    if session_id is None:
        return None
    return "session-" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


def _headers(scope: Scope) -> dict[str, str]:
    """An ASGI request's headers as a carrier for trace propagation (names lowercase)."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


class CompletionsApi:
    """The completion routes' handler, bound to one :class:`Intake`."""

    def __init__(
        self,
        intake: Intake,
        tool_call_parser: str = "hermes",
        trust_request_chat_template: bool = False,
    ) -> None:
        self.intake = intake
        self.bodies = Bodies(intake.tokenizer, intake.model_name)
        self.trust_request_chat_template = trust_request_chat_template
        """Whether a request may bring its own chat template (vLLM's flag)."""
        self.tool_call_parser = tool_call_parser
        """vLLM's name of the parser that finds tool calls (``tool_choice: auto``); ""
        for none, which refuses ``auto``."""
        self._logged_ignored: BoundedDict[bytes, None] = BoundedDict(256)
        """The sets of ignored fields already logged (each is logged once)."""

    async def _open(
        self, body: CompletionRequest | ChatCompletionRequest, response_key: str, caller: Caller
    ) -> list[TextStream]:
        """Submit ``body``: a request per sequence (``n`` per prompt, for each prompt of a
        batch: each a choice of its own, prompt-major), started together; every way it
        can be refused is a :class:`GenerationError`, and one refused sequence refuses the
        whole body. A prompt's ``n`` sequences share an affinity (one worker, one
        prefill) and, with a seed, draw from ``seed + i`` (vLLM's rule). Each request's
        id is ``response_key`` (the response's id after its ``cmpl-``), with ``-<k>`` for
        the k-th sequence when there are several, so the bus's records and traces name
        the response a client saw."""
        parser = None
        vocab = self.intake.tokenizer.vocab_size
        body.refuse_unsupported()
        prompts = self._prompts(body)
        if isinstance(body, ChatCompletionRequest):
            sampling = body.sampling(None, body.logprobs_count(vocab), vocab)
            parser = self._tool_parser(body)
        else:
            sampling = body.sampling(16, body.logprobs_count(vocab), vocab)
        n = body.n
        self.intake.check_sequences(len(prompts), n)
        if body.bad_words:
            words = self.intake.tokenizer.bad_words_token_ids(body.bad_words)
            sampling = msgspec.structs.replace(sampling, bad_words_token_ids=words)
        several = len(prompts) * n > 1
        session = _session_affinity(body.session_id)
        truncation = body.truncation()
        sequences = []
        for j, prompt in enumerate(prompts):
            affinity = session or (uuid.uuid4().hex if n > 1 else None)
            sequences += [
                Sequence(
                    prompt,
                    _sequence(sampling, i),
                    request_id=f"{response_key}-{j * n + i}" if several else response_key,
                    affinity=affinity,
                    n=n if i == 0 else 0,
                    truncation=truncation,
                )
                for i in range(n)
            ]
        streams = await self.intake.start(
            body.model,
            sequences,
            body.sla(),
            body.stop_strings(),
            caller=caller,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            structured_param=body.structured_param,
        )
        if parser is not None:  # one parser per stream: each holds back its own text
            for stream in streams:
                stream.tool_parser = parser()
        return streams

    def _prompts(self, body: CompletionRequest | ChatCompletionRequest) -> list[Prompt | list[int]]:
        """The body's prompts: its chats (a request's own template only where the gateway
        trusts them), or its texts and token-id lists; raises :class:`InvalidRequest`."""
        if not isinstance(body, ChatCompletionRequest):
            special = body.add_special_tokens is not False
            return [
                TextPrompt(p, special) if isinstance(p, str) else p for p in body.prompt_inputs()
            ]
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise InvalidRequest(
                "a chat_template was passed with the request, but the gateway does not run "
                "with --trust-request-chat-template",
                "chat_template",
            )
        return list(body.chat_prompts())

    def _tool_parser(self, body: ChatCompletionRequest) -> Callable[[], ToolParser] | None:
        """What makes the parser that reads tool calls out of this chat's output (None:
        it is all content)."""
        mode = body.tool_mode
        if mode in ("required", "named"):
            return functools.partial(ConstrainedParser, body.named_function)
        if mode == "auto":
            if not self.tool_call_parser:
                raise InvalidRequest(
                    'tool_choice "auto" needs a tool call parser: start the gateway with '
                    "--tool-call-parser (hermes, llama3_json)",
                    "tool_choice",
                )
            return PARSERS[self.tool_call_parser]
        return None

    async def open_in_callers_trace(
        self, body: Any, scope: Scope, response_key: str
    ) -> list[TextStream]:
        """``_open``, continuing the caller's trace (W3C ``traceparent``, ``tracestate``,
        ``baggage``): the request's span, made as it is started, is a child of the
        caller's span; without one it starts a trace."""
        token = otel_context.attach(propagate.extract(_headers(scope)))
        try:
            caller = Caller(scope.get("lamina.best_priority"), scope.get("lamina.quota"))
            return await self._open(body, response_key, caller)
        finally:
            otel_context.detach(token)

    async def serve(
        self, scope: Scope, receive: Receive, send: Send, kind: Callable[[bytes], type]
    ) -> None:
        """One completion request, body to last byte (see ``asgi.py``), its body decoded
        as ``kind(body)`` says (a chat, a completion, a batch of chats). A client that
        disconnects cancels it, wherever it is: queued, generating or streaming."""
        read = await self.read_request(scope, receive, send, kind)
        if read is None:
            return
        body, headers = read
        response_key = uuid.uuid4().hex
        if scope.get(REQUEST_ID) is None:  # no x-request-id of the client's: its body's, or ours
            scope[REQUEST_ID] = body.request_id or response_key
        status, payload = 200, None
        ending: list[Any] | None = None  # a stream's last events
        chat = isinstance(body, ChatCompletionRequest)
        build = self.bodies.chat if chat else self.bodies.completion
        if body.return_tokens_as_token_ids:
            build = functools.partial(build, as_ids=True)
        streaming = False
        with ClientWatch(receive) as client:
            try:
                if body.use_beam_search:
                    beams = await self._beams(body, scope)
                else:
                    streams = await self.open_in_callers_trace(body, scope, response_key)
                response = self._reply(body, response_key, chat, build)
                if body.use_beam_search:
                    payload = self._beam_payload(*beams, body, response)
                elif body.stream:
                    streaming = True
                    ending = await self._stream(streams, body, response, send, headers)
                else:
                    status, payload = await self._collect(streams, body, response)
            except Exception as exc:
                if streaming:  # the response has started: an error can only end it
                    raise
                if isinstance(exc, GenerationError):
                    status, payload = exc.status, error_of(exc)
                    headers += retry_headers(exc)
                else:  # a bug: a 500 in OpenAI's shape (this route is not Litestar's)
                    log.exception("%s failed", scope["path"])
                    status, payload = 500, error_body("api_error", "the gateway failed (logged)")
        if client.disconnected:
            return
        if ending is not None:  # one write: each to a client's socket is a system call
            await end_events(send, *ending)
        else:
            await send_json(send, status, payload, headers)

    async def read_request(
        self, scope: Scope, receive: Receive, send: Send, kind: Callable[[bytes], type]
    ) -> tuple[Any, list[tuple[bytes, bytes]]] | None:
        """A POST's body decoded as ``kind(body)`` says, and the response headers that name
        the fields it ignored; None when it was answered here instead (a 405, 413 or 400)
        or its client went away."""
        if scope["method"] != "POST":  # Litestar does not check an ASGI route's method
            error = error_body("invalid_request_error", "only POST is allowed here")
            await send_json(send, 405, error, [(b"allow", b"POST")])
            return None
        try:
            raw = await read_body(receive)
            body, ignored = decode_request(raw, kind(raw))
        except ClientDisconnected:
            return None
        except BodyTooLarge as exc:
            await send_json(send, 413, error_body("invalid_request_error", str(exc)))
            return None
        except InvalidRequest as exc:
            error = error_body("invalid_request_error", exc.message, exc.param)
            await send_json(send, 400, error)
            return None
        return body, self._note_ignored(ignored)

    def _reply(self, body: Any, response_key: str, chat: bool, build: Callable) -> Reply:
        model = body.model or self.intake.model_name  # (started: ours, or an adapter of it)
        return Reply(
            ("chatcmpl-" if chat else "cmpl-") + response_key,
            int(time.time()),
            chat,
            functools.partial(build, model=model),
            bool(body.return_token_ids),
            self._echoes(body),
            isinstance(body, BatchChatCompletionRequest),
            model,
        )

    async def _beams(self, body: Any, scope: Scope) -> tuple[list[list[int]], list[TextDelta]]:
        """A beam search: each prompt's ids, and its ``n`` best beams as choices, prompt
        by prompt (``beam_search.py``). The caller's rate limits are charged once, for
        ``n`` sequences a prompt, as for any request; its steps are not charged again."""
        body.refuse_unsupported()
        prompts = self._prompts(body)
        intake, n = self.intake, body.n
        intake.check_model(body.model)
        intake.check_sequences(len(prompts), n)
        caller = Caller(scope.get("lamina.best_priority"), scope.get("lamina.quota"))
        caller.check_priority(body.priority, "priority")
        chat = isinstance(body, ChatCompletionRequest)
        truncation = body.truncation()
        prompt_ids = [
            ids if truncation is None else truncation.apply(ids, intake.max_context)
            for ids in await intake.prompts_ids(prompts)
        ]
        asked = body.max_completion_tokens or body.max_tokens
        most = [
            asked or (16 if not chat else max(intake.max_context - len(ids), 1))
            for ids in prompt_ids
        ]
        for ids, m in zip(prompt_ids, most, strict=True):
            if intake.max_context and len(ids) + m > intake.max_context:
                raise InvalidRequest(
                    f"this model's maximum context length is {intake.max_context} tokens, "
                    f"but the request has {len(ids)} prompt tokens and asks for {m} more",
                    "max_tokens",
                )
        sequences = len(prompts) * n
        reserved = sum(n * (len(ids) + m) for ids, m in zip(prompt_ids, most, strict=True))
        if caller.quota is not None:
            intake.charge(caller.quota, sequences, reserved)
        deltas: list[TextDelta] = []
        token = otel_context.attach(propagate.extract(_headers(scope)))
        try:
            found = await asyncio.gather(
                *(
                    search(
                        intake,
                        body.model,
                        ids,
                        width=n,
                        max_tokens=m,
                        length_penalty=body.length_penalty,
                        ignore_eos=body.ignore_eos,
                        sla=body.sla(),
                        caller=Caller(caller.best_priority),  # charged above, once
                    )
                    for ids, m in zip(prompt_ids, most, strict=True)
                )
            )
            for ids, beams in zip(prompt_ids, found, strict=True):
                deltas += [self._beam_delta(beam, len(ids), body) for beam in beams]
        finally:
            otel_context.detach(token)
            if caller.quota is not None:
                used = sum(d.usage.prompt_tokens + d.usage.completion_tokens for d in deltas)  # type: ignore[union-attr]
                for _ in range(sequences):
                    caller.quota.release(reserved // sequences, used // sequences)
        return prompt_ids, deltas

    def _beam_payload(
        self, prompt_ids: list[list[int]], deltas: list[TextDelta], body: Any, response: Reply
    ) -> dict[str, Any]:
        """The whole response of a beam search (:meth:`_beams`)."""
        n = body.n
        for delta, echo in zip(deltas, response.echoes or (), strict=False):
            delta.text = echo + delta.text
        built = [response.build(d, response.id, response.created, streaming=False) for d in deltas]
        payload = built[0]
        payload["choices"] = [indexed(b["choices"][0], i) for i, b in enumerate(built)]
        payload["usage"] = usage_body(sum_usage([d.usage for d in deltas], n))
        prompts_of = [ids for ids in prompt_ids for _ in range(n)]
        add_token_ids(payload, response, prompts_of, [d.token_ids for d in deltas])
        return payload

    def _beam_delta(self, beam: Found, prompt_tokens: int, body: Any) -> TextDelta:
        """A found beam as a choice's text (its EOS left out unless asked for)."""
        shown = beam.token_ids
        if beam.finish_reason == FinishReason.STOP and not body.include_stop_str_in_output:
            shown = shown[:-1]
        text = self.intake.tokenizer.decode(shown, skip_special_tokens=body.skip_special_tokens)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(beam.token_ids))
        return TextDelta(text, beam.token_ids, None, beam.finish_reason, usage)

    def _note_ignored(self, ignored: list[str]) -> list[tuple[bytes, bytes]]:
        """The response headers that say which fields were ignored; logged once per set."""
        if not ignored:
            return []
        header = ignored_header(ignored)
        if header[1] not in self._logged_ignored:  # as the header names them: bounded
            self._logged_ignored[header[1]] = None
            log.warning("fields present in a request but ignored: %s", header[1].decode())
        return [header]

    def _echoes(self, body: Any) -> list[str] | None:
        """With ``echo``: each choice's prompt text, which its text starts with (a text
        prompt as it was sent, token ids decoded; ``n`` choices per prompt; a chat's last
        message where it is the assistant's)."""
        if isinstance(body, ChatCompletionRequest):
            texts = body.echo_texts()
            return None if texts is None else [t for t in texts for _ in range(body.n)]
        if not body.echo:
            return None
        tokenizer, skip = self.intake.tokenizer, body.skip_special_tokens
        return [
            p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=skip)
            for p in body.prompt_inputs()
            for _ in range(body.n)
        ]

    async def _collect(
        self, streams: list[TextStream], body: Any, response: Reply
    ) -> tuple[int, dict[str, Any]]:
        """A whole non-streaming response, a choice per stream: ``(status, body)`` (the
        first error, if any stream failed); echoes start the choices' texts; each
        prompt's ``n`` streams count its tokens once."""
        tasks = [asyncio.create_task(whole(stream)) for stream in streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one failed (the others are cancelled), or all finished
            for task in tasks:
                task.cancel()
            for stream in streams:
                self.intake.close_later(stream)
        for task in tasks:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                if isinstance(exc, GenerationError):
                    return exc.status, error_of(exc)
                raise exc
        n = body.n
        deltas = [task.result() for task in tasks]
        outputs = [d.token_ids for d in deltas]
        for i, delta in enumerate(deltas):
            delta.prompt = deltas[i - i % n].prompt  # a prompt's first sequence scored it
        for delta, echo in zip(deltas, response.echoes or (), strict=False):
            delta.text = echo + delta.text
            if delta.prompt is not None and delta.logprobs is not None:
                # echo with logprobs: the prompt's tokens lead the logprobs (the first
                # without one, as OpenAI's legacy API and vLLM give it).
                delta.token_ids = delta.prompt.token_ids + delta.token_ids
                delta.logprobs = [None, *delta.prompt.logprobs, *delta.logprobs]
        usage = sum_usage([d.usage for d in deltas], n)
        built = [response.build(d, response.id, response.created, streaming=False) for d in deltas]
        payload = built[0]  # the envelope; every choice, each built once
        payload["choices"] = [indexed(b["choices"][0], i) for i, b in enumerate(built)]
        payload["usage"] = usage_body(usage)
        add_token_ids(payload, response, [s.prompt_token_ids for s in streams], outputs)
        return 200, payload

    async def _stream(
        self,
        streams: list[TextStream],
        body: Any,
        response: Reply,
        send: Send,
        headers: list[tuple[bytes, bytes]],
    ) -> list[Any]:
        """Send the events of a streaming response: each stream's chunks as they come,
        under its choice's ``index`` (after its echo, if any). With ``return_token_ids``,
        each chunk's tokens, and a completion choice's first chunk its prompt's; with
        ``continuous_usage_stats``, each chunk its choice's usage. Return its last events
        (one stream's finish, the usage, an error, ``[DONE]``): the caller sends them with
        the response's end (:func:`end_events`, one write), once it stopped watching for a
        disconnect, which the server reports for a completed response too."""
        await start_events(send, headers)
        options = body.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        opened = [False] * len(streams)
        written = [0] * len(streams)  # each choice's text so far, in characters

        def chunk_of(delta: TextDelta, index: int) -> dict[str, Any]:
            chunk = response.build(delta, response.id, response.created, streaming=True)
            choice = indexed(chunk["choices"][0], index)
            chunk["choices"] = [choice]
            if response.token_ids:
                if not response.chat and not opened[index]:
                    choice["prompt_token_ids"] = streams[index].prompt_token_ids
                choice["token_ids"] = delta.token_ids
            if continuous:
                chunk["usage"] = usage_body(streams[index].usage_so_far())
            scored = choice.get("logprobs")
            if scored and "text_offset" in scored:  # a completion's: on from the last chunk
                scored["text_offset"] = [at + written[index] for at in scored["text_offset"]]
            written[index] += len(choice.get("text", ""))
            opened[index] = True
            return chunk

        # Without token ids or running usage, most chunks carry text alone: pre-encoded.
        plain = not response.token_ids and not continuous
        texts = [TextChunks(response, i) for i in range(len(streams))] if plain else None
        usages: list[Usage | None] = [None] * len(streams)
        last: list[Any] = []  # (the caller sends them with the response's end)
        try:
            if response.chat:  # OpenAI opens a chat stream with the role
                role = {"role": "assistant", "content": ""}
                chunk = self.bodies.chat_chunk(
                    response.id, response.created, role, None, model=response.model
                )
                if response.token_ids:
                    chunk["prompt_token_ids"] = streams[0].prompt_token_ids
                if continuous:
                    chunk["usage"] = usage_body(streams[0].usage_so_far())
                await send_event(send, chunk)
            for index, echo in enumerate(response.echoes or ()):
                await send_event(send, chunk_of(TextDelta(echo, [], None), index))
            async with contextlib.aclosing(_merged(streams)) as deltas:
                async for index, delta in deltas:
                    usages[index] = delta.usage or usages[index]
                    if (
                        texts
                        and delta.text
                        and delta.logprobs is None
                        and not (delta.finish_reason or delta.tool_calls)
                    ):
                        written[index] += len(delta.text)
                        opened[index] = True
                        await send_event(send, texts[index].encode(delta.text))
                    elif delta.finish_reason and len(streams) == 1:
                        last.append(chunk_of(delta, index))  # written with the end
                    elif (
                        delta.text
                        or delta.finish_reason
                        or delta.logprobs
                        or delta.tool_calls
                        or (response.token_ids and delta.token_ids)
                    ):
                        await send_event(send, chunk_of(delta, index))
            if body.include_usage:
                last.append(
                    {
                        "id": response.id,
                        "object": self.bodies.chunk_object(response.chat),
                        "created": response.created,
                        "model": response.model,
                        "choices": [],
                        "usage": usage_body(sum_usage(usages, body.n)),
                    }
                )
        except GenerationError as exc:
            last.append(error_of(exc))
        finally:
            for stream in streams:
                self.intake.close_later(stream)
        return [*last, b"[DONE]"]
