"""An engine worker whose model costs nothing, for measuring the data path around it
(``benchmarks/data_path.py``): the real worker shell (bus, streams, heartbeats, KV
events), the real engine's scheduler, block manager and sampler, and in place of the
model's forward pass, logits that pick one token, ready one step period
(``LAMINA_FREE_STEP_MS``, default 10) after the previous step's. Every running stream
gets a token a step, as from a real engine at that step time, and what the worker
process spends beyond sleeping is the shell's and the engine's bookkeeping.

The free engine computes on one thread (``torch.set_num_threads(1)``). With two, the
engine's bookkeeping ops over a large batch (the sampler over every stream's logits) are
OpenMP parallel regions, and libgomp's idle thread then spins for ~6 ms after each one
(its default spin count, on the development VM): through the step's sleep, where a real
engine's forward pass would have that thread computing. That spin was 57 µs of the
worker's CPU a token at 256 streams, a cost no real worker has.

With ``LAMINA_FREE_ENGINE=null`` the engine's bookkeeping goes too (:class:`NullEngine`):
no batch scheduler, block manager or sampler, every request held gets a token a step,
and what the worker process spends is the shell's alone (its bus, streams, heartbeats).
At tens of thousands of tokens a second the real bookkeeping takes most of a core of
its own, and measuring one gateway's ceiling on a small machine needs that core.

Run as the stack's worker module (``Stack.worker_module``), with this directory on
``PYTHONPATH``; it takes ``lamina worker``'s flags.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable

import torch

from lamina.services.engine_worker import __main__ as worker_main
from lamina.services.engine_worker import service
from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.outputs import EngineStats, StepResult
from lamina.services.engine_worker.engine.request import EngineRequest
from lamina.services.engine_worker.engine.runner import StepInput

TOKEN = 7
"""The token every step samples (greedy over logits that favour it alone)."""


class FreeEngine(Engine):
    """:class:`Engine` with a forward pass that costs one step period of sleep."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._period = float(os.environ.get("LAMINA_FREE_STEP_MS", "10")) / 1e3
        self._next = time.monotonic()

    def _start(self, batch: ScheduledBatch, extra: list[int] | None) -> Callable[[], torch.Tensor]:
        step = StepInput.of(batch, self.config.block_size, extra, self.blocks.take_moves())
        logits = torch.full((len(step.sampled), self.model_config.vocab_size), -1e4)
        logits[:, TOKEN] = 0.0
        self._wait_period()
        return lambda: logits

    def _wait_period(self) -> None:
        now = time.monotonic()
        self._next = max(self._next + self._period, now)
        time.sleep(self._next - now)


class NullEngine(FreeEngine):
    """:class:`FreeEngine` without the engine's scheduling: each step, one step period
    after the last, gives every request it holds the token ``TOKEN`` (its prompt's
    prefill and its decode steps alike), through the engine's own ``_postprocess`` (its
    finish reasons, timings and output), and nothing else: no batch, no KV blocks, no
    logits."""

    def add(self, request: EngineRequest) -> None:
        super().add(request)  # its checks and its state; then out of the batch queue
        self.scheduler.remove(self.requests[request.request_id])

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> StepResult:
        self._wait_period()
        now = time.monotonic()
        outputs = [
            self._postprocess(request, [TOKEN], None, None, now)
            for request in list(self.requests.values())
        ]
        self._generation_tokens += len(outputs)
        return StepResult(ScheduledBatch(), outputs, 0.0)

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), num_running=len(self.requests), num_waiting=0)


if __name__ == "__main__":
    torch.set_num_threads(1)  # see the module's docstring
    null = os.environ.get("LAMINA_FREE_ENGINE") == "null"
    service.Engine = NullEngine if null else FreeEngine  # type: ignore[misc]  # what it builds
    sys.exit(worker_main.main())
