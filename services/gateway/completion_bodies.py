"""OpenAI's completion and chat completion bodies and stream chunks, written from the
gateway's text deltas: choices, logprobs (OpenAI's and vLLM's shapes), usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from lamina.schemas.v1.generate import TokenLogprob, Usage
from lamina.services.gateway.text_stream import ScoredPrompt, TextDelta
from lamina.services.gateway.tokenizer import ModelTokenizer


@dataclass(frozen=True, slots=True)
class Reply:
    """How one completion response is written, once its request is started."""

    id: str
    """``cmpl-<key>`` or ``chatcmpl-<key>``: the key is the requests' id on the bus."""
    created: int
    chat: bool
    build: Callable[..., dict[str, Any]]
    """Builds a body (or a chunk) from a delta (``Bodies.completion``, ``Bodies.chat``)."""
    token_ids: bool
    """vLLM's ``return_token_ids``."""
    echoes: list[str] | None
    """With ``echo``: each choice's prompt text, which its text starts with."""
    batch: bool = False
    """A batch of chats: each choice has a prompt of its own (as a completion's have)."""
    model: str = ""
    """The model the request named (the served model, or one of its LoRA adapters),
    which every body and chunk names as vLLM's do; empty: the served model."""

    @property
    def prompt_per_choice(self) -> bool:
        """Whether a choice names its own prompt (``prompt_token_ids``)."""
        return self.batch or not self.chat


def indexed(choice: dict[str, Any], index: int) -> dict[str, Any]:
    choice["index"] = index
    return choice


_json = msgspec.json.Encoder()
_MARK = "\x00text\x00"
"""Stands for a chunk's text while :class:`TextChunks` encodes the rest of it."""


class TextChunks:
    """One streamed choice's chunks that carry text and nothing else (no finish, logprobs,
    token ids, usage or tool calls): most of a stream's. The chunk ``Reply.build`` writes
    is encoded once around a marker, so each one then costs the encoding of its text."""

    def __init__(self, response: Reply, index: int) -> None:
        marked = TextDelta(_MARK, [], None)
        chunk = response.build(marked, response.id, response.created, streaming=True)
        chunk["choices"] = [indexed(chunk["choices"][0], index)]
        self._head, mark, self._tail = _json.encode(chunk).partition(_json.encode(_MARK))
        assert mark, "the builder wrote a chunk without the delta's text"

    def encode(self, text: str) -> bytes:
        """The chunk of ``text``, as JSON."""
        return self._head + _json.encode(text) + self._tail


def sum_usage(usages: list[Usage | None], n: int = 1) -> Usage | None:
    """The usage of a body's requests together (None until every one has reported): each
    prompt counted once (the first of its ``n`` sequences), every sequence's output."""
    if not usages or any(u is None for u in usages):
        return None
    firsts = usages[::n]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),  # type: ignore[union-attr]
        completion_tokens=sum(u.completion_tokens for u in usages),  # type: ignore[union-attr]
        cached_tokens=sum(u.cached_tokens for u in firsts),  # type: ignore[union-attr]
    )


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
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


def add_token_ids(
    payload: dict[str, Any], response: Reply, prompts: list[list[int]], outputs: list[list[int]]
) -> None:
    """vLLM's ``return_token_ids`` on a whole response: each choice's ``token_ids``, and
    its prompt's (on the choice, or once at the top where the choices share one chat)."""
    if not response.token_ids:
        return
    for choice, prompt, ids in zip(payload["choices"], prompts, outputs, strict=True):
        if response.prompt_per_choice:
            choice["prompt_token_ids"] = prompt
        choice["token_ids"] = ids
    if not response.prompt_per_choice:
        payload["prompt_token_ids"] = prompts[0]


class Bodies:
    """Writes the bodies and chunks of one served model's responses."""

    def __init__(self, tokenizer: ModelTokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _namer(self, as_ids: bool) -> Callable[[int], str]:
        """How logprobs name a token: its text, or vLLM's ``token_id:<id>``
        (``return_tokens_as_token_ids``)."""
        return (lambda token_id: f"token_id:{token_id}") if as_ids else self._token_text

    def _completion_logprobs(
        self, ids: list[int], lps: list[TokenLogprob | None] | None, as_ids: bool = False
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs (a ``None`` entry: a token without one, the first of
        an echoed prompt). Each position's ``top_logprobs`` has the sampled token first,
        then the most likely (OpenAI's: up to ``logprobs + 1`` entries)."""
        if lps is None:
            return None
        name = self._namer(as_ids)
        offsets, at = [], 0
        for token in ids:  # where each token's text starts in the choice's text
            offsets.append(at)
            at += len(self._token_text(token))
        return {
            "tokens": [name(t) for t in ids],
            "text_offset": offsets,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [
                None if lp is None else {name(t): lp.logprob} | {name(a): v for a, v in lp.top}
                for t, lp in zip(ids, lps, strict=True)
            ],
        }

    def _prompt_logprobs(self, prompt: ScoredPrompt | None) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (none for the first), by token id,
        its logprob, rank and text, and its top alternatives'."""
        if prompt is None:
            return None

        def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token)}

        entries: list[dict | None] = [None]
        ranked = zip(prompt.token_ids[1:], prompt.logprobs, prompt.ranks, strict=True)
        for token, lp, rank in ranked:
            scores = {str(token): entry(token, lp.logprob, rank)}
            for place, (other, value) in enumerate(lp.top, start=1):
                scores.setdefault(str(other), entry(other, value, place))
            entries.append(scores)
        return entries

    def _chat_logprobs(
        self, ids: list[int], lps: list[TokenLogprob] | None, as_ids: bool = False
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        name = self._namer(as_ids)
        content = []
        for token, lp in zip(ids, lps, strict=True):
            text = name(token)
            content.append(
                {
                    "token": text,
                    "logprob": lp.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (s := name(t)),
                            "logprob": v,
                            "bytes": list(s.encode()),
                        }
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}

    @staticmethod
    def chunk_object(chat: bool) -> str:
        return "chat.completion.chunk" if chat else "text_completion"

    def chat_chunk(
        self,
        response_id: str,
        created: int,
        delta: dict,
        finish: str | None,
        logprobs: Any = None,
        model: str = "",
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model or self.model_name,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    def completion(
        self,
        d: TextDelta,
        response_id: str,
        created: int,
        streaming: bool,
        as_ids: bool = False,
        model: str = "",
    ) -> dict[str, Any]:
        body = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model or self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": d.text,
                    "finish_reason": d.finish_reason,
                    "logprobs": self._completion_logprobs(d.token_ids, d.logprobs, as_ids),
                }
            ],
        }
        if not streaming:  # vLLM's: null where the prompt was not scored
            body["choices"][0]["prompt_logprobs"] = self._prompt_logprobs(d.prompt)
            body["usage"] = usage_body(d.usage)
        return body

    def chat(
        self,
        d: TextDelta,
        response_id: str,
        created: int,
        streaming: bool,
        as_ids: bool = False,
        model: str = "",
    ) -> dict[str, Any]:
        logprobs = self._chat_logprobs(d.token_ids, d.logprobs, as_ids)
        calls = [call.body(streaming) for call in d.tool_calls or ()]
        if streaming:
            delta: dict[str, Any] = {"content": d.text}
            if calls:
                delta["tool_calls"] = calls
            return self.chat_chunk(response_id, created, delta, d.finish_reason, logprobs, model)
        message: dict[str, Any] = {"role": "assistant", "content": d.text}
        if calls:  # OpenAI's: no content (null) when the message is only calls
            message |= {"content": d.text or None, "tool_calls": calls}
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model or self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": d.finish_reason,
                }
            ],
            "usage": usage_body(d.usage),
            "prompt_logprobs": self._prompt_logprobs(d.prompt),
        }
