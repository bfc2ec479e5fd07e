"""OpenAI request bodies (with vLLM's extras) and how they map onto the wire request."""

from __future__ import annotations

from typing import Any

import msgspec

from lamina.schemas.v1.generate import Sampling, Sla


class InvalidRequest(ValueError):
    """A well-formed body asking for something invalid; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions. Unknown fields are ignored."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, default_max_tokens: int | None, logprobs: int | None) -> Sampling:
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequest(f"max_tokens ({max_tokens}) must be at least 1", "max_tokens")
        return Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
        )

    def sla(self) -> Sla:
        return Sla(priority=self.priority)


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False

    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a list of one "
            "of those (batched prompts are not supported)",
            "prompt",
        )

    def validate(self) -> None:
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidRequest(
                    f"content part type {part.type!r} is not supported", "messages"
                )
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None

    def chat(self) -> list[dict[str, str]]:
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def decode_body(body: bytes, kind: type) -> Any:
    """Decode a JSON body, turning msgspec's errors into :class:`InvalidRequest`."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        param = None
        text = str(exc)
        if "`$." in text:
            param = text.split("`$.", 1)[1].split("`", 1)[0]
        raise InvalidRequest(f"invalid request body: {text}", param) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
