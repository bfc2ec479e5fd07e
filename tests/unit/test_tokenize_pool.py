"""Long prompts are tokenized in other processes, exactly as inline, while the event loop
keeps running."""

from __future__ import annotations

import asyncio
import time

import pytest

from lamina.services.gateway.tokenize_pool import INLINE_CHARS, TokenizePool
from lamina.services.gateway.tokenizer import ChatPrompt, ModelTokenizer, TemplateError, TextPrompt


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> ModelTokenizer:
    return ModelTokenizer(tiny_model)


async def longest_stall(work, interval: float = 0.005) -> tuple[object, float]:
    """Run ``work`` while a ticker measures the longest the loop went without running it."""
    gaps, done = [], asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(interval)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    result = await work
    done.set()
    await ticker
    return result, max(gaps)


def test_long_prompts_are_tokenized_off_the_loop_exactly_as_inline(tokenizer, tiny_model):
    text = "Once upon a time, a small lamp lit the whole valley. " * 40_000  # ~2 MB
    messages = [{"role": "user", "content": text[: INLINE_CHARS * 4]}]
    started = time.perf_counter()
    inline_ids = tokenizer.encode(text)
    inline_s = time.perf_counter() - started

    async def main():
        pool = TokenizePool(tokenizer, tiny_model, workers=1)
        await pool.start()
        try:
            ids, stall = await longest_stall(pool.encode(TextPrompt(text)))
            chat = await pool.encode(ChatPrompt(messages))
            short = await pool.encode(TextPrompt("hello"))  # inline
            return ids, stall, chat, short
        finally:
            pool.close()

    ids, stall, chat, short = asyncio.run(main())
    assert ids == inline_ids
    assert chat == tokenizer.encode_chat(messages) and short == tokenizer.encode("hello")
    # Inline, the loop would have stalled for all of inline_s (~1 s; 3.5 s on a loaded CI
    # machine); here it kept running, bar taking the result in.
    assert stall < inline_s / 10, (stall, inline_s)


def test_a_template_error_comes_back_from_the_pool(tiny_model, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    untemplated = ModelTokenizer(tmp_path)  # no tokenizer_config.json: no chat template

    async def main():
        pool = TokenizePool(untemplated, tmp_path, workers=1)
        try:
            with pytest.raises(TemplateError, match="no chat template"):
                await pool.encode(
                    ChatPrompt([{"role": "user", "content": "x" * (INLINE_CHARS + 1)}])
                )
        finally:
            pool.close()

    asyncio.run(main())


def test_beyond_its_bound_the_pool_sheds_with_a_429(tokenizer, tiny_model):
    from lamina.services.gateway.errors import GenerationError

    async def main():
        pool = TokenizePool(tokenizer, tiny_model, workers=1, max_pending=1)
        try:
            text = "x " * INLINE_CHARS
            first = asyncio.create_task(pool.encode(TextPrompt(text)))
            await asyncio.sleep(0)
            with pytest.raises(GenerationError) as refused:
                await pool.encode(TextPrompt(text))
            await first
            return refused.value
        finally:
            pool.close()

    assert asyncio.run(main()).status == 429
