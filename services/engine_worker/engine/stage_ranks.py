"""A pipeline stage's ranks on a host other than their worker's: started by a stage host
(``services/engine_worker/stage_host.py``) from the rendezvous the worker published
(``remote_ranks.py``); each joins the worker's group as its local ranks do
(``rank_group.rank_main``), over the step channel instead of a pipe."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lamina.services.engine_worker.engine.rank_group import (
    make_segments,
    rank_device,
    rank_main,
)
from lamina.services.engine_worker.engine.remote_ranks import (
    Rendezvous,
    checkpoint_digest,
    use_interface_toward,
)


@dataclass
class StageRanks:
    """One pipeline stage's ranks on this host, joined to a driver on another."""

    procs: list[multiprocessing.process.BaseProcess]
    segment: Path | None

    def running(self) -> bool:
        """Whether every rank still runs (the group stands while they all do)."""
        return all(proc.exitcode is None for proc in self.procs)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop what still runs (the driver then fails its group) and remove the segment."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        if self.segment is not None:
            self.segment.unlink(missing_ok=True)


def start_stage(
    rendezvous: Rendezvous,
    stage: int,
    model: Path,
    device: str,
    host: str,
    threads: int | None = None,
) -> StageRanks:
    """Start pipeline stage ``stage``'s ranks for the driver that published
    ``rendezvous``: on ``device`` (the stage's tensor-parallel rank ``i`` on the ``i``-th
    CUDA device after it), from ``model``, this host's copy of the driver's checkpoint
    (ValueError if it is not the same, or the driver runs no such stage elsewhere).
    ``host`` names this host in the ranks' reports; on a CPU each rank runs ``threads``
    torch threads (default: this host's cores split between them)."""
    config = rendezvous.config
    first_remote = config.pipeline_parallel_size - config.remote_pipeline_stages
    if not first_remote <= stage < config.pipeline_parallel_size:
        raise ValueError(
            f"the worker runs no pipeline stage {stage} on another host (its stages "
            f"{first_remote}-{config.pipeline_parallel_size - 1} are remote)"
            if config.remote_pipeline_stages
            else "the worker runs every pipeline stage itself (--remote-pipeline-stages 0)"
        )
    if checkpoint_digest(model) != rendezvous.digest:
        raise ValueError(f"{model} is not the worker's checkpoint ({config.model}): they differ")
    config = dataclasses.replace(config, model=model, device=device)
    use_interface_toward(rendezvous.host)  # before the ranks start: they inherit it
    tp_size = config.tensor_parallel_size
    stages = range(stage, stage + 1)
    segments = make_segments(config, rank_device(device, 0), stages)
    threads = threads or max(1, (os.cpu_count() or 1) // tp_size)
    context = multiprocessing.get_context("spawn")
    procs = []
    for index in range(tp_size):
        rank = stage * tp_size + index
        proc = context.Process(
            target=rank_main,
            args=(rendezvous, config, rank, index, rendezvous.store, rendezvous.timeout_s),
            kwargs={"threads": threads, "parent": os.getpid(), "segments": segments, "host": host},
            name=f"lamina-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return StageRanks(procs, segments[stage])
