"""The one place the worker translates between the wire and the engine core.

In: a ``GenerateRequest`` becomes an ``EngineRequest``, converted and checked once
(:func:`engine_request`). Out: the core's outputs, timings and KV events become the wire's
messages. The core imports no schema; every other shell module speaks the wire.
"""

from __future__ import annotations

import dataclasses

import msgspec

from lamina.libs.grammar import GrammarError, check
from lamina.schemas.v1.generate import (
    EngineTimings,
    GenerateRequest,
    Sampling,
    StructuredOutput,
    TokenLogprob,
)
from lamina.schemas.v1.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium
from lamina.schemas.v1.ranks import RankRendezvous
from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS, Rank
from lamina.services.engine_worker.engine import kv_events
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.grammar import (
    GrammarCompiler,
    GrammarState,
    InvalidGrammarError,
)
from lamina.services.engine_worker.engine.outputs import STEP_TOKEN_BUCKETS, Timings
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.remote_ranks import Rendezvous
from lamina.services.engine_worker.engine.request import EngineRequest
from lamina.services.engine_worker.engine.sampler import SampledLogprob
from lamina.services.engine_worker.engine.spec import EngineSpec, RankInfo

# ``WorkerStats.iteration_tokens`` carries the engine's histogram as it is.
assert STEP_TOKEN_BUCKETS == ITERATION_TOKEN_BUCKETS

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(sampling: Sampling) -> SamplingParams:
    """The wire's sampling knobs as the engine's (the same names; ``structured`` goes
    to the engine compiled, see :func:`compile_constraint`)."""
    return SamplingParams(**{name: getattr(sampling, name) for name in _SAMPLING_FIELDS})


def engine_request(
    request: GenerateRequest,
    spec: EngineSpec,
    grammar: GrammarState | None = None,
    lora: str | None = None,
) -> EngineRequest:
    """``request`` checked against the engine ``spec`` describes (``grammar``: its
    constraint's fresh state, :func:`constraint`; ``lora``: the adapter its ``model``
    names); raises the engine's ``InvalidRequestError``. Reads only immutable values:
    any thread may call it."""
    return spec.request(
        request.request_id,
        request.prompt_token_ids,
        sampling_params(request.sampling),
        priority=request.sla.priority,
        deadline_ms=request.sla.deadline_ms,
        replayed=request.replayed_output_tokens,
        grammar=grammar,
        lora=lora,
    )


def constraint(compiler: GrammarCompiler, structured: StructuredOutput) -> GrammarState:
    """A request's structured output constraint, compiled for the engine's vocabulary, at
    its start (slow for a new grammar: call it off the event loop)."""
    try:
        grammar = check(structured)
    except GrammarError as exc:
        raise InvalidGrammarError(str(exc)) from exc
    return compiler.state(compiler.compile(grammar))


def timings(timings: Timings) -> EngineTimings:
    return EngineTimings(
        queued_s=timings.queued_s,
        prefill_s=timings.prefill_s,
        decode_s=timings.decode_s,
        num_preemptions=timings.num_preemptions,
    )


def token_logprobs(logprobs: list[SampledLogprob] | None) -> list[TokenLogprob] | None:
    if logprobs is None:
        return None
    return [TokenLogprob(logprob, top) for logprob, top in logprobs]


def kv_event(event: kv_events.KvEvent) -> KvEvent:
    match event:
        case kv_events.BlockStored(
            event_id=n, parent_hash=parent, block_hashes=hashes, medium=medium
        ):
            return BlockStored(
                event_id=n, parent_hash=parent, block_hashes=hashes, medium=Medium(medium)
            )
        case kv_events.BlockRemoved(event_id=n, block_hashes=hashes, medium=medium):
            return BlockRemoved(event_id=n, block_hashes=hashes, medium=Medium(medium))
        case kv_events.AllBlocksCleared(event_id=n):
            return AllBlocksCleared(event_id=n)
    raise TypeError(f"not a KV event: {event!r}")


def rank(info: RankInfo) -> Rank:
    """One of the engine's ranks as a heartbeat lists it."""
    return Rank(**dataclasses.asdict(info))


def rendezvous(found: Rendezvous, worker_id: str, incarnation: str) -> RankRendezvous:
    """What a stage host is told to join this worker's group."""
    return RankRendezvous(
        worker_id=worker_id,
        incarnation=incarnation,
        ready=True,
        store=found.store,
        host=found.host,
        port=found.port,
        key=found.key.hex(),
        digest=found.digest,
        timeout_s=found.timeout_s,
        engine=msgspec.to_builtins(found.config, enc_hook=str),  # the model's path
    )


def rendezvous_from(message: RankRendezvous) -> Rendezvous:
    """The engine's :class:`Rendezvous` from a ready ``message``; ValueError naming what
    is wrong with one that does not make one (it came over the bus: checked here)."""
    fields = dict(message.engine)
    model = fields.pop("model", None)  # a path: msgspec converts no Path; the config does
    try:
        config = msgspec.convert(fields, EngineConfig)
        config = dataclasses.replace(config, model=model if isinstance(model, str) else None)
        key = bytes.fromhex(message.key)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ValueError(f"a rendezvous that does not decode: {exc}") from exc
    if not (message.store.startswith("tcp://") and message.host and message.port and key):
        raise ValueError("a rendezvous without its store, step channel or key")
    return Rendezvous(
        message.store, message.host, message.port, key, config, message.digest, message.timeout_s
    )
