"""``lamina stage``: run a pipeline stage of a worker that runs on another host.

The worker (``--pipeline-parallel-size P --remote-pipeline-stages R``) runs its first
stages itself and waits for the last R to join. On each of their hosts a stage host asks
the worker, over the bus, how (``worker.<id>.ranks``, as the worker's own identity), starts
the stage's ranks from the answer (``stage_ranks.start_stage``: this host's copy of the
checkpoint, checked against the worker's, on this host's device) and watches them. When
they end (the worker closed its group, failed or restarted) it asks again, and joins the
worker's next group: a new rendezvous, never the one that just ended. ``lamina node
--pipeline-stage <worker id>:<stage>`` runs one and restarts it if it exits.

A checkpoint that is not the worker's, or a stage the worker does not run elsewhere,
stops it with that one line (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import option, parse_config
from lamina.libs.errors import BadReply, NoResponders, RequestTimeout
from lamina.libs.service import Failure, announce, run
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.ranks import RankRendezvous, RanksRequest
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.stage_ranks import StageRanks, start_stage

log = logging.getLogger("lamina.stage")


@dataclass(frozen=True)
class StageHostConfig:
    """Run one pipeline stage of a worker on another host: ask it over the bus how to join
    its group, start the stage's ranks, and join its next group whenever one ends."""

    nats: NatsConfig = field(default_factory=NatsConfig)
    worker_id: str = option("", "the worker whose stage this host runs (required)")
    stage: int = option(1, "the pipeline stage to run (one the worker runs elsewhere)")
    model: str = option(
        "", "this host's copy of the worker's checkpoint (default: Lamina's default model)"
    )
    device: str = option(
        "cpu", "torch device of the stage's ranks (its rank i on the i-th CUDA device after it)"
    )
    host_name: str = option("", "this host's name in the worker's reports (default: the host name)")
    retry_interval: float = option(1.0, "seconds between asking a worker that has no rendezvous")


class StageHost:
    """The service: ask, start the stage's ranks, watch them, ask again."""

    def __init__(self, config: StageHostConfig) -> None:
        self.config = config
        self.worker_id = subjects.check_token("worker id", config.worker_id)
        self.bus: Bus | None = None
        self.ranks: StageRanks | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        cfg = self.config
        self.failure = Failure()
        self.bus = await cfg.nats.connect(f"stage-{self.worker_id}-{cfg.stage}")
        self.model = Path(cfg.model) if cfg.model else await asyncio.to_thread(ensure_default_model)
        self._task = asyncio.create_task(self._serve())
        await announce(self.bus, "stage", f"{self.worker_id}-{cfg.stage}")

    async def _serve(self) -> None:
        cfg, joined = self.config, b""
        host = cfg.host_name or socket.gethostname()
        while True:
            answer = await self._ask()
            if answer is None or not answer.ready:
                await asyncio.sleep(cfg.retry_interval)
                continue
            try:
                rendezvous = wire.rendezvous_from(answer)
            except ValueError as exc:
                log.warning("worker %s: %s", self.worker_id, exc)
                await asyncio.sleep(cfg.retry_interval)
                continue
            if rendezvous.key == joined:  # the group that just ended: wait for its next
                await asyncio.sleep(cfg.retry_interval)
                continue
            try:
                self.ranks = await asyncio.to_thread(
                    start_stage, rendezvous, cfg.stage, self.model, cfg.device, host
                )
            except ValueError as exc:  # not the worker's checkpoint, or not its stage
                self.failure.set(str(exc))
                return
            joined = rendezvous.key
            log.info(
                "joining worker %s (incarnation %s) as pipeline stage %d: %d rank(s)",
                self.worker_id,
                answer.incarnation,
                cfg.stage,
                len(self.ranks.procs),
            )
            while self.ranks.running():
                await asyncio.sleep(0.2)
            codes = [proc.exitcode for proc in self.ranks.procs]
            await asyncio.to_thread(self.ranks.stop)
            log.warning(
                "pipeline stage %d of worker %s ended (its ranks' exit codes %s); joining "
                "the worker's next group",
                cfg.stage,
                self.worker_id,
                codes,
            )

    async def _ask(self) -> RankRendezvous | None:
        """The worker's answer, or None where none came (logged)."""
        subject = subjects.worker_ranks(self.worker_id)
        try:
            answer = await self.bus.request(  # type: ignore[union-attr]
                subject, RanksRequest(stage=self.config.stage), RankRendezvous, timeout=2.0
            )
        except NoResponders:
            log.info("worker %s is not up (or runs no stage elsewhere)", self.worker_id)
            return None
        except (RequestTimeout, BadReply) as exc:
            log.warning("worker %s: %s", self.worker_id, exc)
            return None
        if not answer.ready:
            log.info("%s", answer.message)
        return answer

    async def drain(self) -> None:
        """Nothing to finish: the stage's work is the worker's."""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)
        if self.bus is not None:
            await self.bus.close()


def main(argv: list[str] | None = None) -> int:
    config = parse_config(StageHostConfig, argv, prog="lamina stage")
    try:
        host = StageHost(config)
    except ValueError as exc:  # no worker id, or one that cannot name a subject
        print(f"lamina stage: --worker-id: {exc}", file=sys.stderr)
        return 2
    return run("stage", host)


if __name__ == "__main__":
    sys.exit(main())
