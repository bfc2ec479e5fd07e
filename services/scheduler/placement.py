"""Admission and placement policy (pure: no I/O).

Admission keeps the workers that can run the request (alive, ready, serving its model,
with the context for it). Among them the policy chooses:

* ``kv`` (the default): the lowest predicted time to first token among the workers with KV
  room for the request after reuse, ties broken by decode load. For worker w, with Q the
  prefill tokens queued there now (``Candidate.queued_tokens``: what its heartbeat
  reported plus what was placed there since, draining at its rate meanwhile), U this
  request's prompt tokens that w does not have cached (the cluster prefix index), R_p
  and R_d its measured prefill and decode rates, and N the sequences it is decoding::

      ttft(w) = (Q + U) / R_p  +  H / R_h  +  D / R_k  +  decode_weight * N * c / R_d

  The first term is the prefill work ahead of the request's first token, its own
  included; reuse enters through U, in the same unit as load, so a long cached prefix
  wins exactly when skipping its prefill saves more time than the worker's queue costs.
  H is the cached blocks w's host tier holds and its device does not, and R_h the rate
  w measured loading blocks back from it; D and R_k the same for its disk tier: a host
  hit costs more than a device hit, a disk hit more again, and each less than computing.
  The last term is one engine step's worth of the decodes that share the steps: ``c``
  is the tokens a decoding sequence computes per step, 1 without speculative decoding,
  and with it 1 plus its draft tokens per step, from the worker's measured acceptance
  (:func:`decode_tokens_per_step`). Both
  rates are measured over whole engine steps, which already mix prefill and decode, so
  the decode term is a correction for a worker busier than when its rates were
  measured; ``decode_weight`` scales it (0 drops it). A worker that has not measured a
  rate yet (it has served nothing) is given the median of the rates its peers measured,
  else the configured prior: a fresh worker must look as fast as its peers, or it would
  never be given the work that measures it.

  A worker may also fetch the prompt's leading blocks from another worker that holds
  more of them, on its device or in a lower tier (a busy, cordoned or draining one
  included) instead of
  computing them: with F the blocks fetched at R_x, w's measured transfer rate, and U'
  what is left to compute, ``ttft_fetch(w) = (Q + U') / R_p + F / R_x + decode``; the
  worker is scored by the lower of the two, and the decision says which.

  Disaggregated serving (workers' ``--role``): a request is placed on a decode (or
  mixed) worker; a prefill worker is a candidate only when no other serves the model.
  A decode worker's request whose uncached prompt is ``prefill_min_tokens`` or more has
  a prefill leg when a prefill worker has room: the prefill worker P computes the
  prompt's full blocks and the decode worker fetches them, so
  ``ttft(w) = ttft_P(blocks) + F / R_x + (Q + U') / R_p + decode``, with ``ttft_P``
  P's own prediction for those tokens (its queue, its cache). The leg is taken
  whenever one is possible, even where computing locally predicts the earlier first
  token: keeping long prefills out of the decode workers' steps is what the role asks.
* ``load``: least queued work (queued prefill tokens plus a per-request charge), blind
  to the cache.
* ``round-robin``: each ready worker in turn.

Dynamo scores ``overlap_weight * prefill_blocks + decode_blocks`` and llm-d sums weighted
prefix, queue and KV-utilisation scorers; both add quantities of different units under
tuned weights. Predicting the TTFT puts overlap and load in seconds, which is also what
the SLA admission of a request's ``ttft_target_ms`` needs, and lets telemetry show the
prediction next to the measured TTFT.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from lamina.libs.block_hash import root_hash
from lamina.libs.bounded import BoundedDict
from lamina.libs.context_length import context_overflow
from lamina.schemas.v1.generate import GenerateRequest, RejectReason
from lamina.schemas.v1.records import ScoredWorker
from lamina.schemas.v1.stats import WorkerRole, WorkerState, WorkerStats
from lamina.services.scheduler.registry import Candidate

_PINNED_KEYS = 4096
"""Affinity keys remembered (a group's requests arrive together: the latest suffice)."""

#: Prefill tokens one queued request is taken to be worth under the ``load`` policy.
REQUEST_WEIGHT_TOKENS = 64


class Policy(StrEnum):
    KV = "kv"
    LOAD = "load"
    ROUND_ROBIN = "round-robin"


def decode_tokens_per_step(worker: WorkerStats) -> float:
    """Tokens one of ``worker``'s decoding sequences computes per engine step: 1, plus
    with speculative decoding its draft tokens per step. From the worker's counts of
    output tokens G, draft tokens D and accepted draft tokens A: a sequence's step
    outputs its accepted draft tokens and one token of its own, so its steps number
    ``G - A``, and they computed ``G - A + D`` tokens."""
    steps = worker.generation_tokens_total - worker.spec_decode_num_accepted_tokens
    if not worker.spec_decode_num_draft_tokens or steps <= 0:
        return 1.0
    return 1.0 + worker.spec_decode_num_draft_tokens / steps


@dataclass(frozen=True)
class CostModel:
    """The constants of the ``kv`` policy's TTFT prediction."""

    prefill_rate_prior: float = 2000.0
    """Prefill tokens/s assumed for a worker that has not measured its own yet."""
    decode_rate_prior: float = 200.0
    """Decode tokens/s assumed likewise."""
    decode_weight: float = 1.0
    """Scale of the running-decodes term (0: prefill work alone)."""
    host_load_rate_prior: float = 5000.0
    """Blocks/s a worker's host tier is assumed to load back at before it measured its
    own (or where it cannot: copies queued on a GPU)."""
    disk_load_rate_prior: float = 1000.0
    """Blocks/s its disk tier is assumed to load back at, likewise."""
    transfer_bytes_prior: float = 1e9
    """Bytes/s a worker is assumed to fetch another's blocks at before it measured its
    own fetch (500 blocks/s of a 7B model's 2 MiB blocks)."""

    def transfer_rate(self, worker: WorkerStats) -> float:
        """Blocks/s ``worker`` fetches at: measured, else the prior over its block's
        bytes."""
        if worker.kv_fetch_blocks_per_s:
            return worker.kv_fetch_blocks_per_s
        return self.transfer_bytes_prior / max(1, kv_block_bytes(worker.kv_layout))

    def uncached_tokens(self, prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
        """Prompt tokens a worker must compute: at least one (the engine always computes
        the last prompt token, whose logits give the first output token)."""
        return prompt_tokens - min(overlap_blocks * block_size, prompt_tokens - 1)

    def predict_ttft(
        self,
        worker: Candidate,
        uncached: int,
        rates: tuple[float, float] | None = None,
        host_blocks: int = 0,
        disk_blocks: int = 0,
    ) -> float:
        """``ttft(w)`` above, with ``host_blocks`` and ``disk_blocks`` loaded back from
        the worker's lower tiers at its measured rates; ``rates`` (prefill, decode) stand
        in for rates the worker has not measured (default: the priors)."""
        s = worker.stats
        prefill_prior, decode_prior = rates or (self.prefill_rate_prior, self.decode_rate_prior)
        prefill_rate = s.prefill_tokens_per_s or prefill_prior
        decode_rate = s.decode_tokens_per_s or decode_prior
        queued = worker.queued_tokens
        decode = self.decode_weight * s.num_running * decode_tokens_per_step(s) / decode_rate
        load = host_blocks / (s.host_kv_load_blocks_per_s or self.host_load_rate_prior)
        load += disk_blocks / (s.disk_kv_load_blocks_per_s or self.disk_load_rate_prior)
        return (queued + uncached) / prefill_rate + load + decode

    def peer_rates(self, workers: list[Candidate]) -> tuple[float, float]:
        """The median prefill and decode rates the workers measured (the priors where
        none has)."""
        prefill = [w.stats.prefill_tokens_per_s for w in workers if w.stats.prefill_tokens_per_s]
        decode = [w.stats.decode_tokens_per_s for w in workers if w.stats.decode_tokens_per_s]
        return (
            statistics.median(prefill) if prefill else self.prefill_rate_prior,
            statistics.median(decode) if decode else self.decode_rate_prior,
        )


@dataclass(frozen=True)
class Decision:
    worker_id: str | None
    reason: RejectReason | None
    """None when placed."""
    message: str
    candidates: int
    score: float | None = None
    retryable: bool = True
    retry_after_s: float | None = None
    prefix_hit_blocks: int = 0
    predicted_ttft_s: float | None = None
    scored: list[ScoredWorker] = field(default_factory=list)
    decision_s: float | None = None
    """How long deciding took (set by the scheduler service, which times it)."""
    fetch_from: str = ""
    """The worker to fetch the prompt's leading blocks from (empty: none)."""
    fetch_blocks: int = 0
    prefill: bool = False
    """``fetch_from`` computes those blocks first: the request's prefill leg."""


def drain_time(workers: list[Candidate], queued_tokens: int, rate_prior: float) -> float:
    """Seconds until the cluster has worked off its backlog (every worker's queued prefill
    plus ``queued_tokens`` in the scheduler's queue) at the sum of the prefill rates its
    workers measured (``rate_prior`` when none has)."""
    backlog = queued_tokens + sum(w.queued_tokens for w in workers)
    rate = sum(w.stats.prefill_tokens_per_s for w in workers) or rate_prior
    return backlog / rate


def retry_after(drain_s: float) -> float:
    """``Retry-After`` for a refusal: the drain time in whole seconds, at least one."""
    return max(1.0, float(math.ceil(drain_s)))


def load_score(entry: Candidate) -> float:
    s = entry.stats
    return (
        s.num_queued_prefill_tokens
        + entry.pending_tokens
        + REQUEST_WEIGHT_TOKENS * (s.num_running + s.num_waiting + entry.pending)
    )


Overlap = Callable[[list[int], list[str], int], dict[str, tuple[int, int, int]]]
"""``(prompt token ids, worker ids) -> {worker id: (cached leading blocks, of which its
host tier holds and its device does not, of which only its disk tier holds)}``
(``PrefixIndex.overlap_by_medium``)."""


@dataclass
class Placer:
    """Chooses a worker by :class:`Policy`; keeps the round-robin turn."""

    policy: Policy = Policy.KV
    cost: CostModel = field(default_factory=CostModel)
    saturation_steps: float = 4.0
    """A worker whose queued prefill exceeds this many engine steps' token budget, or whose
    waiting requests reach ``max_num_seqs``, takes nothing more: requests wait in the
    scheduler's queue instead, where priority and deadline order them."""
    prefill_min_tokens: int = 256
    """A decode worker computes a prompt itself when fewer of its tokens are uncached
    there (a prefill leg's round trip is not worth it)."""
    _turn: itertools.count = field(default_factory=itertools.count)
    _pinned: BoundedDict[str, str] = field(default_factory=lambda: BoundedDict(_PINNED_KEYS))
    """Affinity key -> the worker its first request went to (the latest keys kept)."""

    def saturated(self, worker: Candidate) -> bool:
        s = worker.stats
        return (
            worker.queued_tokens > self.saturation_steps * s.max_num_batched_tokens
            or s.num_waiting + worker.pending >= s.max_num_seqs
        )

    def place(
        self,
        request: GenerateRequest,
        live: list[Candidate],
        overlap: Overlap,
        senders: Sequence[Candidate] | None = None,
    ) -> Decision:
        """Where ``request`` goes; a refusal from admission; or, when every worker that
        could run it is saturated, ``reason=OVERLOADED`` (the caller queues it).
        ``senders``: the workers a placement may fetch blocks from (default: ``live``;
        also those placement holds back, whose blocks are as good)."""
        admitted, refusal = admit(request, live)
        if refusal is not None:
            return refusal
        decoders = [w for w in admitted if w.stats.role != WorkerRole.PREFILL]
        adapter = _adapter(request, admitted)
        prefillers = [
            w
            for w in admitted
            if decoders
            and adapter is None  # (a prefill leg computes the base model's KV)
            and w.stats.role == WorkerRole.PREFILL
            and _can_send(w)
            and not self.saturated(w)
        ]
        decoders = decoders or admitted  # prefill workers alone: they run requests whole
        fits = [w for w in decoders if not self.saturated(w)]
        if not fits:
            message = f"all {len(admitted)} workers for this model are saturated"
            return Decision(None, RejectReason.OVERLOADED, message, len(admitted))
        if adapter is not None:  # llm-d's LoRA affinity: where the adapter runs, or has room
            now = [w for w in fits if _runs_adapter_now(w.stats, adapter)]
            fits = now or fits
        if request.numerics:  # a moved stream: where it continues as it began, if it can
            same = [w for w in fits if w.stats.numerics() == request.numerics]
            fits = same or fits
        senders = [
            w
            for w in (live if senders is None else senders)
            if adapter is None and w.stats.model == request.model and _can_send(w)
        ]
        scored = self._score_all(request, fits, overlap, senders, prefillers)
        by_id = {s.worker_id: s for s in scored}
        pinned = self._pinned.get(request.affinity) if request.affinity else None
        if pinned in by_id:  # its group's worker can take it: there, to share the prefill
            best = by_id[pinned]
            return _placed(best, len(fits), best.predicted_ttft_s, scored)
        if self.policy == Policy.KV:
            roomy = [s for s, w in zip(scored, fits, strict=True) if self._has_room(w, s)]
            best = min(
                roomy or scored,
                key=lambda s: (s.predicted_ttft_s, s.kv_usage, s.num_running, s.worker_id),
            )
            score = best.predicted_ttft_s
        elif self.policy == Policy.LOAD:
            chosen = min(fits, key=lambda w: (load_score(w), w.stats.worker_id))
            best, score = by_id[chosen.stats.worker_id], load_score(chosen)
        else:
            ordered = sorted(fits, key=lambda w: w.stats.worker_id)
            chosen = ordered[next(self._turn) % len(ordered)]
            best, score = by_id[chosen.stats.worker_id], None
        if request.affinity:
            self._pinned[request.affinity] = best.worker_id
        return _placed(best, len(fits), score, scored)

    def earliest_ttft(
        self, request: GenerateRequest, live: list[Candidate], overlap: Overlap
    ) -> float:
        """The lowest predicted TTFT over every worker that could run ``request``, saturated
        or not (0 when none could): what a queued request waits at least."""
        admitted, _ = admit(request, live)
        scored = self._score_all(request, admitted, overlap)
        return min((s.predicted_ttft_s for s in scored), default=0.0)

    def _score_all(
        self,
        request: GenerateRequest,
        workers: list[Candidate],
        overlap: Overlap,
        senders: Sequence[Candidate] = (),
        prefillers: Sequence[Candidate] = (),
    ) -> list[ScoredWorker]:
        """Each of ``workers`` scored for ``request``, in order: a decode worker with its
        prefill leg on one of ``prefillers`` if it has one, else each with the best fetch
        from one of ``senders`` where that predicts the earlier first token."""
        if not workers:
            return []
        prompt = request.prompt_token_ids
        ids = [w.stats.worker_id for w in [*workers, *senders, *prefillers]]
        hits = overlap(prompt, list(dict.fromkeys(ids)), root_hash(_adapter(request, workers)))
        held = []  # (blocks, sender): what each could send (from any tier), most first
        for w in senders:
            total = hits[w.stats.worker_id][0]
            if total:
                held.append((total, w))
        held.sort(key=lambda h: -h[0])
        rates = self.cost.peer_rates(workers)
        scored = []
        for w in workers:
            local = self._score(w, len(prompt), *hits[w.stats.worker_id], rates)
            leg = self._with_prefill(w, local, len(prompt), prefillers, hits, rates)
            scored.append(leg or self._with_fetch(w, local, len(prompt), held, rates))
        return scored

    def _with_prefill(
        self,
        worker: Candidate,
        local: ScoredWorker,
        prompt_tokens: int,
        prefillers: Sequence[Candidate],
        hits: dict[str, tuple[int, int]],
        rates: tuple[float, float],
    ) -> ScoredWorker | None:
        """``worker`` (a decode worker) with the prompt's full blocks computed by the
        prefill worker that predicts them soonest among those with room for them; None
        when it computes the prompt itself (a short one, or no prefill worker fits)."""
        s = worker.stats
        if s.role != WorkerRole.DECODE or not s.kv_layout:
            return None
        usable = (prompt_tokens - 1) // s.block_size  # a token is left to compute
        if usable <= local.overlap_blocks or (
            self.cost.uncached_tokens(prompt_tokens, local.overlap_blocks, s.block_size)
            < self.prefill_min_tokens
        ):
            return None
        tokens = usable * s.block_size
        legs = [
            (p, self._score(p, tokens, *hits[p.stats.worker_id], rates))
            for p in prefillers
            if p.stats.kv_layout == s.kv_layout and tokens < p.stats.max_model_len
        ]
        roomy = [leg for p, leg in legs if self._has_room(p, leg)]
        if not roomy:
            return None
        leg = min(roomy, key=lambda leg: (leg.predicted_ttft_s, leg.worker_id))
        return self._fetching(
            worker, local, prompt_tokens, usable, leg.worker_id, rates, leg.predicted_ttft_s
        )

    def _with_fetch(
        self,
        worker: Candidate,
        local: ScoredWorker,
        prompt_tokens: int,
        held: list[tuple[int, Candidate]],
        rates: tuple[float, float],
    ) -> ScoredWorker:
        """``local``, or ``worker`` fetching from the sender that holds the most of the
        prompt in a layout like its own, if that predicts the earlier first token."""
        s = worker.stats
        sender = next(
            (
                (blocks, w)
                for blocks, w in held
                if w.stats.worker_id != s.worker_id and w.stats.kv_layout == s.kv_layout
            ),
            None,
        )
        if not s.kv_layout or sender is None:
            return local
        usable = (prompt_tokens - 1) // s.block_size  # a token is left to compute
        blocks = min(sender[0], usable)
        if blocks <= local.overlap_blocks:
            return local
        fetching = self._fetching(
            worker, local, prompt_tokens, blocks, sender[1].stats.worker_id, rates
        )
        return fetching if fetching.predicted_ttft_s < local.predicted_ttft_s else local

    def _fetching(
        self,
        worker: Candidate,
        local: ScoredWorker,
        prompt_tokens: int,
        blocks: int,
        sender: str,
        rates: tuple[float, float],
        prefill_s: float | None = None,
    ) -> ScoredWorker:
        """``worker`` fetching the prompt's leading ``blocks`` from ``sender``: computed
        there first, in ``prefill_s`` predicted seconds (a prefill leg), or held there."""
        s = worker.stats
        uncached = self.cost.uncached_tokens(prompt_tokens, blocks, s.block_size)
        ttft = (
            (prefill_s or 0.0)
            + blocks / self.cost.transfer_rate(s)
            + self.cost.predict_ttft(worker, uncached, rates)
        )
        new_blocks = math.ceil(uncached / s.block_size) + blocks - local.overlap_blocks
        return msgspec.structs.replace(
            local,
            predicted_ttft_s=ttft,
            kv_usage=_usage_after(s, new_blocks),
            host_blocks=0,
            disk_blocks=0,
            fetch_from=sender,
            fetch_blocks=blocks,
            prefill=prefill_s is not None,
        )

    def _score(
        self,
        worker: Candidate,
        prompt_tokens: int,
        overlap_blocks: int,
        host_blocks: int,
        disk_blocks: int,
        rates: tuple[float, float],
    ) -> ScoredWorker:
        s = worker.stats
        uncached = self.cost.uncached_tokens(prompt_tokens, overlap_blocks, s.block_size)
        # Lower tiers' blocks load into fresh device blocks; the engine uses at most the
        # hit that leaves a token to compute (the host's counted first).
        usable = (prompt_tokens - uncached) // s.block_size
        host = min(host_blocks, usable)
        disk = min(disk_blocks, usable - host)
        new_blocks = math.ceil(uncached / s.block_size) + host + disk
        return ScoredWorker(
            worker_id=s.worker_id,
            overlap_blocks=overlap_blocks,
            predicted_ttft_s=self.cost.predict_ttft(worker, uncached, rates, host, disk),
            kv_usage=_usage_after(s, new_blocks),
            num_running=s.num_running + worker.pending,
            host_blocks=host,
            disk_blocks=disk,
        )

    @staticmethod
    def _has_room(worker: Candidate, scored: ScoredWorker) -> bool:
        """Free KV blocks for the request's uncached prompt, after what is pending."""
        s = worker.stats
        pending_blocks = math.ceil(worker.pending_tokens / s.block_size)
        return scored.kv_usage * s.total_kv_blocks + pending_blocks <= s.total_kv_blocks


def _usage_after(stats: WorkerStats, new_blocks: int) -> float:
    """The fraction of a worker's KV blocks in use once a request takes ``new_blocks``."""
    used = stats.total_kv_blocks - stats.free_kv_blocks + new_blocks
    return used / stats.total_kv_blocks if stats.total_kv_blocks else 1.0


def _placed(best: ScoredWorker, candidates: int, score: float | None, scored: list) -> Decision:
    return Decision(
        best.worker_id,
        None,
        "",
        candidates,
        score,
        prefix_hit_blocks=best.overlap_blocks,
        predicted_ttft_s=best.predicted_ttft_s,
        scored=scored,
        fetch_from=best.fetch_from,
        fetch_blocks=best.fetch_blocks,
        prefill=best.prefill,
    )


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def kv_block_bytes(layout: str) -> int:
    """Bytes of one KV block (keys and values) of a ``WorkerStats.kv_layout``
    (``block_size/dtype/layers/KV heads/head dim``); 0 for one it cannot read."""
    try:
        block, dtype, layers, heads, dim = layout.split("/")
        size = _ELEMENT_BYTES.get(dtype, 1)  # fp8 and any other 1-byte type
        return 2 * int(block) * int(layers) * int(heads) * int(dim) * size
    except ValueError:
        return 0


def _can_send(worker: Candidate) -> bool:
    """Whether ``worker`` can send KV blocks: it advertises a layout and a listener, and
    its engine still serves (a draining worker's blocks are what a move wants most)."""
    s = worker.stats
    return bool(s.kv_layout and s.kv_address) and s.state in (
        WorkerState.READY,
        WorkerState.DRAINING,
    )


def _adapter(request: GenerateRequest, workers: Sequence[Candidate]) -> str | None:
    """The LoRA adapter ``request``'s ``model`` names on ``workers`` (None: their base
    model)."""
    if any(w.stats.model == request.model for w in workers):
        return None
    return request.model if workers else None


def _runs_adapter_now(stats: WorkerStats, adapter: str) -> bool:
    """Whether a worker's next step could take a request of ``adapter``: its running
    requests use it already, or use fewer adapters than its slots (``max_loras``);
    elsewhere the request waits for one of those adapters' requests to finish."""
    running = stats.running_lora_adapters
    return adapter in running or len(running) < stats.max_loras


def _shown_state(worker: Candidate) -> str:
    s = worker.stats
    return "cordoned" if s.cordoned and s.state == WorkerState.READY else str(s.state)


def admit(
    request: GenerateRequest, live: list[Candidate]
) -> tuple[list[Candidate], Decision | None]:
    """The ready workers that can run ``request``, or the refusal when there are none."""
    if not live:
        return [], Decision(None, RejectReason.NO_WORKER, "no engine worker is alive", 0)
    serving = [w for w in live if w.stats.serves(request.model)]
    if not serving:
        models = sorted({m for w in live for m in (w.stats.model, *w.stats.lora_adapters)})
        message = f"no worker serves model {request.model!r}; available: {models}"
        return [], Decision(None, RejectReason.MODEL_NOT_FOUND, message, 0, retryable=False)
    ready = [w for w in serving if w.stats.state == WorkerState.READY and not w.stats.cordoned]
    if not ready:
        states = ", ".join(sorted({_shown_state(w) for w in serving}))
        message = f"no worker for this model is ready (their states: {states})"
        return [], Decision(None, RejectReason.NO_WORKER, message, len(serving))
    prompt, wanted = len(request.prompt_token_ids), request.sampling.max_tokens
    fits = [w for w in ready if not context_overflow(prompt, wanted, w.stats.max_model_len)]
    if not fits:
        longest = max(w.stats.max_model_len for w in ready)
        message = context_overflow(prompt, wanted, longest) or ""
        refusal = Decision(None, RejectReason.INVALID_REQUEST, message, len(ready), retryable=False)
        return [], refusal
    return fits, None
