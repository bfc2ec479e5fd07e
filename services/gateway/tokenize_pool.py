"""Tokenizing (and rendering chat templates) off the gateway's event loop.

The tokenizer holds the GIL while it encodes (about 0.5 µs a character: a 4 MB prompt
takes 2 s), so a thread would not help: long prompts go to a pool of processes, each with
its own copy of the model's tokenizer. Short ones, which take less than the hop to
another process costs in TTFT, stay inline. The pool is bounded: beyond ``max_pending``
prompts in it, a new long one is shed with a 429 rather than queued without end.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from lamina.libs.lifetime import die_with_parent
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.tokenizer import ModelTokenizer, Prompt, TextPrompt

log = logging.getLogger("lamina.gateway.tokenize")

INLINE_CHARS = 8192
"""Prompts up to this many characters are tokenized on the loop (~4 ms at most)."""

_tokenizer: ModelTokenizer | None = None  # one per pool process


def _load(model_dir: str, gateway_pid: int) -> None:
    global _tokenizer
    # A terminal's Ctrl-C reaches the whole process group: the gateway decides when its
    # pool stops (after its drain), not the keyboard; a gateway that is killed takes its
    # pool with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, gateway_pid)
    _tokenizer = ModelTokenizer(Path(model_dir))


def _encode(prompt: Prompt) -> list[int]:
    assert _tokenizer is not None
    return _tokenizer.encode_prompt(prompt)


class TokenizePool:
    """Encode text or chat messages as ``tokenizer`` does (loaded from ``model_dir``), in
    ``workers`` processes for long prompts (0: always inline)."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        model_dir: Path | None = None,
        workers: int = 0,
        max_pending: int = 256,
    ) -> None:
        if workers > 0 and model_dir is None:
            raise ValueError("a pool of tokenizer processes needs the model directory")
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.workers = workers
        self.max_pending = max_pending
        self.pending = 0
        self._pool = self._new_pool() if workers > 0 else None

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),  # the gateway has threads
            initializer=_load,
            initargs=(str(self.model_dir), os.getpid()),
        )

    async def start(self) -> None:
        """Start the processes and load their tokenizers now, not on the first long prompt."""
        if self._pool is not None:
            loop = asyncio.get_running_loop()
            warm = [
                loop.run_in_executor(self._pool, _encode, TextPrompt("warm"))
                for _ in range(self.workers)
            ]
            await asyncio.gather(*warm)

    async def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; raises ``TemplateError`` as the tokenizer does."""
        if self._pool is None or prompt.chars <= INLINE_CHARS:
            return self.tokenizer.encode_prompt(prompt)
        if self.pending >= self.max_pending:
            raise GenerationError(
                429,
                "rate_limit_error",
                f"{self.pending} long prompts are being tokenized; retry shortly",
                code="overloaded",
                retry_after_s=1.0,
            )
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _encode, prompt)
        except BrokenProcessPool:  # a pool process died (killed, out of memory): start over
            log.error("a tokenizer process died; restarting the pool")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            return self.tokenizer.encode_prompt(prompt)
        finally:
            self.pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
