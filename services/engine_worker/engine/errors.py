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
    """A request the engine will not run; ``param`` names the offending input (the
    argument order and names of the gateway's ``InvalidRequest``, OpenAI's)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EmptyPromptError(InvalidRequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty: at least one token is required", "prompt_token_ids")


class PromptTooLongError(InvalidRequestError):
    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int) -> None:
        message = context_overflow(prompt_len, max_tokens, max_model_len)
        super().__init__(message or "the request fits the context", "prompt_token_ids")
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class TokenOutOfVocabError(InvalidRequestError):
    def __init__(self, token_id: int, vocab_size: int, field: str = "prompt_token_ids") -> None:
        super().__init__(
            f"{field}: token id {token_id} is outside the vocabulary [0, {vocab_size})", field
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in the engine", "request_id")
        self.request_id = request_id


class RankStartError(EngineError):
    """A rank could not start (no such device, not enough memory, a bad shard); ``who``
    names it ("tensor-parallel rank 1 of 2")."""

    def __init__(self, who: str, reason: str) -> None:
        super().__init__(f"{who} cannot start: {reason}")
        self.who = who


class RankGroupFailure(EngineError):
    """The group can no longer step (a rank exited or hung, or a step broke): every
    request it held lost its KV; restart the whole group."""


class KvLayoutMismatch(EngineError):
    """KV blocks from an engine whose cache is laid out otherwise (block size, dtype,
    layers, KV heads, head size): they cannot be imported, and are refused whole."""

    def __init__(self, ours: str, theirs: str) -> None:
        super().__init__(f"KV blocks laid out {theirs} cannot join a cache laid out {ours}")
        self.ours, self.theirs = ours, theirs
