"""The OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) on Litestar. Bodies are decoded with msgspec by hand so that every error,
from malformed JSON to an overlong prompt, comes back in OpenAI's error shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from lamina.schemas.v1.generate import TokenLogprob, Usage
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.frontend import Frontend, TextDelta, TextStream
from lamina.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    decode_body,
)
from lamina.services.gateway.tokenizer import TemplateError

_json = msgspec.json.Encoder()


def error_body(
    status: int,
    error_type: str,
    message: str,
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type,
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(
    status: int, error_type: str, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(error_body(status, error_type, message, param, code), status_code=status)


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def _sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


class OpenAIApi:
    """Route handlers bound to one :class:`Frontend`."""

    def __init__(self, frontend: Frontend, ready: Callable[[], bool]) -> None:
        self.frontend = frontend
        self.ready = ready

    # ----------------------------------------------------------------------------- helpers
    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, ids: list[int], lps: list[TokenLogprob] | None
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        return {
            "tokens": [self._token_text(t) for t in ids],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in lps],
        }

    def _chat_logprobs(
        self, ids: list[int], lps: list[TokenLogprob] | None
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        content = []
        for token, lp in zip(ids, lps, strict=True):
            text = self._token_text(token)
            content.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (s := self._token_text(t)),
                            "logprob": v,
                            "bytes": list(s.encode()),
                        }
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}

    async def _open(self, body: CompletionRequest | ChatCompletionRequest) -> TextStream:
        f = self.frontend
        if body.model is not None and body.model != f.model_name:
            raise GenerationError(
                404,
                "not_found_error",
                f"model {body.model!r} does not exist; served: {f.model_name!r}",
                "model",
                "model_not_found",
            )
        if isinstance(body, ChatCompletionRequest):
            prompt_ids = f.tokenizer.encode_chat(body.chat())
            sampling = body.sampling(None, body.logprobs_count())
        else:
            body.validate()
            prompt = body.prompt_input()
            prompt_ids = f.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            sampling = body.sampling(16, body.logprobs)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        return await f.open(prompt_ids, sampling, body.sla(), body.stop_strings())

    async def _handle(self, request: Request, kind: type, build: Callable) -> Response | Stream:
        try:
            body = decode_body(await request.body(), kind)
            stream = await self._open(body)
        except InvalidRequest as exc:
            return error_response(400, "invalid_request_error", exc.message, exc.param)
        except TemplateError as exc:
            return error_response(400, "invalid_request_error", str(exc), "messages")
        except GenerationError as exc:
            return error_response(exc.status, exc.error_type, exc.message, exc.param, exc.code)
        created = int(time.time())
        chat = kind is ChatCompletionRequest
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            return Stream(
                self._sse(stream, body, build, response_id, created, chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text, ids, lps, last = [], [], [], None
            async for delta in stream.deltas():
                text.append(delta.text)
                ids += delta.token_ids
                if delta.logprobs is not None:
                    lps += delta.logprobs
                last = delta
        except GenerationError as exc:
            return error_response(exc.status, exc.error_type, exc.message, exc.param, exc.code)
        finally:
            await stream.close()
        delta = TextDelta("".join(text), ids, lps or None, last.finish_reason, last.usage)
        return Response(build(delta, response_id, created, streaming=False))

    async def _sse(
        self,
        stream: TextStream,
        body: Any,
        build: Callable,
        response_id: str,
        created: int,
        chat: bool,
    ) -> AsyncIterator[bytes]:
        try:
            if chat:  # OpenAI opens a chat stream with the role
                yield _sse(
                    self._chat_chunk(
                        response_id, created, {"role": "assistant", "content": ""}, None
                    )
                )
            usage = None
            async for delta in stream.deltas():
                usage = delta.usage or usage
                if delta.text or delta.finish_reason or delta.logprobs:
                    yield _sse(build(delta, response_id, created, streaming=True))
            if body.include_usage:
                yield _sse(
                    {
                        "id": response_id,
                        "object": self._chunk_object(chat),
                        "created": created,
                        "model": self.frontend.model_name,
                        "choices": [],
                        "usage": _usage(usage),
                    }
                )
        except GenerationError as exc:
            yield _sse(error_body(exc.status, exc.error_type, exc.message, exc.param, exc.code))
        finally:
            self.frontend.close_later(stream)
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _chunk_object(chat: bool) -> str:
        return "chat.completion.chunk" if chat else "text_completion"

    def _chat_chunk(
        self, response_id: str, created: int, delta: dict, finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.frontend.model_name,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    # ----------------------------------------------------------------------- body builders
    def build_completion(
        self, d: TextDelta, response_id: str, created: int, streaming: bool
    ) -> dict[str, Any]:
        body = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": self.frontend.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": d.text,
                    "finish_reason": d.finish_reason,
                    "logprobs": self._completion_logprobs(d.token_ids, d.logprobs),
                }
            ],
        }
        if not streaming:
            body["usage"] = _usage(d.usage)
        return body

    def build_chat(
        self, d: TextDelta, response_id: str, created: int, streaming: bool
    ) -> dict[str, Any]:
        logprobs = self._chat_logprobs(d.token_ids, d.logprobs)
        if streaming:
            return self._chat_chunk(
                response_id, created, {"content": d.text}, d.finish_reason, logprobs
            )
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": self.frontend.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": d.text},
                    "logprobs": logprobs,
                    "finish_reason": d.finish_reason,
                }
            ],
            "usage": _usage(d.usage),
        }

    # ------------------------------------------------------------------------------ the app
    def app(self) -> Litestar:
        api = self

        @post("/v1/completions", status_code=200)
        async def completions(request: Request) -> Response | Stream:
            return await api._handle(request, CompletionRequest, api.build_completion)

        @post("/v1/chat/completions", status_code=200)
        async def chat_completions(request: Request) -> Response | Stream:
            return await api._handle(request, ChatCompletionRequest, api.build_chat)

        @get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {
                        "id": api.frontend.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "lamina",
                    }
                ],
            }

        @get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @get("/ready")
        async def ready() -> Response:
            if api.ready():
                return Response({"status": "ready"}, status_code=200)
            return error_response(503, "service_unavailable", "no engine worker is ready")

        def on_error(_: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 500)
            kind = "invalid_request_error" if status < 500 else "api_error"
            return error_response(status, kind, getattr(exc, "detail", None) or str(exc))

        return Litestar(
            route_handlers=[completions, chat_completions, models, health, ready],
            exception_handlers={Exception: on_error},
            openapi_config=None,
            logging_config=None,  # keep the service's own log format
        )
