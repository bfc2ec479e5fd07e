"""The one context-length rule: whether a prompt and the tokens it asks for fit.

The scheduler applies it to each worker's reported ``max_model_len``, the engine to its
own, so a request the scheduler places never fails the engine's check, and both say why
in the same words."""

from __future__ import annotations


def context_overflow(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """Why a prompt and the tokens asked for do not fit ``max_model_len``, or None
    (``max_tokens=None`` asks for at least one token)."""
    wanted = max(max_tokens or 1, 1)
    if prompt_tokens + wanted <= max_model_len:
        return None
    return (
        f"this model's maximum context length is {max_model_len} tokens, but the request "
        f"has {prompt_tokens} prompt tokens and asks for {max_tokens or 1} more"
    )
