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

Run as the stack's worker module (``Stack.worker_module``), with this directory on
``PYTHONPATH``; it takes ``lamina worker``'s flags.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from lamina.services.engine_worker import __main__ as worker_main
from lamina.services.engine_worker import service
from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.engine import Engine
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
        now = time.monotonic()
        self._next = max(self._next + self._period, now)
        time.sleep(self._next - now)
        return lambda: logits


if __name__ == "__main__":
    torch.set_num_threads(1)  # see the module's docstring
    service.Engine = FreeEngine  # type: ignore[misc]  # what the worker builds
    sys.exit(worker_main.main())
