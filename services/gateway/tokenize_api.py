"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the model's tokenizer and chat
template, as the completion routes use them, without generating anything.

A text or chat tokenizes to exactly the prompt tokens a completion or chat completion
with the same input gets (the same ``ModelTokenizer``). Encoding runs on a thread (the
tokenizer releases the GIL), so a long text does not hold up the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lamina.services.gateway.errors import InvalidRequest
from lamina.services.gateway.intake import Intake, check_roles
from lamina.services.gateway.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    decode_body,
)
from lamina.services.gateway.tokenizer import ChatPrompt, TemplateError


class TokenizeApi:
    """The two routes' work, over one gateway's :class:`Intake` (its model, its
    tokenizer, and the longest context its workers serve)."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake
        self.tokenizer = intake.tokenizer

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        """``{count, max_model_len, tokens, token_strs}``; raises :class:`InvalidRequest`
        or, for another model, the 404 ``GenerationError``."""
        request = decode_body(body, TokenizeRequest)
        self.intake.check_model(request.model)
        prompt = request.to_prompt()
        if isinstance(prompt, ChatPrompt):
            check_roles(prompt.messages)
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode_prompt, prompt)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), "messages") from exc
        return {
            "count": len(ids),
            "max_model_len": self.intake.max_context,
            "tokens": ids,
            "token_strs": self.tokenizer.token_strs(ids) if request.return_token_strs else None,
        }

    def detokenize(self, body: bytes) -> dict[str, Any]:
        """``{prompt}``: the tokens' text, special tokens included."""
        request = decode_body(body, DetokenizeRequest)
        self.intake.check_model(request.model)
        vocab = self.tokenizer.vocab_size
        for i, token in enumerate(request.tokens):
            if token >= vocab:
                raise InvalidRequest(
                    f"token {token} is outside the vocabulary (size {vocab})", f"tokens[{i}]"
                )
        return {"prompt": self.tokenizer.decode(request.tokens, skip_special_tokens=False)}
