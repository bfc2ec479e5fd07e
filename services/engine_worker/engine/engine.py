"""The engine: a synchronous, single-threaded loop of ``step()`` calls.

``Engine.step`` is the whole algorithm: schedule a batch, run the model once over it,
sample, then advance each request and report what it produced. No asyncio, no I/O, no
wire types: the worker's shell drives it from a thread of its own, hands it requests
through :meth:`EngineSpec.request` (the one check) and :meth:`Engine.add`, and turns each
:class:`StepResult` into events.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lamina.kernels.transfer import upload
from lamina.libs.block_hash import ROOT_HASH, root_hash
from lamina.services.engine_worker.engine.auto_dtype import resolve_dtype
from lamina.services.engine_worker.engine.batch_scheduler import BatchScheduler, ScheduledBatch
from lamina.services.engine_worker.engine.block_manager import BlockManager
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.draft_model import DraftModel, load_draft
from lamina.services.engine_worker.engine.errors import (
    DuplicateRequestError,
    KvLayoutMismatch,
)
from lamina.services.engine_worker.engine.grammar import BatchMasks, GrammarState
from lamina.services.engine_worker.engine.kv_events import KvEvent
from lamina.services.engine_worker.engine.kv_shards import Sharding, block_layout
from lamina.services.engine_worker.engine.kv_tier import (
    DEVICE,
    DISK,
    HOST,
    KvBlocks,
    TierIndex,
)
from lamina.services.engine_worker.engine.lora import (
    LoraAdapter,
    LoraDisabledError,
    LoraExistsError,
    LoraInUseError,
    UnknownLoraError,
)
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.outputs import (
    STEP_TOKEN_BUCKETS,
    EngineStats,
    RequestOutput,
    StepResult,
    Timings,
)
from lamina.services.engine_worker.engine.parallel import SINGLE, WHOLE
from lamina.services.engine_worker.engine.params import FinishReason, SamplingParams
from lamina.services.engine_worker.engine.rank_group import RankGroup, rank_device
from lamina.services.engine_worker.engine.remote_ranks import Rendezvous
from lamina.services.engine_worker.engine.request import EngineRequest, Request
from lamina.services.engine_worker.engine.runner import NO_ADAPTERS, ModelRunner, StepInput
from lamina.services.engine_worker.engine.sampler import SampledLogprob, Sampler, SamplerOutput
from lamina.services.engine_worker.engine.shard import load_shard
from lamina.services.engine_worker.engine.spec import EngineSpec, RankInfo
from lamina.services.engine_worker.engine.speculative import (
    SpeculationGate,
    may_speculate,
    propose,
)

log = logging.getLogger("lamina.worker.engine")

_RATE_SMOOTHING = 0.2  # weight of the newest step in the measured token rates
# A step computing fewer prompt tokens than this measures its fixed cost, not a prefill
# rate: a worker serving cache hits computes two-token tails, and at "two tokens a step"
# the scheduler would think it a hundred times slower than its peers and never give it
# the long prompt that would measure it. Until it computes one it borrows their rate.
# (An engine whose step budget is smaller measures its full chunks.)
_RATE_MIN_PREFILL_TOKENS = 64


class Engine:
    """Paged-KV, continuously batching engine for one model on one device."""

    def __init__(
        self,
        config: EngineConfig,
        collective_timeout_s: float = 60.0,
        publish_rendezvous: Callable[[Rendezvous], None] | None = None,
    ) -> None:
        """Load ``config.model`` and size the KV pool. With several ranks (tensor or
        pipeline parallel), start the others first (``rank_group.py``); a collective that
        waits longer than ``collective_timeout_s`` fails the group. With pipeline stages
        on other hosts, ``publish_rendezvous`` is given what their ranks need to join
        (``remote_ranks.py``), from this thread, before it waits for them."""
        if config.model is None:
            raise ValueError(
                "EngineConfig.model is None: name a checkpoint directory "
                "(the worker resolves None to Lamina's default model before building)"
            )
        # Before any other rank starts: each then runs the dtype this one chose.
        config = resolve_dtype(config, ModelConfig.from_dir(config.model))
        self.config = config
        self.device = rank_device(config.device, 0)
        self.ranks: RankGroup | None = None
        """The other ranks (None: this process is the whole model)."""
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.ranks = RankGroup(config, collective_timeout_s, publish_rendezvous)
        try:
            tp, pp = (self.ranks.tp, self.ranks.pp) if self.ranks else (SINGLE, WHOLE)
            self.place = (tp, pp)
            """This process's place among the ranks: rank 0 of the first stage."""
            shard = load_shard(config, tp, pp, self.device)
            spec = config.speculative_config
            draft = None  # a draft model's weights, loaded before the pools are sized
            if spec is not None and spec.method == "draft_model":
                draft = load_draft(config, shard)
            beside = draft.block_bytes if draft is not None else 0
            num_blocks, tier_slots = shard.blocks_in_budget(beside), shard.tier_slots()
            if self.ranks is not None:
                num_blocks = self.ranks.agree_blocks(num_blocks, tier_slots)
            max_model_len, bs = shard.max_model_len, config.block_size
            if num_blocks * bs < max_model_len:
                raise ValueError(
                    f"the KV pool holds {num_blocks} blocks of {bs} tokens, fewer than one "
                    f"max_model_len ({max_model_len}) sequence needs; raise "
                    "kv_cache_memory_bytes or lower max_model_len"
                )
            self.runner = shard.runner(num_blocks, tier_slots)
            self.drafter = None if draft is None else DraftModel(draft, num_blocks, tier_slots)
            """Speculative decoding's draft model (the ``draft_model`` method), if any."""
        except BaseException:
            self.close()
            raise
        self.model_config = mc = shard.model_config
        self.sharding = Sharding(
            mc.num_layers,
            mc.num_kv_heads,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        )
        """How each block's KV splits across the ranks (whole, without ranks)."""
        model = shard.model
        # Decode graphs pad their batches into a block of their own: the pool's last.
        self.blocks = BlockManager(
            num_blocks - 1 if shard.graphs else num_blocks,
            bs,
            config.enable_prefix_caching,
            [TierIndex(slots, number) for number, slots in sorted(tier_slots.items())],
        )
        self.scheduler = BatchScheduler(
            self.blocks,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_chunked_prefill,
            config.max_loras if config.enable_lora else 0,
        )
        self.adapters: dict[str, LoraAdapter] | None = None
        """The LoRA adapters this engine holds (on the host), by name; None: LoRA off."""
        if config.enable_lora:
            self.adapters = {}
            self.runner.lora_slots = shard.lora_slots()
            for module in config.lora_modules:
                self.load_adapter(module.name, module.path)
        self.sampler = Sampler(mc.eos_token_ids, config.seed, self.device)
        rank0 = RankInfo(
            0,
            socket.gethostname(),
            str(self.device),
            os.getpid(),
            shard.weight_bytes + (draft.weight_bytes if draft is not None else 0),
            num_blocks * (shard.block_bytes + beside),
        )
        self.spec = EngineSpec(
            config=config,
            max_model_len=max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=mc.eos_token_ids,
            num_kv_blocks=self.blocks.num_blocks,
            dtype=str(model.dtype).removeprefix("torch."),
            weight_dtype=model.weight_dtype,
            ranks=(rank0, *(self.ranks.ranks if self.ranks else ())),
            kv_layout=block_layout(
                bs, self.runner.kv_caches[0].dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim
            ),
        )
        """What this engine is, for any thread to read (and where requests are checked)."""
        self.requests: dict[str, Request] = {}
        self._in_flight: collections.deque[_Flight] = collections.deque()
        """Batches launched and not yet sampled: at most one per pipeline stage."""
        self._arrivals = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._iteration_tokens = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        self._prefill_rate = 0.0
        self._prefill_rate_min_tokens = min(_RATE_MIN_PREFILL_TOKENS, config.max_num_batched_tokens)
        self._decode_rate = 0.0
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted_tokens = 0
        self._accepted_per_position = [0] * (
            config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        )
        speculative = config.speculative_config
        self.gate = SpeculationGate() if speculative and speculative.adaptive else None
        """Whether drafting pays at the step's batch (``"adaptive": true``), if asked."""
        self._spec_active = speculative is not None
        """Whether the last step's decoding requests could draft."""

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    # ----------------------------------------------------------------------------- intake
    def add(self, request: EngineRequest) -> None:
        """Queue a request checked by :meth:`EngineSpec.request` (of this engine's spec);
        raises :class:`DuplicateRequestError` if its id is already here."""
        rid = request.request_id
        if rid in self.requests:
            raise DuplicateRequestError(rid)
        if request.lora is not None and request.lora not in (self.adapters or {}):
            raise UnknownLoraError(request.lora)
        params, replayed = request.params, request.replayed
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = Request(
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            max_tokens=request.max_tokens,
            priority=request.priority,
            deadline_ms=request.deadline_ms,
            arrival=next(self._arrivals),
            queued_at=time.monotonic(),
            generator=generator,
            num_replayed=replayed,
            pending_draws=replayed if generator is not None else 0,
            grammar=request.grammar,
            lora=request.lora,
            root_hash=root_hash(request.lora),
            # A moved request sent its prompt's logprobs before it moved.
            prompt_logprobs={} if params.prompt_logprobs is not None and not replayed else None,
        )
        state.update_block_hashes(self.config.block_size)
        self.requests[rid] = state
        self.scheduler.add(state)
        self._prompt_tokens += len(request.prompt_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline_ms: int | None = None,
        replayed: int = 0,
        grammar: GrammarState | None = None,
        lora: str | None = None,
    ) -> None:
        """Check a request (:meth:`EngineSpec.request`, whose arguments these are) and
        queue it: the door for Python callers, such as benchmarks and ``lamina generate``."""
        self.add(
            self.spec.request(
                request_id,
                prompt_token_ids,
                params,
                priority=priority,
                deadline_ms=deadline_ms,
                replayed=replayed,
                grammar=grammar,
                lora=lora,
            )
        )

    def load_adapter(self, name: str, path: Path) -> LoraAdapter:
        """Read the PEFT adapter in ``path`` and serve it as ``name``
        (:meth:`add_adapter`); raises :class:`LoraAdapterError` if it cannot be."""
        if self.adapters is None:
            raise LoraDisabledError()
        adapter = LoraAdapter.load(name, path, self.model_config, self.config.max_lora_rank)
        self.add_adapter(adapter)
        return adapter

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (read by :meth:`LoraAdapter.load` for this engine's model);
        raises :class:`LoraExistsError` if one of its name is served."""
        if self.adapters is None:
            raise LoraDisabledError()
        if adapter.name in self.adapters:
            raise LoraExistsError(adapter.name)
        self.adapters[adapter.name] = adapter

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; raises :class:`UnknownLoraError` if it is not
        served, :class:`LoraInUseError` while a request here uses it."""
        if self.adapters is None:
            raise LoraDisabledError()
        if name not in self.adapters:
            raise UnknownLoraError(name)
        if any(r.lora == name for r in self.requests.values()):
            raise LoraInUseError(name)
        del self.adapters[name]
        assert self.runner.lora_slots is not None
        self.runner.lora_slots.evict(name)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once; False if it is not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        return True

    def has_work(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_work()

    # ------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> StepResult:
        """Schedule a batch, run it, and advance each request by its sampled token.

        Across ``P`` pipeline stages, up to ``P`` batches are in flight, each of at most a
        ``P``-th of the requests (vLLM's virtual engines, by count rather than by a fixed
        assignment): a step launches the next batch (of requests not in flight) through
        the first stage, while the later stages run the earlier ones, and then completes
        the oldest in flight once the pipeline is full, or once there is nothing left to
        launch. Its result is that completed batch's."""
        started = time.perf_counter()  # (a step's time includes making its drafts)
        stages = self.config.pipeline_parallel_size
        busy = frozenset(r.request_id for f in self._in_flight for r in f.batch.requests)
        most = None
        if stages > 1:  # a share of the requests per stage's batch, so that stages overlap
            active = len(self.scheduler.running) + len(self.scheduler.waiting)
            most = -(-active // stages)
        if self.config.speculative_config is not None:
            self._propose(busy)
        batch = self.scheduler.schedule(busy, most)
        if self.drafter is not None and batch.requests:
            self.drafter.propose(batch)
        if batch.requests:
            self._in_flight.append(self._launch(batch, started))
        if not self._in_flight:
            return StepResult(batch, [], self.blocks.usage)
        if batch.requests and len(self._in_flight) < stages:
            return StepResult(ScheduledBatch(), [], self.blocks.usage)  # the pipeline fills
        return self._complete(self._in_flight.popleft())

    def _propose(self, busy: frozenset[str]) -> None:
        """Give each decoding request that may speculate a draft for this step (none in
        a batch of ``disable_by_batch_size`` or more, or where the gate finds drafting
        does not pay), and clear the drafts of the rest (one a request was given for a
        step that did not schedule it is stale); a ``busy`` request's batch is in flight
        (pipeline stages), and its draft stays until that batch completes."""
        config = self.config.speculative_config
        assert config is not None
        running = self.scheduler.running
        off = config.disable_by_batch_size is not None and (
            len(running) >= config.disable_by_batch_size
        )
        active = not off
        if self.gate is not None and not off:
            decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in running)
            off = not self.gate.pays(decoding)  # (off, it drafts a step now and then)
            active = self.gate.on
            if active != self._spec_active:  # (its margins keep this rare)
                state = "on: drafts pay" if active else "off: drafts do not pay"
                log.info("speculative decoding %s at %d running requests", state, len(running))
        self._spec_active = active
        for request in running:
            if request.request_id in busy:
                continue
            request.draft.clear()
            if off or request.num_tokens - request.num_computed_tokens != 1:
                continue  # (prefilling: a draft follows the prompt's last token only)
            if not may_speculate(request):
                continue
            # Room for the draft and the token after it, in the output and the context.
            most = min(
                config.num_speculative_tokens,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if self.drafter is not None:  # room made now, the draft filled once scheduled
                request.draft = [0] * max(most, 0)
            else:
                request.draft = propose(request.token_ids, config, most)
                if request.grammar is not None:  # what it refuses would only be rejected
                    del request.draft[request.grammar.allowed_prefix(request.draft) :]

    def _launch(self, batch: ScheduledBatch, started: float) -> _Flight:
        """Start ``batch`` (its step began at ``started``): its masks, the model's first
        stage (or all of it), and its tokens counted as computed (its KV is written, stage
        by stage, in launch order)."""
        masks, draft_masks = self._start_masks(batch)  # filled while the model runs
        positions = self._prompt_positions(batch)
        wait = self._start(batch, [row for row, _, _ in positions])
        sampling = self.scheduler.advance(batch)
        return _Flight(batch, masks, draft_masks, positions, sampling, wait, started)

    def _complete(self, flight: _Flight) -> StepResult:
        """Sample the requests of ``flight`` that reached their last token and advance
        each by it; a request aborted while its batch was in flight is left out."""
        logits = flight.wait()
        positions = flight.positions
        if positions:
            sampled = logits.shape[0] - len(positions)
            self._record_prompt_logprobs(logits[sampled:], positions)
            logits = logits[:sampled]
        sampling = flight.sampling
        verified = {}
        if any(r.draft for r in sampling):  # the rest sample from their one row each
            drafted_rows, single_rows = _rows(sampling)
            drafted = [r for r in sampling if r.draft]
            verified = self._verify(logits[drafted_rows], drafted, flight.draft_masks)
            sampling = [r for r in sampling if not r.draft]
            logits = logits[single_rows]
        sampled, errors = self._sample(logits, sampling, flight.masks)
        singles = zip(sampled.token_ids, sampled.logprobs, strict=True)
        now = time.monotonic()
        outputs = []
        for request in flight.sampling:
            rid = request.request_id
            if request.draft:
                tokens, logprobs = verified[rid]
            else:
                token, logprob = next(singles)
                tokens, logprobs = [token], None if logprob is None else [logprob]
            # (not one aborted while its batch was in flight: sampled with the rest, as
            # its grammar mask is, and dropped)
            if self.requests.get(rid) is request:
                outputs.append(self._postprocess(request, tokens, logprobs, errors.get(rid), now))
                if request.draft:
                    self._settle_draft(request)
        self._account(flight.batch, outputs, time.perf_counter() - flight.started)
        if verified:
            for request in flight.sampling:
                request.draft.clear()
        return StepResult(flight.batch, outputs, self.blocks.usage)

    def _verify(
        self, logits: torch.Tensor, drafted: list[Request], masks: BatchMasks | None
    ) -> dict[str, tuple[list[int], list[SampledLogprob] | None]]:
        """The ``drafted`` requests' tokens (``Sampler.verify``), by request id, from
        ``logits`` (``1 + len(draft)`` rows each, in order) and their grammars' ``masks``;
        counts what was proposed and accepted."""
        try:
            verified = self.sampler.verify(logits, drafted, masks)
        finally:
            if masks is not None:
                masks.wait()  # before any matcher moves
        proposed = accepted_now = 0
        for request, (tokens, _) in zip(drafted, verified, strict=True):
            accepted = len(tokens) - 1  # the last is the target's own
            proposed += len(request.draft)
            accepted_now += accepted
            for position in range(accepted):
                self._accepted_per_position[position] += 1
        self._drafts += len(drafted)
        self._draft_tokens += proposed
        self._accepted_tokens += accepted_now
        if self.gate is not None:
            self.gate.observe_drafts(len(drafted), proposed, accepted_now)
        return {r.request_id: result for r, result in zip(drafted, verified, strict=True)}

    def _settle_draft(self, request: Request) -> None:
        """After verification: the KV of ``request``'s rejected draft positions is not
        its tokens', so it counts as not computed and its blocks past them go back
        (a finished request has released all of its own)."""
        if self.requests.get(request.request_id) is not request:
            return
        # Computed: every token but the newest (the target's own, computed next step).
        request.num_computed_tokens = request.num_tokens - 1
        self.blocks.trim(request, request.num_tokens)

    def forward(self, batch: ScheduledBatch, extra: list[int] | None = None) -> torch.Tensor:
        """The model over ``batch``, on every rank: logits ``(S, vocab)`` for each request
        that finishes its tokens this step (in batch order), then a row for each of the
        ``extra`` positions of the flat batch (a prompt's logprobs)."""
        return self._start(batch, extra)()

    def _start(self, batch: ScheduledBatch, extra: list[int] | None) -> Callable[[], torch.Tensor]:
        """Run this process's share of ``batch`` (with pipeline stages, the first);
        what it returns waits for the logits (:meth:`forward`'s)."""
        step = StepInput.of(
            batch, self.config.block_size, extra, self.blocks.take_moves(), self._lora_slots(batch)
        )
        if self.ranks is not None:
            wait = self.ranks.launch(step, self.runner)
        else:
            wait = _ready(self.runner.run(step))
        if self.drafter is None:
            return wait
        if self.gate is None or self._spec_active or any(r.draft for r in batch.requests):
            self.drafter.mirror(step)  # (beside the other ranks' share of the step)
        else:  # drafts are off: the draft model keeps up only when drafting resumes
            self.drafter.transfer(step.moves)
            for request in batch.requests:
                if request.draft_stale_from is None:
                    request.draft_stale_from = request.num_computed_tokens
        return wait

    def _lora_slots(self, batch: ScheduledBatch) -> np.ndarray:
        """Each request's LoRA slot in ``batch`` (-1: the base model; empty: no request
        has an adapter), their adapters put in slots."""
        if self.adapters is None:  # LoRA off: no request has one
            return NO_ADAPTERS
        names = {r.lora for r in batch.requests if r.lora is not None}
        if not names:
            return NO_ADAPTERS
        assert self.adapters is not None and self.runner.lora_slots is not None
        slots = self.runner.lora_slots.slots_for(names, self._write_adapter)
        return np.array([slots.get(r.lora, -1) for r in batch.requests], dtype=np.int64)

    def _write_adapter(self, slot: int, name: str) -> None:
        """Put adapter ``name`` in LoRA slot ``slot`` on every rank, each its share."""
        adapter = self.adapters[name]  # type: ignore[index]
        self.runner.lora_slots.write(slot, adapter.share(self.model_config, *self.place))  # type: ignore[union-attr]
        if self.ranks is not None:
            self.ranks.write_lora(slot, adapter, self.model_config)

    def _postprocess(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list[SampledLogprob] | None,
        error: str | None,
        now: float,
    ) -> RequestOutput:
        """Advance ``request`` by its new ``tokens`` (one sampled, or a verified draft's)
        up to the first that ends it (or fail it with ``error``): its grammar, its
        tokens and block hashes, whether it ended; free it if it did."""
        reason = None
        taken = 0
        for token in tokens if error is None else ():
            if request.grammar is not None and not request.grammar.accept(token):
                error = request.grammar.refusal(token)
                break
            request.token_ids.append(token)
            taken += 1
            if reason := self._finish_reason(request, token):
                break
        if taken and error is None:
            request.update_block_hashes(self.config.block_size)
            request.first_token_at = request.first_token_at or now
            request.last_token_at = now
        if error is not None or reason is not None:
            self.requests.pop(request.request_id)
            self.scheduler.remove(request)
        prompt_logprobs = None
        if error is None and request.prompt_logprobs is not None:
            prompt_logprobs = [
                request.prompt_logprobs[p] for p in range(1, request.num_prompt_tokens)
            ]
            request.prompt_logprobs = None  # sent: a recompute may read the cache again
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[] if error else tokens[:taken],
            new_logprobs=None if logprobs is None or error else logprobs[:taken],
            finished=error is not None or reason is not None,
            finish_reason=None if error else reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=error,
            timings=None if reason is None else _timings(request),
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _prompt_positions(batch: ScheduledBatch) -> list[tuple[int, Request, int]]:
        """``(row of the flat batch, request, prompt position)`` for each prompt token
        (from the second) whose logprob this step computes: the logits of each position
        of such a request's chunk score the next token."""
        positions: list[tuple[int, Request, int]] = []
        if all(request.prompt_logprobs is None for request in batch.requests):
            return positions  # the usual step: one pass, nothing built
        offset = 0
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if request.prompt_logprobs is not None:
                start = request.num_computed_tokens
                for p in range(start, min(start + n, request.num_prompt_tokens - 1)):
                    positions.append((offset + p - start, request, p + 1))
            offset += n
        return positions

    def _record_prompt_logprobs(
        self, logits: torch.Tensor, positions: list[tuple[int, Request, int]]
    ) -> None:
        """Each position's prompt token: its logprob, rank and top alternatives, for the
        whole batch in a few tensor operations."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = [request.token_ids[p] for _, request, p in positions]
        index = upload(targets, torch.int64, logits.device)[:, None]
        chosen = logprobs.gather(1, index)
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_n = max(request.params.prompt_logprobs or 0 for _, request, _ in positions)
        values, ids = logprobs.topk(top_n) if top_n else (logprobs[:, :0], logprobs[:, :0])
        for (_, request, p), logprob, rank, top_ids, top_values in zip(
            positions, chosen.squeeze(1).tolist(), ranks, ids.tolist(), values.tolist(), strict=True
        ):
            n = request.params.prompt_logprobs or 0
            request.prompt_logprobs[p] = (
                logprob,
                rank,
                list(zip(top_ids[:n], top_values[:n], strict=True)),
            )  # type: ignore[index]

    def _start_masks(self, batch: ScheduledBatch) -> tuple[BatchMasks | None, BatchMasks | None]:
        """The grammar masks of the requests that will sample this step (those whose
        chunk ends their tokens, and their drafts, in batch order), started now: of those
        that sample one token, and of the verification rows of those with a draft; None
        where none is constrained."""
        if all(request.grammar is None for request in batch.requests):
            return None, None  # the usual step: one pass, nothing built
        sampling = [
            request
            for request, n in zip(batch.requests, batch.num_new_tokens, strict=True)
            if request.num_computed_tokens + n == request.num_step_tokens
        ]
        vocab = self.model_config.vocab_size
        singles = [r for r in sampling if not r.draft]
        drafted = [r for r in sampling if r.draft]
        masks = draft_masks = None
        if any(r.grammar is not None for r in singles):
            masks = BatchMasks([r.grammar for r in singles], vocab)
        if any(r.grammar is not None for r in drafted):
            states, drafts = [r.grammar for r in drafted], [r.draft for r in drafted]
            draft_masks = BatchMasks(states, vocab, drafts)
        return masks, draft_masks

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], masks: BatchMasks | None = None
    ) -> tuple[SamplerOutput, dict[str, str]]:
        """Sample the batch; ``(output, {request id: error})``.

        What breaks the sampler comes from one request's parameters, so it is that
        request's failure, not its batch mates': if the batch raises, each request is
        sampled alone (the sampler leaves ``logits`` as it was) and the ones that still
        raise fail. Their rows in the output are placeholders.
        """
        try:
            return self.sampler(logits, requests, masks), {}
        except Exception:
            log.exception("sampling a batch of %d failed; sampling each alone", len(requests))
        finally:
            if masks is not None:
                masks.wait()  # before any matcher moves
        token_ids: list[int] = []
        logprobs: list[SampledLogprob | None] = []
        errors: dict[str, str] = {}
        for row, request in enumerate(requests):
            try:
                alone = self.sampler(logits[row : row + 1], [request])
            except Exception as exc:
                log.exception("sampling request %s failed", request.request_id)
                errors[request.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                token_ids.append(-1)
                logprobs.append(None)
            else:
                token_ids += alone.token_ids
                logprobs += alone.logprobs
        return SamplerOutput(token_ids, logprobs), errors

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if request.grammar is not None and request.grammar.finished:
            return FinishReason.STOP  # the constrained output is complete (even ignore_eos)
        if request.num_output_tokens >= params.min_tokens and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.model_config.eos_token_ids)
        ):
            return FinishReason.STOP
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _account(self, batch: ScheduledBatch, outputs: list[RequestOutput], seconds: float) -> None:
        """Count the step's tokens; smooth the prefill and decode token rates (a mixed
        step credits both; a drafted request's tokens are decode tokens)."""
        self._generation_tokens += sum(len(out.new_token_ids) for out in outputs)
        num_new = sum(batch.num_new_tokens)
        num_decodes = batch.num_decodes + sum(len(r.draft) + 1 for r in batch.requests if r.draft)
        self._iteration_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_new)] += 1
        self._iteration_tokens_sum += num_new
        prefill = num_new - num_decodes
        seconds = max(seconds, 1e-9)
        a = _RATE_SMOOTHING
        # Each rate starts at its first sample, not at zero (an average from zero would
        # report a fresh engine several times slower than it is for its first steps).
        if prefill >= self._prefill_rate_min_tokens:
            rate = prefill / seconds
            self._prefill_rate = (
                (1 - a) * self._prefill_rate + a * rate if self._prefill_rate else rate
            )
        if num_decodes:
            rate = num_decodes / seconds
            self._decode_rate = (
                (1 - a) * self._decode_rate + a * rate if self._decode_rate else rate
            )
        if self.gate is not None and num_decodes == num_new:  # decodes (and drafts) only
            self.gate.observe_step(num_new, seconds)

    # ------------------------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        blocks, runner = self.blocks, self.runner
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            total_kv_blocks=blocks.num_blocks,
            free_kv_blocks=blocks.num_free_blocks,
            kv_cache_usage=blocks.usage,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            num_queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens(),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens,
            prompt_tokens_cached=self.scheduler.prompt_tokens_cached,
            iteration_tokens=tuple(self._iteration_tokens),
            iteration_tokens_sum=self._iteration_tokens_sum,
            generation_tokens_total=self._generation_tokens,
            prefill_tokens_per_s=self._prefill_rate,
            decode_tokens_per_s=self._decode_rate,
            spec_decode_active=self._spec_active,
            spec_decode_num_drafts=self._drafts,
            spec_decode_num_draft_tokens=self._draft_tokens,
            spec_decode_num_accepted_tokens=self._accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self._accepted_per_position),
            **self._lora_stats(),
            **_tier_stats(blocks.tier(HOST), runner, "host"),
            **_tier_stats(blocks.tier(DISK), runner, "disk"),
        )

    def _lora_stats(self) -> dict[str, tuple[str, ...]]:
        """The adapters held, and those of the running and the waiting requests."""
        if self.adapters is None:
            return {}
        scheduler = self.scheduler
        running = {r.lora for r in scheduler.running if r.lora is not None}
        waiting = {entry[1].lora for entry in scheduler.waiting if entry[1].lora is not None}
        return {
            "lora_adapters": tuple(self.adapters),
            "running_lora_adapters": tuple(sorted(running)),
            "waiting_lora_adapters": tuple(sorted(waiting)),
        }

    def take_kv_events(self) -> list[KvEvent]:
        """Prefix cache events since the last call, numbered without gaps."""
        return self.blocks.take_events()

    # -------------------------------------------------------------------- KV that moves
    def export_blocks(self, hashes: list[int]) -> KvBlocks:
        """The leading run of ``hashes`` (a sequence's block hashes, from its start) that
        this engine holds, on its device or in a lower tier, copied to the host, whole
        (every rank's share of them): for another engine to :meth:`import_blocks`. Moves
        between the tiers that a step was to make are made first, on every rank, so each
        block holds what its hash says."""
        blocks = self.blocks
        where: list[tuple[int, int]] = []  # (its tier, its block id or slot there)
        for block_hash in hashes:
            block_id = blocks.cached.get(block_hash)
            tier = blocks.holder(block_hash) if block_id is None else None
            if block_id is not None:
                where.append((DEVICE, block_id))
            elif tier is not None:
                where.append((tier.number, tier.slot(block_hash)))  # type: ignore[arg-type]
            else:
                break
        at = np.asarray(where, dtype=np.int64).reshape(-1, 2).T.copy()
        moves = blocks.take_moves()
        self._transfer(moves)
        shares = [self.runner.read_blocks(at)]
        if self.ranks is not None:
            shares += self.ranks.export_shares(moves, at)
        caches, scales = self.sharding.assemble(shares)
        return KvBlocks(self.spec.kv_layout, ROOT_HASH, hashes[: len(where)], caches, scales)

    def import_blocks(self, blocks: KvBlocks) -> int:
        """Cache ``blocks`` (another engine's :meth:`export_blocks`, whole) as if computed
        here, each rank its share, so that a request with their prefix hits them; the
        number newly cached (fewer when free blocks run out, none of those already
        cached). Refused whole, typed, when their layout is not this engine's
        (:class:`KvLayoutMismatch`)."""
        ours = self.spec.kv_layout
        if blocks.layout != ours:
            raise KvLayoutMismatch(ours, blocks.layout)
        placed = self.blocks.adopt(blocks.parent_hash, blocks.hashes)
        moves = self.blocks.take_moves()  # blocks it evicted are saved before overwritten
        targets = np.asarray([b for _, b in placed], dtype=np.int64)
        source = torch.tensor([i for i, _ in placed], dtype=torch.int64)
        whole = (
            [c[:, source] for c in blocks.caches],
            [None if s is None else s[:, source] for s in blocks.scales],
        )
        shares = self.sharding.split(whole)
        self._transfer(moves)
        self.runner.write_blocks(targets, shares[0])
        if self.ranks is not None:
            self.ranks.import_shares(moves, targets, shares[1:])
        return len(placed)

    def _transfer(self, moves: np.ndarray) -> None:
        """Moves between the tiers made outside a step, on this rank (and the draft's)."""
        self.runner.transfer(moves)
        if self.drafter is not None:
            self.drafter.transfer(moves)

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def check(self) -> None:
        """Raise :class:`RankGroupFailure` if this engine can no longer step: one of its
        other ranks has exited (a step would find out too; an idle engine runs none)."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the other ranks, if any (idempotent)."""
        if self.ranks is not None:
            self.ranks.close()


@dataclass(slots=True)
class _Flight:
    """A launched batch, until its logits are sampled."""

    batch: ScheduledBatch
    masks: BatchMasks | None
    """The grammar masks of its requests that sample one token."""
    draft_masks: BatchMasks | None
    """The grammar masks of its drafted requests' verification rows."""
    positions: list[tuple[int, Request, int]]
    sampling: list[Request]
    """Its requests that reached their last token: they sample."""
    wait: Callable[[], torch.Tensor]
    """The logits, once the last stage has them."""
    started: float


def _ready(logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    """What waits for logits that are here already."""
    return lambda: logits


def _rows(sampling: list[Request]) -> tuple[list[int], list[int]]:
    """The rows of ``sampling``'s logits (``1 + len(draft)`` per request, in order) of
    the requests with a draft, and of those without."""
    drafted: list[int] = []
    single: list[int] = []
    row = 0
    for request in sampling:
        width = len(request.draft) + 1
        if request.draft:
            drafted.extend(range(row, row + width))
        else:
            single.append(row)
        row += width
    return drafted, single


def _timings(request: Request) -> Timings:
    """A finished request's phases (vLLM's: from its first step, not its latest)."""
    return Timings(
        queued_s=max(0.0, request.scheduled_at - request.queued_at),
        prefill_s=max(0.0, request.first_token_at - request.scheduled_at),
        decode_s=max(0.0, request.last_token_at - request.first_token_at),
        num_preemptions=request.num_preemptions,
    )


def _tier_stats(tier: TierIndex | None, runner: ModelRunner, medium: str) -> dict[str, Any]:
    """A lower tier's :class:`EngineStats` fields, named for its ``medium`` (none where
    the engine has no such tier: their defaults say so)."""
    if tier is None:
        return {}
    figures = {
        "blocks": tier.capacity,
        "blocks_used": len(tier),
        "loads_total": tier.loads,
        "saves_total": tier.saves,
        "load_blocks_per_s": runner.load_rate(tier.number),
    }
    return {f"{medium}_kv_{name}": value for name, value in figures.items()}
