"""The OpenAI-compatible HTTP API on Litestar: the router. Each family of endpoints is
served by its own module: the completion routes (``completions.py``, in raw ASGI,
``asgi.py``), the Responses API (``responses_api.py``), tokenization (``tokenize_api.py``);
the model list, health and version are here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version as package_version
from typing import Any

from litestar import Litestar, Request, Response, asgi, delete, get, post, route
from litestar.types import ASGIApp, Receive, Scope, Send

from lamina.libs.errors import error_body
from lamina.services.gateway.asgi import direct_routes, with_request_ids
from lamina.services.gateway.completions import CompletionsApi
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.intake import Intake
from lamina.services.gateway.lora_admin import LoraAdmin
from lamina.services.gateway.openapi import openapi_document
from lamina.services.gateway.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    invocation_kind,
)
from lamina.services.gateway.replies import error_of
from lamina.services.gateway.responses_api import ResponsesApi
from lamina.services.gateway.tokenize_api import TokenizeApi

LAMINA_VERSION = package_version("lamina")


def error_response(
    status: int, error_type: str, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(error_body(error_type, message, param, code), status_code=status)


def _no_response(response_id: str) -> Response:
    return error_response(
        404, "not_found_error", f"no stored response {response_id[:80]!r}", "response_id"
    )


async def _answer(work: Awaitable[dict[str, Any]]) -> Response:
    """A JSON route's answer: its result, or its error in OpenAI's shape."""
    try:
        return Response(await work, status_code=200)
    except GenerationError as exc:
        return Response(error_of(exc), status_code=exc.status)


async def _answer_text(work: Awaitable[str]) -> Response:
    """A route that answers in plain text (as vLLM's adapter routes do), or its error in
    OpenAI's shape."""
    try:
        return Response(await work, status_code=200, media_type="text/plain")
    except GenerationError as exc:
        return Response(error_of(exc), status_code=exc.status)


class OpenAIApi:
    """Every route of the HTTP API, bound to one :class:`Intake`."""

    def __init__(
        self,
        intake: Intake,
        ready: Callable[[], bool],
        tool_call_parser: str = "hermes",
        trust_request_chat_template: bool = False,
        lora_admin: LoraAdmin | None = None,
    ) -> None:
        self.intake = intake
        self.ready = ready
        self.lora_admin = lora_admin
        """Run-time adapter loading (``--allow-runtime-lora-updating``); None: its routes
        are not served."""
        self.completions = CompletionsApi(intake, tool_call_parser, trust_request_chat_template)

    # ------------------------------------------------------------------------------ the app
    def app(self) -> Any:
        """The ASGI app: every route, each response with its ``x-request-id``; the
        completion routes served directly (``direct_routes``), the rest by Litestar."""
        return with_request_ids(direct_routes(self._completion_routes(), self._routes()))

    def _completion_routes(self) -> dict[str, ASGIApp]:
        serve = self.completions.serve

        def route(kind: type) -> ASGIApp:
            async def handle(scope: Scope, receive: Receive, send: Send) -> None:
                await serve(scope, receive, send, lambda _: kind)

            return handle

        return {
            "/v1/completions": route(CompletionRequest),
            "/v1/chat/completions": route(ChatCompletionRequest),
            "/v1/chat/completions/batch": route(BatchChatCompletionRequest),
        }

    def _routes(self) -> Litestar:
        api = self
        completions_api = self.completions

        responses = ResponsesApi(completions_api)

        @asgi("/v1/responses")
        async def create_response(scope: Scope, receive: Receive, send: Send) -> None:
            await responses.serve(scope, receive, send)

        @get("/v1/responses/{response_id:str}")
        async def get_response(response_id: str) -> Response:
            stored = responses.get(response_id)
            if stored is None:
                return _no_response(response_id)
            return Response(stored, status_code=200)

        @delete("/v1/responses/{response_id:str}", status_code=200)
        async def delete_response(response_id: str) -> Response:
            if not responses.delete(response_id):
                return _no_response(response_id)
            body = {"id": response_id, "object": "response", "deleted": True}
            return Response(body, status_code=200)

        @asgi("/invocations")
        async def invocations(scope: Scope, receive: Receive, send: Send) -> None:
            await completions_api.serve(scope, receive, send, invocation_kind)

        started = int(time.time())

        def card(name: str) -> dict[str, Any]:
            """The served model, or one of its LoRA adapters (``parent``: the model), as
            OpenAI lists it, with vLLM's extra fields."""
            base = api.intake.model_name
            return {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": "lamina",
                "root": name,
                "parent": None if name == base else base,
                "max_model_len": api.intake.max_context or None,  # None: no worker yet
                "precisions": api.intake.precisions,
            }

        @get("/v1/models")
        async def models() -> dict[str, Any]:
            names = [api.intake.model_name, *api.intake.adapters]
            return {"object": "list", "data": [card(name) for name in names]}

        @get("/v1/models/{model:path}")
        async def model(model: str) -> Response:
            try:
                name = api.intake.check_model(model.removeprefix("/"))
            except GenerationError as exc:
                return Response(error_of(exc), status_code=exc.status)
            return Response(card(name), status_code=200)

        tokenization = TokenizeApi(api.intake)

        @post("/tokenize", status_code=200)
        async def tokenize(request: Request) -> Response:
            return await _answer(tokenization.tokenize(await request.body()))

        @post("/detokenize", status_code=200)
        async def detokenize(request: Request) -> Response:
            body = await request.body()
            return await _answer(asyncio.to_thread(tokenization.detokenize, body))

        lora_routes = []
        if (lora_admin := self.lora_admin) is not None:

            @post("/v1/load_lora_adapter", status_code=200)
            async def load_lora_adapter(request: Request) -> Response:
                return await _answer_text(lora_admin.load(await request.body()))

            @post("/v1/unload_lora_adapter", status_code=200)
            async def unload_lora_adapter(request: Request) -> Response:
                return await _answer_text(lora_admin.unload(await request.body()))

            lora_routes = [load_lora_adapter, unload_lora_adapter]

        @get("/version")
        async def version() -> dict[str, str]:
            return {"version": LAMINA_VERSION}

        document = openapi_document(lora_updates=self.lora_admin is not None)

        @get("/openapi.json")
        async def openapi() -> dict[str, Any]:
            return document

        @get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @get("/ready")
        async def ready() -> Response:
            if api.ready():
                return Response({"status": "ready"}, status_code=200)
            return error_response(503, "service_unavailable", "no engine worker is ready")

        @route("/ping", http_method=["GET", "POST"])
        async def ping() -> Response:
            """SageMaker's health check (vLLM serves it): empty, 200 once a worker is ready."""
            return Response(b"", status_code=200 if api.ready() else 503)

        def on_error(_: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 500)
            kind = "invalid_request_error" if status < 500 else "api_error"
            return error_response(status, kind, getattr(exc, "detail", None) or str(exc))

        return Litestar(
            route_handlers=[
                invocations,
                create_response,
                get_response,
                delete_response,
                ping,
                models,
                model,
                tokenize,
                detokenize,
                version,
                openapi,
                health,
                ready,
                *lora_routes,
            ],
            exception_handlers={Exception: on_error},
            openapi_config=None,
            logging_config=None,  # keep the service's own log format
        )
