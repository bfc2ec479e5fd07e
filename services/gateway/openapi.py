"""The gateway's OpenAPI document (``GET /openapi.json``), built from the very msgspec
types that decode request bodies, so the document cannot drift from what is accepted."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from lamina.services.gateway.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)
from lamina.services.gateway.responses_api import ResponsesRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "the request is invalid (the field is named)",
    "401": "no or wrong API key",
    "403": "the key may not ask for this priority",
    "404": "no such model",
    "413": "the body is too large",
    "429": "overloaded or rate-limited: see Retry-After",
    "503": "no worker can take it: see Retry-After",
    "504": "its deadline passed",
}
_DESCRIPTIONS = _ERRORS | {
    "409": "the adapter is in use by a running request",
    "502": "a worker did not answer",
}


def _post(
    operation: str, summary: str, body: dict[str, Any], ok: dict, errors: Iterable[str]
) -> dict[str, Any]:
    """A POST of a JSON body: its 200 answer ``ok``, and the ``errors`` it can give."""
    responses: dict[str, Any] = {"200": ok}
    for status in errors:
        responses[status] = {
            "description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return {
        "post": {
            "operationId": operation,
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": responses,
        }
    }


def _generation(operation: str, summary: str, body: dict[str, Any]) -> dict[str, Any]:
    ok = {
        "description": "the completion, or its server-sent events when stream is true",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    }
    return _post(operation, summary, body, ok, _ERRORS)


def _json(operation: str, summary: str, body: dict[str, Any], answer: dict) -> dict[str, Any]:
    """A POST that answers one JSON object, or an error."""
    ok = {"description": summary, "content": {"application/json": {"schema": answer}}}
    return _post(operation, summary, body, ok, ("400", "401", "404"))


_TOKENS = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
_TEXT = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
_VERSION = {"type": "object", "properties": {"version": {"type": "string"}}}


def _probe(operation: str, summary: str) -> dict[str, Any]:
    return {
        "get": {
            "operationId": operation,
            "summary": summary,
            "security": [],
            "responses": {"200": {"description": "yes"}, "503": {"description": "not yet"}},
        }
    }


def openapi_document(lora_updates: bool = False) -> dict[str, Any]:
    """The document; ``lora_updates``: with vLLM's run-time LoRA routes, which the gateway
    serves only with ``--allow-runtime-lora-updating``."""
    kinds = [
        CompletionRequest,
        ChatCompletionRequest,
        BatchChatCompletionRequest,
        ResponsesRequest,
        TokenizeRequest,
        DetokenizeRequest,
    ]
    (completion, chat, batch, responses, tokenize, detokenize, *lora), schemas = (
        msgspec.json.schema_components(
            kinds + ([LoadLoraRequest, UnloadLoraRequest] if lora_updates else []),
            ref_template="#/components/schemas/{name}",
        )
    )
    either = {"oneOf": [chat, completion]}
    models = {"description": "the served model", "content": {"application/json": {}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Lamina gateway (OpenAI-compatible)", "version": "v1"},
        "paths": {
            "/v1/completions": _generation("createCompletion", "complete a prompt", completion),
            "/v1/chat/completions": _generation("createChatCompletion", "chat", chat),
            "/v1/chat/completions/batch": _generation(
                "createChatCompletionBatch", "several chats, a choice each (vLLM's)", batch
            ),
            "/v1/responses": _generation(
                "createResponse", "OpenAI's Responses API (events when stream is true)", responses
            ),
            "/invocations": _generation(
                "invocations", "SageMaker's: a chat (messages) or a completion (prompt)", either
            ),
            "/v1/models": {"get": {"operationId": "listModels", "responses": {"200": models}}},
            "/v1/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": models,
                        "404": {
                            "description": _ERRORS["404"],
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Error"}
                                }
                            },
                        },
                    },
                }
            },
            "/tokenize": _json("tokenize", "a text's or chat's tokens", tokenize, _TOKENS),
            "/detokenize": _json("detokenize", "tokens' text", detokenize, _TEXT),
            "/version": {
                "get": {
                    "operationId": "version",
                    "responses": {
                        "200": {
                            "description": "the server's version",
                            "content": {"application/json": {"schema": _VERSION}},
                        }
                    },
                }
            },
            "/health": _probe("health", "the process is alive"),
            "/ready": _probe("ready", "a worker is ready to serve"),
            "/ping": _probe("ping", "SageMaker's: a worker is ready to serve (empty body)"),
        },
        "components": {
            "schemas": {**schemas, "Error": _ERROR},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}],
    }
    if lora_updates:
        load, unload = lora
        done = {
            "description": "done (vLLM's plain-text answer)",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
        errors = ("400", "401", "404", "409", "502")
        document["paths"] |= {
            "/v1/load_lora_adapter": _post(
                "loadLoraAdapter", "load a LoRA adapter on the model's workers", load, done, errors
            ),
            "/v1/unload_lora_adapter": _post(
                "unloadLoraAdapter", "unload a LoRA adapter from them", unload, done, errors
            ),
        }
    return document
