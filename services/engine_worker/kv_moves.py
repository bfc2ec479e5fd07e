"""A worker's part in moving KV between workers: it sends the blocks the scheduler grants
(``KvSender``) and fetches a request's leading blocks before it runs it, from the source
the scheduler named (``GenerateRequest.kv_source``), importing them into its engine. A
fetch that fails or times out is counted and logged, and the request computes its prefix
here as it would have without one: a transfer can only save work, never lose a request.

A grant may be a prefill leg (disaggregated serving): it names the prompt tokens to
compute, and this worker computes them at once, streaming nothing, and sends their
blocks once they are cached. The decode worker that fetches them computes what is left
(the prompt's last, partial block) and samples the first token itself, so a request's
sampling state (seed, penalties, grammar) lives on one worker only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import StatusCode

from lamina.libs import spans
from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.errors import EngineError, InvalidRequestError
from lamina.services.engine_worker.engine.kv_tier import KvBlocks
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine_thread import EngineThread
from lamina.services.engine_worker.kv_transfer import (
    GRANT_TTL_S,
    KvSender,
    TransferFailed,
    fetch,
)

log = logging.getLogger("lamina.worker.kv_moves")
tracer = spans.Tracer("lamina.worker")

ENGINE_CALL_TIMEOUT_S = 30.0
"""Most seconds an export or import waits for the engine thread (one step, normally)."""


class KvMoves:
    """Sends and fetches for one worker; its counters go into the heartbeat."""

    def __init__(
        self,
        thread: EngineThread,
        host: str,
        fetch_timeout_s: float,
        prefill_timeout_s: float | None = None,
    ) -> None:
        self._thread = thread
        self._host = host
        self.fetch_timeout_s = fetch_timeout_s
        self.prefill_timeout_s = prefill_timeout_s or fetch_timeout_s
        """Most seconds a prefill leg's blocks are waited for, by either side."""
        self._legs: dict[str, asyncio.Future[None]] = {}
        """Prefill legs computing here, by grant id: done once their blocks are cached."""
        self.prefills = 0
        self.layout = thread.spec.kv_layout if thread.spec is not None else ""
        self.sender: KvSender | None = None
        self.fetches = 0
        self.failures = 0
        self.fetched_blocks = 0
        self.rate = 0.0

    async def start(self) -> None:
        """Listen for receivers (a worker whose KV cannot move sends nothing)."""
        if self.layout:
            self.sender = KvSender(self._export, self._host)
            await self.sender.start()

    async def close(self) -> None:
        if self.sender is not None:
            await self.sender.close()

    @property
    def pending(self) -> int:
        """Grants that a receiver may still come for."""
        return self.sender.pending if self.sender is not None else 0

    async def grant(self, grant: KvGrant, context: otel_context.Context | None = None) -> None:
        """Take the scheduler's grant; start computing a prefill leg's prompt (traced
        under ``context``, the grant's)."""
        if self.sender is None:
            log.warning("a KV grant for %s, but this worker's KV cannot move", grant.receiver)
            return
        if grant.prefill_token_ids:
            self._prefill(grant, context)
        await self.sender.grant(grant)

    def _prefill(self, grant: KvGrant, context: otel_context.Context | None) -> None:
        """Compute a prefill leg's prompt into the prefix cache, now (the receiver may
        connect before it is done: the export waits for it)."""
        assert self._thread.spec is not None
        if self._thread.dead:  # nothing computes it: the receiver finds no blocks
            log.warning("prefill leg for %s refused: the engine is gone", grant.receiver)
            return
        tokens = grant.prefill_token_ids
        attributes = {"lamina.kv.receiver": grant.receiver, "lamina.prompt_tokens": len(tokens)}
        span = spans.start(
            tracer, f"kv prefill for {grant.receiver}", context, attributes=attributes
        )
        try:
            checked = self._thread.spec.request(
                f"prefill-{grant.grant_id}", tokens, SamplingParams(max_tokens=1, temperature=0)
            )
        except InvalidRequestError as exc:  # the receiver finds no blocks, and computes
            span.set_status(StatusCode.ERROR, exc.message[:200])
            span.end()
            log.warning("prefill leg for %s refused: %s", grant.receiver, exc.message)
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)
                span.end()
                loop.call_later(GRANT_TTL_S, self._legs.pop, grant.grant_id, None)

        self._legs[grant.grant_id] = ended
        self.prefills += 1
        self._thread.prefill(checked, lambda: loop.call_soon_threadsafe(end))

    async def fetch(
        self, request_id: str, source: KvSource, context: otel_context.Context | None = None
    ) -> int:
        """Fetch ``source``'s blocks into the engine; the blocks newly cached (0 when the
        transfer failed: the request computes them). Traced as its own span under
        ``context`` (the request's), between the scheduler's placement and the steps."""
        started = time.monotonic()
        attributes = {
            "lamina.request_id": request_id,
            "lamina.kv.source": source.worker_id,
            "lamina.kv.blocks_granted": len(source.block_hashes),
        }
        span = spans.start(tracer, f"kv fetch {source.worker_id}", context, attributes=attributes)
        timeout = self.prefill_timeout_s if source.prefill else self.fetch_timeout_s
        try:
            blocks = await fetch(source, timeout)
            placed = await self._on_engine(lambda engine: engine.import_blocks(blocks))
        except (TransferFailed, TimeoutError, EngineError) as exc:
            self.failures += 1
            span.set_status(StatusCode.ERROR, f"{exc or type(exc).__name__}"[:200])
            span.end()
            log.warning(
                "request %s computes its prefix: fetching %d blocks from %s failed (%s)",
                request_id,
                len(source.block_hashes),
                source.worker_id,
                exc or type(exc).__name__,
            )
            return 0
        self.fetches += 1
        self.fetched_blocks += len(blocks.hashes)
        self.rate = len(blocks.hashes) / max(time.monotonic() - started, 1e-6)
        span.set_attributes(
            {"lamina.kv.blocks_fetched": len(blocks.hashes), "lamina.kv.blocks_new": placed}
        )
        span.end()
        return placed

    async def _export(self, grant: KvGrant) -> KvBlocks:
        leg = self._legs.pop(grant.grant_id, None)
        if leg is not None:  # computing them: the receiver waits (its own timeout bounds it)
            await asyncio.wait_for(asyncio.shield(leg), self.prefill_timeout_s)
        return await self._on_engine(lambda engine: engine.export_blocks(grant.block_hashes))

    async def _on_engine(self, fn: Any) -> Any:
        """``fn(engine)`` run on the engine thread, its result or what it raised."""
        result: list = []

        def call(engine: Engine) -> None:
            try:
                result.append(fn(engine))
            except Exception as exc:  # handed back to the awaiting task
                result.append(exc)

        done = self._thread.call(call)
        if not await asyncio.to_thread(done.wait, ENGINE_CALL_TIMEOUT_S) or not result:
            raise TimeoutError(f"the engine thread did not answer in {ENGINE_CALL_TIMEOUT_S:g}s")
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]

    def stats(self) -> dict[str, Any]:
        """The heartbeat's ``kv_*`` fields."""
        sender = self.sender
        return dict(
            kv_layout=self.layout,
            kv_address=sender.address if sender is not None else "",
            kv_fetches_total=self.fetches,
            kv_fetch_failures_total=self.failures,
            kv_fetched_blocks_total=self.fetched_blocks,
            kv_sent_blocks_total=sender.sent_blocks if sender is not None else 0,
            kv_fetch_blocks_per_s=self.rate,
            kv_prefills_total=self.prefills,
        )
