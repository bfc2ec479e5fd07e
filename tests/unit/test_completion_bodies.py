"""The stream chunks the gateway writes from pre-encoded bytes are the ones it builds."""

from __future__ import annotations

import functools
import json

import pytest

from lamina.services.gateway.completion_bodies import Bodies, Reply, TextChunks
from lamina.services.gateway.text_stream import TextDelta

TEXTS = ["", " hello", 'a "quoted" \\ path', "line\nbreak\ttab", "é ü 中文 🙂", "\x00\x1f", "</s>"]


def _reply(chat: bool, model: str) -> Reply:
    bodies = Bodies(None, "served-model")  # type: ignore[arg-type]  # (no logprobs here)
    build = bodies.chat if chat else bodies.completion
    key = "0123456789abcdef"
    return Reply(
        ("chatcmpl-" if chat else "cmpl-") + key,
        1765000000,
        chat,
        functools.partial(build, model=model),
        False,
        None,
        model=model,
    )


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("model", ["", "an-adapter"])
@pytest.mark.parametrize("index", [0, 3])
def test_text_chunks_are_the_chunks_the_builder_writes(chat: bool, model: str, index: int) -> None:
    reply = _reply(chat, model)
    chunks = TextChunks(reply, index)
    for text in TEXTS:
        built = reply.build(TextDelta(text, [7], None), reply.id, reply.created, streaming=True)
        built["choices"][0]["index"] = index
        encoded = chunks.encode(text)
        assert json.loads(encoded) == built
        choice = json.loads(encoded)["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text
        assert choice["finish_reason"] is None and choice["logprobs"] is None
        assert json.loads(encoded)["model"] == (model or "served-model")
