"""Facts about vLLM 0.33.0's ``/metrics``, for the compatibility test: every metric its
``PrometheusStatLogger`` always registers (``vllm/v1/metrics/loggers.py``), with its type,
label names and bucket bounds (``vllm/v1/metrics/buckets.py``), and the series its
published Grafana dashboard queries (``examples/observability/prometheus_grafana/
grafana.json``, each selected by ``model_name``).
"""

from __future__ import annotations

REQUEST_LATENCY = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
TIME_TO_FIRST_TOKEN = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
INTER_TOKEN_LATENCY = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
TOKENS = "1-2-5 up to max_model_len"

ENGINE = ("model_name", "engine")

#: name (as the text parser gives it: counters without ``_total``) → (type, labels,
#: buckets for a histogram).
METRICS: dict[str, tuple[str, tuple[str, ...], object]] = {
    "vllm:num_requests_running": ("gauge", ENGINE, None),
    "vllm:num_requests_waiting": ("gauge", ENGINE, None),
    "vllm:num_requests_waiting_by_reason": ("gauge", (*ENGINE, "reason"), None),
    "vllm:engine_sleep_state": ("gauge", (*ENGINE, "sleep_state"), None),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE, None),
    "vllm:prefix_cache_queries": ("counter", ENGINE, None),
    "vllm:prefix_cache_hits": ("counter", ENGINE, None),
    "vllm:external_prefix_cache_queries": ("counter", ENGINE, None),
    "vllm:external_prefix_cache_hits": ("counter", ENGINE, None),
    "vllm:mm_cache_queries": ("counter", ENGINE, None),
    "vllm:mm_cache_hits": ("counter", ENGINE, None),
    "vllm:num_preemptions": ("counter", ENGINE, None),
    "vllm:prompt_tokens": ("counter", ENGINE, None),
    "vllm:prompt_tokens_by_source": ("counter", (*ENGINE, "source"), None),
    "vllm:prompt_tokens_cached": ("counter", ENGINE, None),
    "vllm:prompt_tokens_cached_by_source": ("counter", (*ENGINE, "source"), None),
    "vllm:generation_tokens": ("counter", ENGINE, None),
    "vllm:request_success": ("counter", (*ENGINE, "finished_reason"), None),
    "vllm:admission_rejections": ("counter", ("model_name", "reason"), None),
    "vllm:request_prompt_tokens": ("histogram", ENGINE, TOKENS),
    "vllm:request_generation_tokens": ("histogram", ENGINE, TOKENS),
    "vllm:iteration_tokens_total": ("histogram", ENGINE, ITERATION_TOKENS),
    "vllm:request_max_num_generation_tokens": ("histogram", ENGINE, TOKENS),
    "vllm:request_params_n": ("histogram", ENGINE, PARAMS_N),
    "vllm:request_params_max_tokens": ("histogram", ENGINE, TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE, TIME_TO_FIRST_TOKEN),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE, INTER_TOKEN_LATENCY),
    "vllm:request_time_per_output_token_seconds": ("histogram", ENGINE, INTER_TOKEN_LATENCY),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE, REQUEST_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY),
    "vllm:request_num_preemptions": ("histogram", ENGINE, NUM_PREEMPTIONS),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ENGINE, TOKENS),
    # One label per CacheConfig field plus engine; the test checks the ones Lamina has.
    "vllm:cache_config_info": ("gauge", ("engine",), None),
}

#: The speculative-decoding families, registered when a speculative config is given
#: (``vllm/v1/spec_decode/metrics.py``; Lamina serves them always, zero where none).
SPEC_DECODING: dict[str, tuple[str, tuple[str, ...], object]] = {
    "vllm:spec_decode_num_drafts": ("counter", ENGINE, None),
    "vllm:spec_decode_num_draft_tokens": ("counter", ENGINE, None),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ENGINE, None),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", (*ENGINE, "position"), None),
}

#: Registered when LoRA is on (``vllm/v1/metrics/loggers.py``); Lamina's adds the engine.
LORA = {
    "vllm:lora_requests_info": (
        "gauge",
        ("engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
        None,
    ),
}

CACHE_CONFIG_LABELS_USED = {
    # by vLLM's dashboards and its own metrics test
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
}

#: Every series the 0.33.0 dashboard's expressions select (all by ``model_name``).
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_success_total",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
]
