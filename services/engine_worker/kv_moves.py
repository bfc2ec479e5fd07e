"""A worker's part in moving KV between workers: it sends the blocks the scheduler grants
(``KvSender``) and fetches a request's leading blocks before it runs it, from the source
the scheduler named (``GenerateRequest.kv_source``), importing them into its engine. A
fetch that fails or times out is counted and logged, and the request computes its prefix
here as it would have without one: a transfer can only save work, never lose a request.
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
from lamina.services.engine_worker.engine.errors import EngineError
from lamina.services.engine_worker.engine.kv_tier import KvBlocks
from lamina.services.engine_worker.engine_thread import EngineThread
from lamina.services.engine_worker.kv_transfer import KvSender, TransferFailed, fetch

log = logging.getLogger("lamina.worker.kv_moves")
tracer = spans.Tracer("lamina.worker")

ENGINE_CALL_TIMEOUT_S = 30.0
"""Most seconds an export or import waits for the engine thread (one step, normally)."""


class KvMoves:
    """Sends and fetches for one worker; its counters go into the heartbeat."""

    def __init__(self, thread: EngineThread, host: str, fetch_timeout_s: float) -> None:
        self._thread = thread
        self._host = host
        self.fetch_timeout_s = fetch_timeout_s
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

    async def grant(self, grant: KvGrant) -> None:
        if self.sender is None:
            log.warning("a KV grant for %s, but this worker's KV cannot move", grant.receiver)
            return
        await self.sender.grant(grant)

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
        try:
            blocks = await fetch(source, self.fetch_timeout_s)
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

    async def _export(self, hashes: list[int]) -> KvBlocks:
        return await self._on_engine(lambda engine: engine.export_blocks(hashes))

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
        )
