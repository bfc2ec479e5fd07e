"""vLLM's prompt truncation (``truncate_prompt_tokens``, ``truncation_side``)."""

from __future__ import annotations

from dataclasses import dataclass

from lamina.services.gateway.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's ``truncate_prompt_tokens`` and ``truncation_side``: keep ``tokens`` of a
    prompt's tokens (-1: as many as the longest context served leaves room for one
    generated token), the last ones (``left``, vLLM's default for generation: the end of
    a prompt is what the model continues) or the first (``right``)."""

    tokens: int
    side: str = "left"

    def apply(self, ids: list[int], max_context: int) -> list[int]:
        """``ids`` truncated; a 400 naming ``truncate_prompt_tokens`` if it is over the
        longest context served."""
        keep = self.tokens
        if keep == -1:
            if not max_context:  # no worker known yet: the worker refuses what is too long
                return ids
            keep = max_context - 1
        elif max_context and keep > max_context:
            raise InvalidRequest(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{max_context}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if self.side == "left" else ids[:keep]
