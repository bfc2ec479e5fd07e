"""Typed engine errors. Each carries the data a caller needs to build a wire or HTTP error."""

from __future__ import annotations

from lamina.libs.context_length import context_overflow


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A checkpoint cannot be loaded; ``where`` names the file, tensor or config field."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class InvalidRequestError(EngineError):
    """A request the engine will not run. ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class EmptyPromptError(InvalidRequestError):
    def __init__(self) -> None:
        super().__init__("prompt_token_ids", "the prompt is empty: at least one token is required")


class PromptTooLongError(InvalidRequestError):
    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int) -> None:
        message = context_overflow(prompt_len, max_tokens, max_model_len)
        super().__init__("prompt_token_ids", message or "the request fits the context")
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class TokenOutOfVocabError(InvalidRequestError):
    def __init__(self, token_id: int, vocab_size: int, field: str = "prompt_token_ids") -> None:
        super().__init__(
            field, f"{field}: token id {token_id} is outside the vocabulary [0, {vocab_size})"
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"request id {request_id!r} is already in the engine")
        self.request_id = request_id
