"""The telemetry aggregator: wire records in, Prometheus metrics out (pure: no I/O).

Metric names follow vLLM's (``vllm:`` → ``lamina:``). Per-worker series carry ``worker_id``
and ``model`` labels and come from each worker's latest :class:`WorkerStats`; they are
computed at scrape time by :class:`WorkerCollector`, so liveness is always current:

* a worker is *live* by the cluster's one liveness rule (``lamina.libs.cluster``); a dead
  worker keeps only ``lamina:worker_up 0`` and its counters (its load gauges would be
  stale), until the view forgets it;
* the worker's counters are its own cumulative totals, reported as they are (a worker
  restart resets them, which Prometheus' ``rate()`` handles as a counter reset);
* ``lamina:cluster_*`` gauges sum (or, for KV usage, average) over live workers only.

Request metrics come from the gateway's :class:`RequestRecord`, labelled by ``model`` and
the ``worker_id`` that served the request (empty for a request no worker took); summing
over ``worker_id`` gives the cluster's. Placement counts come from the scheduler's
:class:`PlacementRecord`.

Every bucket list is vLLM's or a superset of it (finer bounds at the low end, for small,
fast models): dropping the extra bounds of a cumulative histogram is exact, which is how
``vllm_compat`` serves vLLM's histograms from these.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from lamina.libs.bounded import BoundedDict
from lamina.libs.cluster import MISSED_HEARTBEATS, Clock, ClusterView, WorkerEntry
from lamina.schemas.v1.records import (
    PLACED,
    BusHealth,
    Outcome,
    PlacementRecord,
    RequestRecord,
    ServiceStarted,
)
from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS, WorkerState, WorkerStats
from lamina.services.telemetry import vllm_compat
from lamina.services.telemetry.vllm_compat import one_two_five_buckets

PREFIX = "lamina:"


# vLLM's buckets, with a few finer ones at the low end for small, fast models.
TTFT_BUCKETS = vllm_compat.TTFT
ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
E2E_BUCKETS = [
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
TOKEN_BUCKETS = one_two_five_buckets(10_000_000)
"""vLLM's go up to the model's ``max_model_len``: these cover any context length."""
PARAMS_N_BUCKETS = vllm_compat.PARAMS_N
PREEMPTION_BUCKETS = vllm_compat.NUM_PREEMPTIONS
DECISION_BUCKETS = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
]  # fmt: skip

WORKER_LABELS = ("worker_id", "model")

#: Per-worker gauges from the latest heartbeat: name → (help, value).
WORKER_GAUGES: dict[str, tuple[str, Callable[[WorkerStats], float]]] = {
    "num_requests_running": ("Requests in the worker's running batch.", lambda s: s.num_running),
    "num_requests_waiting": ("Requests queued on the worker.", lambda s: s.num_waiting),
    "kv_cache_usage_perc": (
        "KV-cache usage as a fraction (1 means 100 percent).",
        lambda s: s.kv_cache_usage,
    ),
    "num_free_kv_blocks": ("Free KV-cache blocks.", lambda s: s.free_kv_blocks),
    "prefix_cache_hit_ratio": (
        "Prefix-cache hit ratio reported by the worker.",
        lambda s: s.prefix_cache_hit_ratio,
    ),
    "spec_decode_active": (
        "Whether the worker's decoding requests draft now (speculative decoding: 0 when "
        "off, or turned off at its batch).",
        lambda s: float(s.spec_decode_active),
    ),
    "num_queued_prefill_tokens": (
        "Prompt tokens waiting to be prefilled.",
        lambda s: s.num_queued_prefill_tokens,
    ),
    "prefill_tokens_per_second": (
        "Recent prefill throughput in tokens per second.",
        lambda s: s.prefill_tokens_per_s,
    ),
    "decode_tokens_per_second": (
        "Recent decode throughput in tokens per second.",
        lambda s: s.decode_tokens_per_s,
    ),
    "tensor_parallel_size": (
        "Ranks each pipeline stage of the worker's model is split across.",
        lambda s: s.tensor_parallel_size,
    ),
    "pipeline_parallel_size": (
        "Pipeline stages the worker's model's layers are split across.",
        lambda s: s.pipeline_parallel_size,
    ),
    "host_kv_blocks": (
        "Blocks the worker's KV host tier holds at most (0: no tier).",
        lambda s: s.host_kv_blocks,
    ),
    "host_kv_blocks_used": (
        "Blocks in the worker's KV host tier.",
        lambda s: s.host_kv_blocks_used,
    ),
    "host_kv_load_blocks_per_second": (
        "KV blocks per second the worker's loads from its host tier ran at (0: not timed).",
        lambda s: s.host_kv_load_blocks_per_s,
    ),
    "disk_kv_blocks": (
        "Blocks the worker's KV disk tier holds at most (0: no tier).",
        lambda s: s.disk_kv_blocks,
    ),
    "disk_kv_blocks_used": (
        "Blocks in the worker's KV disk tier.",
        lambda s: s.disk_kv_blocks_used,
    ),
    "disk_kv_load_blocks_per_second": (
        "KV blocks per second the worker's loads from its disk tier ran at (0: not timed).",
        lambda s: s.disk_kv_load_blocks_per_s,
    ),
    "kv_fetch_blocks_per_second": (
        "KV blocks per second of the worker's last fetch from another worker (0: none).",
        lambda s: s.kv_fetch_blocks_per_s,
    ),
}

#: Per-worker counters from the worker's cumulative totals: name → (help, value).
WORKER_COUNTERS: dict[str, tuple[str, Callable[[WorkerStats], float]]] = {
    "prefix_cache_queries_total": (
        "Prefix-cache queries, in prompt tokens looked up, cumulative on the worker.",
        lambda s: s.prefix_cache_queries,
    ),
    "prefix_cache_hits_total": (
        "Prefix-cache hits, in prompt tokens found cached, cumulative on the worker.",
        lambda s: s.prefix_cache_hits,
    ),
    "prompt_tokens_total": ("Prompt tokens processed.", lambda s: s.prompt_tokens_total),
    "prompt_tokens_cached_total": (
        "Prompt tokens served from the prefix cache (once per request).",
        lambda s: s.prompt_tokens_cached,
    ),
    "generation_tokens_total": ("Tokens generated.", lambda s: s.generation_tokens_total),
    "num_preemptions_total": ("Requests preempted.", lambda s: s.num_preemptions),
    "host_kv_loads_total": (
        "KV blocks loaded back from the host tier instead of computed.",
        lambda s: s.host_kv_loads_total,
    ),
    "host_kv_saves_total": (
        "Evicted KV blocks saved to the host tier.",
        lambda s: s.host_kv_saves_total,
    ),
    "disk_kv_loads_total": (
        "KV blocks loaded back from the disk tier instead of computed.",
        lambda s: s.disk_kv_loads_total,
    ),
    "disk_kv_saves_total": (
        "KV blocks saved to the disk tier (evicted from the host tier, or the device).",
        lambda s: s.disk_kv_saves_total,
    ),
    "kv_fetches_total": (
        "Requests whose leading KV blocks the worker fetched from another worker.",
        lambda s: s.kv_fetches_total,
    ),
    "kv_fetch_failures_total": (
        "KV fetches that failed or timed out (the request computed its prefix instead).",
        lambda s: s.kv_fetch_failures_total,
    ),
    "kv_fetched_blocks_total": (
        "KV blocks fetched from other workers.",
        lambda s: s.kv_fetched_blocks_total,
    ),
    "kv_sent_blocks_total": (
        "KV blocks sent to other workers.",
        lambda s: s.kv_sent_blocks_total,
    ),
    "kv_prefills_total": (
        "Prefill legs the worker computed for decode workers (disaggregated serving).",
        lambda s: s.kv_prefills_total,
    ),
    "spec_decode_num_drafts_total": (
        "Drafts verified (speculative decoding: one per drafted request per step).",
        lambda s: s.spec_decode_num_drafts,
    ),
    "spec_decode_num_draft_tokens_total": (
        "Draft tokens proposed (speculative decoding).",
        lambda s: s.spec_decode_num_draft_tokens,
    ),
    "spec_decode_num_accepted_tokens_total": (
        "Draft tokens the target model accepted (speculative decoding).",
        lambda s: s.spec_decode_num_accepted_tokens,
    ),
}


CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
)
"""``cache_config_info``'s labels: those of vLLM's that a Lamina worker has a value for
(``num_gpu_blocks`` is the pool's blocks on any device)."""


def cache_config(stats: WorkerStats) -> tuple[str, ...]:
    """:data:`CACHE_CONFIG_LABELS`' values for a worker, as vLLM writes them (``str()``)."""
    tokens = stats.total_kv_blocks * stats.block_size
    concurrency = tokens / stats.max_model_len if stats.max_model_len else 0.0
    return (
        str(stats.block_size),
        stats.kv_cache_dtype or "auto",
        str(stats.enable_prefix_caching),
        str(stats.total_kv_blocks),
        str(tokens),
        f"{concurrency:.2f}",
    )


@dataclass(frozen=True)
class ClusterTotals:
    """Cluster-wide figures over live workers."""

    workers_total: int
    workers_live: int
    requests_running: int
    requests_waiting: int
    kv_cache_usage_perc: float

    @classmethod
    def of(cls, snapshot: list[tuple[WorkerEntry, bool]]) -> ClusterTotals:
        """The totals over the live workers of a :meth:`ClusterView.snapshot`."""
        live = [entry.stats for entry, alive in snapshot if alive]
        return cls(
            workers_total=len(snapshot),
            workers_live=len(live),
            requests_running=sum(s.num_running for s in live),
            requests_waiting=sum(s.num_waiting for s in live),
            kv_cache_usage_perc=sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0,
        )


def _gauge(name: str, help_text: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, labels=list(labels))


class WorkerCollector(Collector):
    """Per-worker gauges and counters and the cluster gauges, computed at scrape time."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        snapshot = self.view.snapshot()
        yield from self._liveness(snapshot)
        live = [entry.stats for entry, alive in snapshot if alive]
        yield from self._load_gauges(live)
        known = [entry.stats for entry, _ in snapshot]
        yield from self._counters(known)
        yield self._iteration_tokens(known)
        yield self._accepted_per_position(known)
        yield self._cache_config(live)
        yield self._lora_info(live)
        yield self._rank_memory(live)
        yield from self._cluster(ClusterTotals.of(snapshot))

    def _liveness(self, snapshot: list[tuple[WorkerEntry, bool]]) -> Iterator[Metric]:
        up = _gauge(
            "worker_up",
            f"1 while the worker heartbeats, 0 once it missed {MISSED_HEARTBEATS}.",
            WORKER_LABELS,
        )
        state = _gauge(
            "worker_state",
            "1 for the live worker's current state, 0 for the others.",
            (*WORKER_LABELS, "state"),
        )
        role = _gauge(
            "worker_role",
            "1 for the live worker's role (--role: mixed, prefill or decode).",
            (*WORKER_LABELS, "role"),
        )
        for entry, alive in snapshot:
            stats = entry.stats
            up.add_metric([stats.worker_id, stats.model], 1.0 if alive else 0.0)
            if not alive:
                continue
            role.add_metric([stats.worker_id, stats.model, stats.role], 1.0)
            for name in WorkerState:
                if name == WorkerState.UNKNOWN and stats.state != name:
                    continue  # a series for "unknown" only when a worker reports one
                value = 1.0 if name == stats.state else 0.0
                state.add_metric([stats.worker_id, stats.model, name], value)
        yield up
        yield state
        yield role

    def _load_gauges(self, live: list[WorkerStats]) -> Iterator[Metric]:
        for name, (help_text, value) in WORKER_GAUGES.items():
            family = _gauge(name, help_text, WORKER_LABELS)
            for stats in live:
                family.add_metric([stats.worker_id, stats.model], float(value(stats)))
            yield family

    def _counters(self, known: list[WorkerStats]) -> Iterator[Metric]:
        for name, (help_text, value) in WORKER_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, help_text, labels=list(WORKER_LABELS))
            for stats in known:
                family.add_metric([stats.worker_id, stats.model], float(value(stats)))
            yield family

    def _iteration_tokens(self, known: list[WorkerStats]) -> Metric:
        """Engine steps by tokens computed, from each worker's own cumulative buckets."""
        family = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total",
            "Tokens computed per engine step.",
            labels=list(WORKER_LABELS),
        )
        bounds = [*(str(float(b)) for b in ITERATION_TOKEN_BUCKETS), "+Inf"]
        for stats in known:
            if len(stats.iteration_tokens) != len(bounds):
                continue  # a worker that does not report them
            cumulative = list(itertools.accumulate(stats.iteration_tokens))
            family.add_metric(
                [stats.worker_id, stats.model],
                list(zip(bounds, cumulative, strict=True)),
                float(stats.iteration_tokens_sum),
            )
        return family

    def _accepted_per_position(self, known: list[WorkerStats]) -> Metric:
        """Accepted draft tokens by their position in the draft (vLLM's family)."""
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0: the first).",
            labels=[*WORKER_LABELS, "position"],
        )
        for stats in known:
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([stats.worker_id, stats.model, str(position)], float(count))
        return family

    def _cache_config(self, live: list[WorkerStats]) -> Metric:
        """Each live worker's KV cache configuration as labels (vLLM's names), value 1."""
        labels = (*WORKER_LABELS, *CACHE_CONFIG_LABELS)
        family = _gauge("cache_config_info", "The worker's KV cache configuration.", labels)
        for stats in live:
            family.add_metric([stats.worker_id, stats.model, *cache_config(stats)], 1.0)
        return family

    def _lora_info(self, live: list[WorkerStats]) -> Metric:
        """Each live LoRA-serving worker's adapter slots and the adapters of its running
        and waiting requests as labels (vLLM's ``lora_requests_info``: comma-separated
        names), valued at the heartbeat's time, as vLLM's is at its last update."""
        labels = (*WORKER_LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters")
        family = _gauge("lora_requests_info", "Running stats on LoRA requests.", labels)
        for stats in live:
            if stats.max_loras:
                family.add_metric(
                    [
                        stats.worker_id,
                        stats.model,
                        str(stats.max_loras),
                        ",".join(stats.running_lora_adapters),
                        ",".join(stats.waiting_lora_adapters),
                    ],
                    stats.timestamp_ms / 1000,
                )
        return family

    def _rank_memory(self, live: list[WorkerStats]) -> Metric:
        """What each rank of each live worker holds: its weights and its KV pool."""
        labels = (*WORKER_LABELS, "rank", "stage", "host", "device", "kind")
        family = _gauge(
            "worker_rank_memory_bytes",
            "Bytes one rank of the worker holds: its share of the weights or of the KV pool.",
            labels,
        )
        for stats in live:
            for rank in stats.ranks:
                where = [stats.worker_id, stats.model, str(rank.rank), str(rank.stage)]
                where += [rank.host, rank.device]
                family.add_metric([*where, "weights"], rank.weight_bytes)
                family.add_metric([*where, "kv"], rank.kv_bytes)
        return family

    def _cluster(self, totals: ClusterTotals) -> Iterator[Metric]:
        figures = {
            "cluster_workers_live": ("Live workers.", totals.workers_live),
            "cluster_requests_running": (
                "Running requests over live workers.",
                totals.requests_running,
            ),
            "cluster_requests_waiting": (
                "Waiting requests over live workers.",
                totals.requests_waiting,
            ),
            "cluster_kv_cache_usage_perc": (
                "Mean KV-cache usage (fraction) over live workers.",
                totals.kv_cache_usage_perc,
            ),
        }
        for name, (help_text, value) in figures.items():
            family = _gauge(name, help_text)
            family.add_metric([], float(value))
            yield family


REQUEST_LABELS = ("model", "worker_id")


class RequestMetrics:
    """Histograms and counters from the gateway's request records."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(
            name: str, help_text: str, buckets: list[float], labels=REQUEST_LABELS
        ) -> Histogram:
            return Histogram(PREFIX + name, help_text, labels, buckets=buckets, registry=registry)

        def counter(name: str, help_text: str, labels: tuple[str, ...]) -> Counter:
            return Counter(PREFIX + name, help_text, labels, registry=registry)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token, in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end latency of finished requests.", E2E_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated by finished requests.", TOKEN_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "The most tokens any sequence of a finished request generated.",
            TOKEN_BUCKETS,
        )
        self.prefill_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request computed (not served from the prefix cache).",
            TOKEN_BUCKETS,
        )
        self.params_n = histogram(
            "request_params_n", "The n parameter of finished requests.", PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens parameter of finished requests that set it.",
            TOKEN_BUCKETS,
        )
        # The engine's phases (vLLM's definitions), from the worker that finished it.
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time in the engine's waiting queue, to the request's first step.",
            E2E_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "From the request's first engine step to its first token.",
            E2E_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "From the request's first token to its last, in the engine.",
            E2E_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Prefill plus decode time in the engine.",
            E2E_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time over the tokens after the first (0 for one-token requests).",
            ITL_BUCKETS,
        )
        self.preemptions = histogram(
            "request_num_preemptions",
            "Times a finished request was preempted.",
            PREEMPTION_BUCKETS,
        )
        self.accept = histogram(
            "request_accept_latency_seconds",
            "From the gateway's first submission to a worker's acceptance (scheduler and hops).",
            TTFT_BUCKETS,
            ("model",),
        )
        self.success = counter(
            "request_success_total",
            "Requests that ended after a worker took them, by finish reason (vLLM's: "
            "abort for a client that went away, error for a failure).",
            (*REQUEST_LABELS, "finished_reason"),
        )
        self.outcome = counter(
            "request_outcome_total",
            "Ended requests, by outcome (finished, rejected, failed, cancelled).",
            (*REQUEST_LABELS, "outcome"),
        )
        self.moves = counter(
            "request_moves_total",
            "Accepted requests moved to another worker mid-stream (each move once).",
            ("model",),
        )
        self.inexact_moves = counter(
            "request_inexact_moves_total",
            "Moves that continued a stream on a worker of other numerics (another weight, "
            "activation or KV cache dtype, or device type) than the one it began on.",
            ("model",),
        )
        self.retries = counter(
            "request_retries_total",
            "Submissions retried before a worker accepted them.",
            ("model",),
        )

    def observe(self, record: RequestRecord, trace_id: str | None = None) -> None:
        """Count ``record``; latency and token histograms take only what it measured.

        TTFT and inter-token gaps are observed whenever present (a cancelled request that
        streamed did see its first token); end-to-end latency, token counts, parameters
        and engine phases only for finished requests, so rejections do not drag the
        distributions down. The engine's phases come from the worker that finished the
        request, so a moved request's (split across workers) are left out. With the
        request's ``trace_id``, the TTFT and end-to-end observations carry it as an
        exemplar (OpenMetrics), so a latency panel can open the slow request's trace.
        """
        exemplar = {"trace_id": trace_id} if trace_id else None
        labels = (record.model, record.worker_id or "")
        self.outcome.labels(*labels, record.outcome).inc()
        # Made at 0 with the model's first record, so that a rate over them is 0, not empty.
        self.moves.labels(record.model).inc(record.moves)
        self.inexact_moves.labels(record.model).inc(record.inexact_moves)
        self.retries.labels(record.model).inc(max(0, record.attempts - 1 - record.moves))
        if record.accept_s is not None:
            self.accept.labels(record.model).observe(record.accept_s)
        if record.ttft_s is not None:
            self.ttft.labels(*labels).observe(record.ttft_s, exemplar)
        itl = self.itl.labels(*labels)
        for gap in record.inter_token_s:
            itl.observe(gap)
        if record.worker_id and record.outcome in _ENDED_ON_A_WORKER:
            reason = _ENDED_ON_A_WORKER[record.outcome] or record.finish_reason or "unknown"
            self.success.labels(*labels, reason).inc()
        if record.outcome != Outcome.FINISHED:
            return
        self.e2e.labels(*labels).observe(record.e2e_s, exemplar)
        self.prompt_tokens.labels(*labels).observe(record.prompt_tokens)
        self.generation_tokens.labels(*labels).observe(record.completion_tokens)
        self.max_generation_tokens.labels(*labels).observe(record.completion_tokens)
        computed = max(0, record.prompt_tokens - record.cached_tokens)
        self.prefill_computed.labels(*labels).observe(computed)
        if record.n:  # once per group of n sequences
            self.params_n.labels(*labels).observe(record.n)
        if record.max_tokens:
            self.params_max_tokens.labels(*labels).observe(record.max_tokens)
        timings = record.timings
        if timings is None or record.moves:
            return
        self.queue_time.labels(*labels).observe(timings.queued_s)
        self.prefill_time.labels(*labels).observe(timings.prefill_s)
        self.decode_time.labels(*labels).observe(timings.decode_s)
        self.inference_time.labels(*labels).observe(timings.prefill_s + timings.decode_s)
        after_first = record.completion_tokens - 1
        tpot = timings.decode_s / after_first if after_first > 0 else 0.0
        self.time_per_output_token.labels(*labels).observe(tpot)
        self.preemptions.labels(*labels).observe(timings.num_preemptions)


_ENDED_ON_A_WORKER = {Outcome.FINISHED: None, Outcome.CANCELLED: "abort", Outcome.FAILED: "error"}
"""Outcomes ``request_success_total`` counts, as vLLM's finish reasons (None: the
request's own finish reason)."""


TTFT_ERROR_BUCKETS = [
    *(-b for b in (5.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.02)),
    *(0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
]

MAX_OPEN_PREDICTIONS = 10_000
"""Placement predictions kept while their requests run (oldest dropped beyond it)."""


class PredictionMetrics:
    """The scheduler's predicted TTFT next to the one the gateway measured, per request
    (joined by request id: the placement record comes first, the request record last)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = Histogram(
            PREFIX + "predicted_time_to_first_token_seconds",
            "The placed worker's time to first token as the scheduler predicted it.",
            ["worker_id", "policy"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.error = Histogram(
            PREFIX + "ttft_prediction_error_seconds",
            "Measured minus predicted time to first token (positive: slower than predicted).",
            ["worker_id"],
            buckets=TTFT_ERROR_BUCKETS,
            registry=registry,
        )
        self._open: BoundedDict[str, tuple[str, float]] = BoundedDict(MAX_OPEN_PREDICTIONS)

    def placed(self, record: PlacementRecord) -> None:
        if record.worker_id is None or record.predicted_ttft_s is None:
            return
        self.predicted.labels(record.worker_id, record.policy).observe(record.predicted_ttft_s)
        # A retry's placement replaces the first (and is the newest).
        self._open[record.request_id] = (record.worker_id, record.predicted_ttft_s)

    def ended(self, record: RequestRecord) -> None:
        worker_id, predicted = self._open.pop(record.request_id, (None, 0.0))
        if record.ttft_s is not None and worker_id == record.worker_id:
            self.error.labels(worker_id).observe(record.ttft_s - predicted)


MAX_BUS_INSTANCES = 1_000
"""Processes whose bus health is kept (the longest unheard dropped beyond it)."""


class BusCollector(Collector):
    """Each process's NATS connection: errors, disconnects, reconnects and refused
    messages, as the process last reported them (``BusHealth``; cumulative, so a restart
    resets them)."""

    def __init__(self) -> None:
        self.latest: BoundedDict[tuple[str, str], BusHealth] = BoundedDict(MAX_BUS_INSTANCES)

    def observe(self, health: BusHealth) -> None:
        self.latest[(health.service, health.instance)] = health

    def collect(self) -> Iterator[Metric]:
        figures = {
            "bus_errors": ("Errors the NATS client reported.", lambda h: h.errors),
            "bus_disconnects": ("Times the process lost its NATS server.", lambda h: h.disconnects),
            "bus_reconnects": ("Times the process got a NATS server back.", lambda h: h.reconnects),
            "bus_refused_messages": (
                "Messages refused as not from whom they claim to be (forged stream events).",
                lambda h: h.refused,
            ),
        }
        for name, (help_text, value) in figures.items():
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["service", "instance"])
            for (service, instance), health in self.latest.items():
                family.add_metric([service, instance], float(value(health)))
            yield family


class PlacementMetrics:
    """The schedulers' decisions: how many, why, how fast, and their queues."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            PREFIX + "placements_total",
            "Placement decisions, by policy and reason (placed, queued or the rejection).",
            ["policy", "reason"],
            registry=registry,
        )
        self.decision_time = Histogram(
            PREFIX + "placement_decision_seconds",
            "How long the scheduler took to decide (registry, prefix index, scoring).",
            ["policy"],
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            PREFIX + "scheduler_queue_wait_seconds",
            "Time requests waited in a scheduler's queue, by how they left it.",
            ["reason"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.legs = Counter(
            PREFIX + "disaggregated_placements_total",
            "Requests placed with a prefill leg: the prefill worker computes the prompt's "
            "KV, the decode worker fetches it and streams.",
            ["prefill_worker_id", "decode_worker_id"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            PREFIX + "scheduler_queue_depth",
            "Requests in each scheduler replica's queue, as of its latest decision.",
            ["scheduler_id"],
            registry=registry,
        )

    def observe(self, record: PlacementRecord) -> None:
        policy = record.policy or "unknown"
        self.decisions.labels(policy, record.reason).inc()
        if record.decision_s is not None:
            self.decision_time.labels(policy).observe(record.decision_s)
        if record.queued_s is not None:
            self.queue_wait.labels(record.reason).observe(record.queued_s)
        if record.scheduler_id:
            self.queue_depth.labels(record.scheduler_id).set(record.queue_depth)
        chosen = next((s for s in record.scored if s.worker_id == record.worker_id), None)
        if record.reason == PLACED and chosen is not None and chosen.prefill:
            self.legs.labels(chosen.fetch_from, chosen.worker_id).inc()


COMPAT = ("", "vllm")
"""``--metrics-compat`` values: none, or vLLM's names and labels as well."""


class Aggregator:
    """Everything telemetry knows, in its own :class:`CollectorRegistry`; with
    ``compat="vllm"`` its exposition also holds vLLM's families (``vllm_compat``)."""

    def __init__(
        self, clock: Clock = time.monotonic, wall_clock: Clock = time.time, compat: str = ""
    ) -> None:
        if compat not in COMPAT:
            raise ValueError(f"metrics compat must be one of {COMPAT}, not {compat!r}")
        self.compat = compat
        self.registry = CollectorRegistry()
        self.workers = ClusterView(clock, wall_clock)
        self.registry.register(WorkerCollector(self.workers))
        self.requests = RequestMetrics(self.registry)
        self.placements = PlacementMetrics(self.registry)
        self.buses = BusCollector()
        self.registry.register(self.buses)
        self.predictions = PredictionMetrics(self.registry)
        self.starts = Counter(
            PREFIX + "service_starts_total",
            "Services that began serving, by service (each restart is one more).",
            ["service"],
            registry=self.registry,
        )
        self.restarts = Gauge(
            PREFIX + "service_restarts",
            "Times lamina up's supervisor has restarted each service instance.",
            ["service", "instance"],
            registry=self.registry,
        )

    def observe_start(self, started: ServiceStarted) -> None:
        """A service began serving (its first start, or a restart)."""
        self.starts.labels(started.service).inc()
        self.restarts.labels(started.service, started.instance).set(started.restarts)

    def observe_bus(self, health: BusHealth) -> None:
        """A process's NATS connection counters changed."""
        self.buses.observe(health)

    def observe_stats(self, stats: WorkerStats) -> None:
        """A worker heartbeat."""
        self.workers.heartbeat(stats)

    def observe_request(self, record: RequestRecord, trace_id: str | None = None) -> None:
        """A request ended at the gateway (``trace_id``: its trace, for exemplars)."""
        self.requests.observe(record, trace_id)
        self.predictions.ended(record)

    def observe_placement(self, record: PlacementRecord) -> None:
        """The scheduler decided where (or whether) to place a request."""
        self.placements.observe(record)
        self.predictions.placed(record)

    def render(self, openmetrics: bool = False) -> bytes:
        """The exposition of every metric: Prometheus text, or OpenMetrics (which carries
        exemplars) for a scraper that asks for it."""
        exposed = _Exposition(self) if self.compat else self.registry
        if openmetrics:  # names as they are: the default escaping would turn ':' into '_'
            return openmetrics_latest(exposed, escaping=ALLOWUTF8)
        return generate_latest(exposed)

    def max_model_len(self) -> dict[str, int]:
        """Each model's longest context over the workers known to serve it."""
        lengths: dict[str, int] = {}
        for entry, _ in self.workers.snapshot():
            stats = entry.stats
            lengths[stats.model] = max(lengths.get(stats.model, 0), stats.max_model_len)
        return lengths

    def cluster(self) -> dict[str, Any]:
        """Every worker's latest stats with ``alive`` and ``last_seen_ms``, and the totals."""
        snapshot = self.workers.snapshot()
        workers = [
            msgspec.structs.asdict(entry.stats)
            | {"alive": alive, "last_seen_ms": entry.last_seen_ms}
            for entry, alive in snapshot
        ]
        totals = ClusterTotals.of(snapshot)
        return {"workers": workers, "totals": dataclasses.asdict(totals)}


class _Exposition:
    """What one scrape serves with a compat mode on: Lamina's families, then the same
    collection translated (one collection for both)."""

    def __init__(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator

    def collect(self) -> Iterator[Metric]:
        families = list(self.aggregator.registry.collect())
        yield from families
        yield from vllm_compat.translate(families, PREFIX, self.aggregator.max_model_len())
