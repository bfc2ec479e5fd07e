"""The scheduler service: registry from heartbeats, admission, placement, forwarding.

Runs in the ``scheduler`` queue group on ``sched.submit`` (replicas share the load), while
every replica hears every heartbeat. A placed request is forwarded to the worker with the
gateway's reply inbox unchanged, so tokens flow worker → gateway directly; a rejected one
gets a typed ``Rejected`` on that inbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.libs.config import option
from lamina.libs.errors import PayloadTooLarge
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import GenerateRequest, Rejected, RejectReason
from lamina.schemas.v1.records import PLACED, PlacementRecord
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest, WorkerStats, WorkerView
from lamina.services.scheduler.placement import Decision, place
from lamina.services.scheduler.registry import Registry

log = logging.getLogger("lamina.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: worker registry, admission and placement."""

    nats_url: str = option("nats://127.0.0.1:4222", "NATS server URL")
    scheduler_id: str = option("", "replica id (default: <host>-<pid>)")


class SchedulerService:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.registry = Registry()
        self.bus: Bus | None = None

    async def start(self) -> None:
        self.bus = bus = await Bus.connect(self.config.nats_url, f"scheduler-{self.scheduler_id}")
        await bus.subscribe(subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False)
        await bus.subscribe(
            subjects.SCHED_SUBMIT, GenerateRequest, self._on_submit, queue="scheduler"
        )
        await bus.subscribe(subjects.SCHED_STATUS, ClusterStatusRequest, self._on_status)

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        self.registry.heartbeat(stats)

    async def _on_submit(self, request: GenerateRequest, msg: Msg) -> None:
        if not msg.reply:
            log.warning("submit %s has no reply subject; dropped", request.request_id)
            return
        decision = place(request, self.registry.candidates())
        if decision.worker_id is None:
            await self.bus.publish(
                msg.reply,
                Rejected(
                    request_id=request.request_id,
                    reason=decision.reason,
                    message=decision.message,
                    retryable=decision.retryable,
                ),
            )
        else:
            forwarded = msgspec.structs.replace(request, worker_id=decision.worker_id)
            try:
                await self.bus.publish(
                    subjects.worker_generate(decision.worker_id), forwarded, reply=msg.reply
                )
            except PayloadTooLarge as exc:  # the worker id pushed it over the limit
                message = f"the request is too large to forward: {exc}"
                decision = Decision(
                    None, RejectReason.INVALID_REQUEST, message, decision.candidates
                )
                await self.bus.publish(
                    msg.reply,
                    Rejected(
                        request_id=request.request_id,
                        reason=decision.reason,
                        message=message,
                        param="prompt",
                    ),
                )
            else:
                self.registry.placed(decision.worker_id, len(request.prompt_token_ids))
        # The record is for telemetry: off the request's critical path. Yielding once lets
        # the client's flusher task put the forward on the wire before the record is built.
        await asyncio.sleep(0)
        await self.bus.publish(
            subjects.EVENTS_PLACEMENT,
            PlacementRecord(
                request_id=request.request_id,
                worker_id=decision.worker_id,
                reason=decision.reason or PLACED,
                candidates=decision.candidates,
                score=decision.score,
                attempt=request.attempt,
            ),
        )

    async def _on_status(self, _: ClusterStatusRequest, msg: Msg) -> None:
        views = [
            WorkerView(stats=e.stats, alive=alive, last_seen_ms=e.last_seen_ms)
            for e, alive in self.registry.view.snapshot()
        ]
        await self.bus.reply(msg, ClusterStatus(scheduler_id=self.scheduler_id, workers=views))

    async def drain(self) -> None:
        """Nothing is held here: in-flight requests live on workers and gateways."""
        await asyncio.sleep(0)

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.drain()
