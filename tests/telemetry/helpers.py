"""Builders for the wire records the telemetry tests feed in."""

from __future__ import annotations

from lamina.schemas.v1.records import RequestRecord
from lamina.schemas.v1.stats import WorkerStats


def make_stats(worker_id: str = "w1", **overrides: object) -> WorkerStats:
    fields: dict[str, object] = dict(
        worker_id=worker_id,
        model="tiny",
        device="cpu",
        state="ready",
        block_size=16,
        total_kv_blocks=100,
        free_kv_blocks=75,
        kv_cache_usage=0.25,
        prefix_cache_hit_ratio=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=5,
        num_running=2,
        num_waiting=1,
        num_queued_prefill_tokens=30,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=256,
        prefill_tokens_per_s=100.0,
        decode_tokens_per_s=20.0,
        num_preemptions=3,
        prompt_tokens_total=40,
        generation_tokens_total=12,
        timestamp_ms=1,
        heartbeat_interval_s=0.5,
    )
    return WorkerStats(**(fields | overrides))


def make_record(**overrides: object) -> RequestRecord:
    fields: dict[str, object] = dict(
        request_id="r1",
        model="tiny",
        worker_id="w1",
        outcome="finished",
        finish_reason="stop",
        prompt_tokens=7,
        completion_tokens=3,
        cached_tokens=0,
        ttft_s=0.03,
        e2e_s=0.2,
        inter_token_s=[0.004, 0.02],
    )
    return RequestRecord(**(fields | overrides))
