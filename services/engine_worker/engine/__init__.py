"""The engine core: one model on one device, continuously batched over a paged KV pool.

It imports no wire schema, no tracing and no NATS (``tests/unit/test_engine_core.py``
holds it to that): the worker's shell (``engine_worker.service``, ``engine_thread``,
``wire``) drives it. Read it in this order:

- ``engine.py``: :class:`Engine`. ``step()`` is schedule, run, sample, postprocess.
- ``spec.py``: :class:`EngineSpec`, what a built engine is, and where a request is
  checked (``EngineSpec.request``) into an :class:`EngineRequest` (``request.py``).
- ``params.py``: :class:`SamplingParams` and :class:`FinishReason`.
- ``outputs.py``: what a step returns (:class:`StepResult`) and the engine's load.
- ``batch_scheduler.py`` and ``block_manager.py``: who runs next, and the KV blocks
  and prefix cache they hold (``kv_events.py``: what the cache gained and lost).
- ``runner.py``, ``model.py``, ``cuda_graphs.py``: one forward pass over a batch.
- ``sampler.py`` and ``grammar.py``: picking tokens, and structured output masks.
- ``config.py``, ``model_config.py``, ``loader.py``, ``parallel.py``: the engine's
  settings, the checkpoint's, its tensors, and tensor-parallel sharding.
"""

from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.outputs import (
    EngineStats,
    RequestOutput,
    StepResult,
    Timings,
)
from lamina.services.engine_worker.engine.params import FinishReason, SamplingParams
from lamina.services.engine_worker.engine.request import EngineRequest
from lamina.services.engine_worker.engine.spec import EngineSpec

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineSpec",
    "EngineStats",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
    "Timings",
]
