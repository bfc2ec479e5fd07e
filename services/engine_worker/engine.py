"""The engine: a synchronous, single-threaded loop of ``step()`` calls.

``Engine.step`` is the whole algorithm: schedule a batch, run the model once over it,
sample, then advance each request and report what it produced. No asyncio, no I/O: the
worker service drives it from its own thread.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from lamina.kernels.transfer import upload
from lamina.libs.errors import invalid_field
from lamina.schemas.v1.generate import EngineTimings, FinishReason, Sampling, context_overflow
from lamina.schemas.v1.kv import KvEvent
from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS
from lamina.services.engine_worker.block_manager import BlockManager
from lamina.services.engine_worker.config import EngineConfig
from lamina.services.engine_worker.cuda_graphs import DecodeGraphs
from lamina.services.engine_worker.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    TokenOutOfVocabError,
)
from lamina.services.engine_worker.grammar import (
    BatchMasks,
    GrammarCompiler,
    GrammarState,
    InvalidGrammarError,
)
from lamina.services.engine_worker.loader import CheckpointTensors
from lamina.services.engine_worker.model import CausalLM
from lamina.services.engine_worker.model_config import DTYPES, ModelConfig
from lamina.services.engine_worker.model_runner import ModelRunner, kv_block_bytes
from lamina.services.engine_worker.request import PromptLogprob, Request
from lamina.services.engine_worker.sampler import Logprobs, Sampler, SamplerOutput
from lamina.services.engine_worker.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger("lamina.worker.engine")

_RATE_SMOOTHING = 0.2  # weight of the newest step in the measured token rates


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None
    finished: bool
    finish_reason: FinishReason | None  # set once finished, unless it failed
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    """Why this request failed on its own (its batch mates went on); it is finished."""
    timings: EngineTimings | None = None
    """Set once it finished (not failed): where its time went here."""
    prompt_logprobs: list[PromptLogprob] | None = None
    """With its first token, if asked for: the logprobs of prompt tokens 1, 2, ..."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load and cache state: what placement and admission decide on. The
    names are ``WorkerStats``'s, which carries them as they are; all zero before the
    engine exists."""

    num_running: int = 0
    num_waiting: int = 0
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_queued_prefill_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    prompt_tokens_cached: int = 0
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    @property
    def prefix_cache_hit_ratio(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class Engine:
    """Paged-KV, continuously batching engine for one model on one device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = config.with_model()
        self.model_config = mc = ModelConfig.from_dir(config.model)
        dtype = mc.dtype if config.dtype == "auto" else DTYPES[config.dtype]
        self.device = torch.device(config.device)
        model = CausalLM(
            mc,
            CheckpointTensors(config.model),
            dtype,
            self.device,
            quantization=config.quantization,
        )

        limits = [mc.max_position_embeddings, config.max_model_len, mc.sliding_window]
        self.max_model_len = min(n for n in limits if n)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) and chunked prefill is off"
            )
        bs = config.block_size
        num_blocks = config.num_kv_blocks or config.kv_budget_bytes(self.device) // (
            kv_block_bytes(model, bs, config.kv_cache_dtype)
        )
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks of {bs} tokens, fewer than one "
                f"max_model_len ({self.max_model_len}) sequence needs; raise "
                "kv_cache_memory_bytes or lower max_model_len"
            )
        graphs = config.cuda_graphs
        if graphs is None:
            graphs = (
                self.device.type == "cuda"
                and model.ops.backend == "triton"
                and config.kv_cache_dtype != "int8"
            )
        # Decode graphs pad their batches into a block of their own: the pool's last.
        usable = num_blocks - 1 if graphs else num_blocks
        self.blocks = BlockManager(usable, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_chunked_prefill,
        )
        self.last_batch: ScheduledBatch | None = None
        """What the last ``step`` ran (who tracing wants to know was in it)."""
        self.runner = ModelRunner(model, num_blocks, bs, self.device, config.kv_cache_dtype)
        if graphs:
            self.runner.decode_graphs = DecodeGraphs(
                model,
                self.runner.kv_caches,
                self.runner.kv_scales,
                bs,
                self.max_model_len,
                config.max_num_seqs,
                pad_block=num_blocks - 1,
                capture=self.device.type == "cuda",
            )
        self.sampler = Sampler(mc.eos_token_ids, config.seed, self.device)
        self.grammars = GrammarCompiler(config.model, mc.vocab_size, mc.eos_token_ids)
        """Compiles structured output constraints (thread-safe: the worker calls it off
        the engine thread)."""
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        self._prefill_rate = 0.0
        self._decode_rate = 0.0

    # ----------------------------------------------------------------------------- intake
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Sampling | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        replayed: int = 0,
        grammar: Any = None,
    ) -> None:
        """Queue a request; raises an :class:`InvalidRequestError` subclass if it cannot run.
        Lower ``priority`` runs first; within a priority, the earlier ``deadline_ms`` (Unix
        ms; None: no deadline, last). The last ``replayed`` prompt tokens are output the
        request produced elsewhere before it moved (``GenerateRequest``). ``grammar``:
        ``params.structured`` as :attr:`grammars` compiled it (compiled here if None)."""
        params = params or Sampling()
        if request_id in self.requests:
            raise DuplicateRequestError(request_id)
        max_tokens = self.validate(prompt_token_ids, params, replayed)
        prompt_len = len(prompt_token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            priority=priority,
            deadline_ms=deadline_ms,
            arrival=next(self._arrivals),
            queued_at=time.monotonic(),
            generator=generator,
            num_replayed=replayed,
            pending_draws=replayed if generator is not None else 0,
            grammar=self._grammar_state(params, grammar, prompt_token_ids, replayed),
            # A moved request sent its prompt's logprobs before it moved.
            prompt_logprobs={} if params.prompt_logprobs is not None and not replayed else None,
        )
        request.update_block_hashes(self.config.block_size)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._prompt_tokens += prompt_len

    def validate(self, prompt_token_ids: list[int], params: Sampling, replayed: int = 0) -> int:
        """Check a request against the model; return its resolved ``max_tokens``.

        Reads only immutable configuration, so other threads may call it (the worker
        validates before handing a request to the engine thread).
        """
        if not prompt_token_ids:
            raise EmptyPromptError()
        try:  # a Sampling built in Python, not decoded, has not had its ranges checked
            msgspec.convert(msgspec.to_builtins(params), Sampling)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(invalid_field(exc) or "sampling", str(exc)) from exc
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("prompt_token_ids", prompt_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
        ):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise TokenOutOfVocabError(min(ids) if min(ids) < 0 else max(ids), vocab, name)
        prompt_len = len(prompt_token_ids)
        if not 0 <= replayed < prompt_len:
            raise InvalidRequestError(
                "replayed_output_tokens",
                f"{replayed} replayed output tokens in a prompt of {prompt_len}: "
                "at least one token must be the prompt's own",
            )
        max_tokens = params.max_tokens or max(self.max_model_len - prompt_len, 0)
        if context_overflow(prompt_len, max_tokens, self.max_model_len):
            raise PromptTooLongError(prompt_len, max_tokens, self.max_model_len)
        return max_tokens

    def _grammar_state(
        self, params: Sampling, compiled: Any, prompt: list[int], replayed: int
    ) -> GrammarState | None:
        """The request's matcher, advanced past the output it replays."""
        if params.structured is None:
            return None
        state = self.grammars.state(compiled or self.grammars.compile(params.structured))
        for token in prompt[len(prompt) - replayed :] if replayed else ():
            if not state.accept(token):
                raise InvalidGrammarError(
                    "the output it produced before it moved does not match the constraint"
                )
        return state

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once; False if it is not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that produced a token (or finished)."""
        batch = self.last_batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        started = time.perf_counter()
        masks = self._start_masks(batch)  # filled while the model runs
        positions = self._prompt_positions(batch)
        logits = self.runner.execute(batch, [row for row, _, _ in positions] or None)
        if positions:
            sampled = logits.shape[0] - len(positions)
            self._record_prompt_logprobs(logits[sampled:], positions)
            logits = logits[:sampled]

        finishing_prefill = self.scheduler.advance(batch)
        sampled, errors = self._sample(logits, finishing_prefill, masks)

        outputs = []
        now = time.monotonic()
        for request, token, logprobs in zip(
            finishing_prefill, sampled.token_ids, sampled.logprobs, strict=True
        ):
            error, reason = errors.get(request.request_id), None
            if error is None and request.grammar is not None and not request.grammar.accept(token):
                error = request.grammar.refusal(token)
            if error is None:
                request.token_ids.append(token)
                request.update_block_hashes(self.config.block_size)
                request.first_token_at = request.first_token_at or now
                request.last_token_at = now
                reason = self._finish_reason(request, token)
            if error is not None or reason is not None:
                self.requests.pop(request.request_id)
                self.scheduler.remove(request)
            prompt_logprobs = None
            if error is None and request.prompt_logprobs is not None:
                prompt_logprobs = [
                    request.prompt_logprobs[p] for p in range(1, request.num_prompt_tokens)
                ]
                request.prompt_logprobs = None  # sent: a recompute may read the cache again
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[] if error else [token],
                    new_logprobs=None if logprobs is None or error else [logprobs],
                    finished=error is not None or reason is not None,
                    finish_reason=None if error else reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    error=error,
                    timings=None if reason is None else _timings(request),
                    prompt_logprobs=prompt_logprobs,
                )
            )
        self._generation_tokens += len(outputs)
        tokens = sum(batch.num_new_tokens)
        self._iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self._iteration_tokens_sum += tokens
        self._account(tokens, batch.num_decodes, time.perf_counter() - started)
        return outputs

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

    def _start_masks(self, batch: ScheduledBatch) -> BatchMasks | None:
        """The grammar masks of the requests that will sample this step (those whose
        chunk ends their tokens, in batch order), started now; None if none is
        constrained."""
        if all(request.grammar is None for request in batch.requests):
            return None  # the usual step: one pass, nothing built
        sampling = [
            request
            for request, n in zip(batch.requests, batch.num_new_tokens, strict=True)
            if request.num_computed_tokens + n == request.num_tokens
        ]
        if all(request.grammar is None for request in sampling):
            return None
        return BatchMasks([r.grammar for r in sampling], self.model_config.vocab_size)

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
        logprobs: list[Logprobs | None] = []
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

    def _account(self, num_new: int, num_decodes: int, seconds: float) -> None:
        """Smoothed prefill and decode token rates (a mixed step credits both)."""
        prefill = num_new - num_decodes
        seconds = max(seconds, 1e-9)
        a = _RATE_SMOOTHING
        # Each rate starts at its first sample, not at zero (an average from zero would
        # report a fresh engine several times slower than it is for its first steps).
        if prefill:
            rate = prefill / seconds
            self._prefill_rate = (
                (1 - a) * self._prefill_rate + a * rate if self._prefill_rate else rate
            )
        if num_decodes:
            rate = num_decodes / seconds
            self._decode_rate = (
                (1 - a) * self._decode_rate + a * rate if self._decode_rate else rate
            )

    # ------------------------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        blocks = self.blocks
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
        )

    def take_kv_events(self) -> list[KvEvent]:
        """Prefix cache events since the last call, numbered without gaps."""
        return self.blocks.take_events()

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()


def _timings(request: Request) -> EngineTimings:
    """A finished request's phases (vLLM's: from its first step, not its latest)."""
    return EngineTimings(
        queued_s=max(0.0, request.scheduled_at - request.queued_at),
        prefill_s=max(0.0, request.first_token_at - request.scheduled_at),
        decode_s=max(0.0, request.last_token_at - request.first_token_at),
        num_preemptions=request.num_preemptions,
    )
