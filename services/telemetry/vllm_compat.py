"""vLLM's ``/metrics`` over Lamina's metrics (telemetry's ``--metrics-compat vllm``).

vLLM's Grafana dashboard and alerts select by ``model_name`` and aggregate over ``engine``
(one engine core). Lamina's families already carry vLLM's names under ``lamina:``; this
serves them again the way vLLM does (0.33, ``vllm/v1/metrics/loggers.py``):

* the ``vllm:`` prefix, ``model`` → ``model_name`` and ``worker_id`` → ``engine`` (a Lamina
  worker is one engine; its id is the label's value). A series no worker served
  (``worker_id=""``: a request refused before any worker took it) has no engine and is
  left out;
* vLLM's histogram bounds. Lamina's are a superset (finer at the low end, token counts
  past any context length), and dropping bounds of a cumulative histogram is exact; the
  token-count histograms go up to the model's ``max_model_len``, as vLLM's do;
* the few families vLLM has that are a fixed function of what Lamina measures, derived:
  waiting requests by reason (Lamina defers none), prompt tokens by source (no external
  KV transfer), cached prompt tokens by tier (all on the device), the external prefix
  cache and the multimodal cache (none: vLLM serves these at 0 for a text model too), the
  engine's sleep state (Lamina's engines never sleep).

Every other family vLLM 0.34 can register is in :data:`NOT_SERVED`, with why.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS

VLLM_PREFIX = "vllm:"

NOT_SERVED: dict[str, str] = {
    "admission_rejections": "the schedulers' queue refusals are lamina:placements_total "
    "(reason overloaded), by policy, not by which queue bound",
    "corrupted_requests": "the engine does not check logits for NaNs",
    "watermark_requests": "no watermark is implemented",
    "estimated_flops_per_gpu": "the engine does not estimate its FLOPs (vLLM's "
    "--enable-mfu-metrics)",
    "estimated_read_bytes_per_gpu": "the engine does not estimate its memory traffic",
    "estimated_write_bytes_per_gpu": "the engine does not estimate its memory traffic",
    "kv_block_": "KV block lifetimes are not measured (vLLM's --kv-cache-metrics)",
    "diffusion_": "no diffusion language models",
    "num_requests_kv_fetch_by_stage": "fetches between workers are Lamina's own "
    "lamina:kv_fetches_total and lamina:kv_prefills_total, per worker, not by stage",
    **dict.fromkeys(
        (
            "nixl_",
            "mooncake_",
            "hf3fs_",
            "hisparse_",
            "umbp_",
            "simple_kv_offload_",
            "kv_offload_",
            "kvcr_",
        ),
        "KV connectors and offload tiers: Lamina's lower tiers and transfers between "
        "workers are its own lamina:host_kv_*, lamina:disk_kv_* and lamina:kv_* families, "
        "not a connector's",
    ),
    "tool_call_parser_invocations": "the gateway's tool-call parsing is not counted",
    "request_render_duration_seconds": "the gateway's chat rendering is not timed",
    "websocket_": "no realtime (WebSocket) API",
    "sleep_mode_": "engines do not sleep",
    "rl_weight_update_": "weights are not updated in place",
}
"""vLLM 0.34's families (by name, or a prefix ending ``_``) Lamina does not serve, and why."""


def one_two_five_buckets(max_value: int) -> list[float]:
    """``1, 2, 5, 10, 20, 50, ...`` up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


LABELS = {"model": "model_name", "worker_id": "engine"}

REQUEST_LATENCY = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
TTFT = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
INTER_TOKEN = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
PARAMS_N = [1.0, 2.0, 5.0, 10.0, 20.0]
NUM_PREEMPTIONS = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
TOKENS = None
"""The token-count histograms' bounds: 1-2-5 up to the model's ``max_model_len``."""

#: Lamina's gauges and counters vLLM has under the same name (without prefix).
PLAIN = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "cache_config_info",
    "lora_requests_info",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "prompt_tokens_cached",
    "generation_tokens",
    "request_success",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)
#: Lamina's histograms vLLM has under the same name → vLLM's bounds.
HISTOGRAMS: dict[str, list[float] | None] = {
    "time_to_first_token_seconds": TTFT,
    "inter_token_latency_seconds": INTER_TOKEN,
    "request_time_per_output_token_seconds": INTER_TOKEN,
    "e2e_request_latency_seconds": REQUEST_LATENCY,
    "request_queue_time_seconds": REQUEST_LATENCY,
    "request_inference_time_seconds": REQUEST_LATENCY,
    "request_prefill_time_seconds": REQUEST_LATENCY,
    "request_decode_time_seconds": REQUEST_LATENCY,
    "iteration_tokens_total": [float(b) for b in ITERATION_TOKEN_BUCKETS],
    "request_params_n": PARAMS_N,
    "request_num_preemptions": NUM_PREEMPTIONS,
    "request_prompt_tokens": TOKENS,
    "request_generation_tokens": TOKENS,
    "request_max_num_generation_tokens": TOKENS,
    "request_params_max_tokens": TOKENS,
    "request_prefill_kv_computed_tokens": TOKENS,
}
NO_MODEL_LABEL = {"cache_config_info", "lora_requests_info"}  # vLLM's carry no model


def translate(
    families: Iterable[Metric], prefix: str, max_model_len: dict[str, int]
) -> Iterator[Metric]:
    """vLLM's families from Lamina's collected ``families`` (named ``<prefix><name>``);
    ``max_model_len`` per model bounds the token-count histograms (a model not in it keeps
    every bound)."""
    by_name = {
        family.name.removeprefix(prefix): family
        for family in families
        if family.name.startswith(prefix)
    }
    for name in (*PLAIN, *HISTOGRAMS):
        family = by_name.get(name)
        if family is not None:
            yield _translated(name, family, prefix, max_model_len)
    yield from _derived(by_name)


def _translated(name: str, family: Metric, prefix: str, max_model_len: dict[str, int]) -> Metric:
    out = Metric(VLLM_PREFIX + name, family.documentation, family.type)
    for sample in family.samples:
        labels = _labels(sample.labels, drop_model=name in NO_MODEL_LABEL)
        if labels is None:
            continue
        if sample.name.endswith("_bucket") and not _kept(
            name, sample.labels.get("le", ""), max_model_len.get(sample.labels.get("model", ""))
        ):
            continue
        out.samples.append(
            sample._replace(name=VLLM_PREFIX + sample.name.removeprefix(prefix), labels=labels)
        )
    return out


def _labels(labels: dict[str, str], drop_model: bool = False) -> dict[str, str] | None:
    """vLLM's label names for a series, or None for one with no engine."""
    if labels.get("worker_id") == "":
        return None
    renamed = {LABELS.get(key, key): value for key, value in labels.items()}
    if drop_model:
        renamed.pop("model_name", None)
    return renamed


def _kept(name: str, le: str, model_len: int | None) -> bool:
    """Whether vLLM's histogram ``name`` has the bound ``le``."""
    if le == "+Inf":
        return True
    bounds = HISTOGRAMS[name]
    if bounds is TOKENS:
        if model_len is None:
            return True
        bounds = one_two_five_buckets(model_len)
    return float(le) in bounds


def _derived(by_name: dict[str, Metric]) -> Iterator[Metric]:
    """vLLM's families that are a fixed function of Lamina's (see the module docstring)."""
    engines = _samples(by_name.get("num_requests_running"), "")
    waiting = _samples(by_name.get("num_requests_waiting"), "")
    prompt = _samples(by_name.get("prompt_tokens"), "_total")
    cached = _samples(by_name.get("prompt_tokens_cached"), "_total")
    yield _family(
        "num_requests_waiting_by_reason",
        "Requests waiting, by why: capacity (Lamina defers none).",
        "gauge",
        [({"reason": "capacity"}, waiting), ({"reason": "deferred"}, _zeros(waiting))],
    )
    yield _family(
        "engine_sleep_state",
        "The engine's sleep state, one-hot (Lamina's engines are always awake).",
        "gauge",
        [
            ({"sleep_state": "awake"}, {key: 1.0 for key in engines}),
            ({"sleep_state": "weights_offloaded"}, _zeros(engines)),
            ({"sleep_state": "discard_all"}, _zeros(engines)),
        ],
    )
    computed = {key: value - cached.get(key, 0.0) for key, value in prompt.items()}
    yield _family(
        "prompt_tokens_by_source",
        "Prompt tokens by where their KV came from.",
        "counter",
        [
            ({"source": "local_compute"}, computed),
            ({"source": "local_cache_hit"}, cached),
            ({"source": "external_kv_transfer"}, _zeros(prompt)),
        ],
    )
    tiers = ("host", "p2p", "disk", "external_unspecified")
    yield _family(
        "prompt_tokens_cached_by_source",
        "Cached prompt tokens by cache tier (Lamina's are all on the device).",
        "counter",
        [({"source": "device"}, cached), *(({"source": t}, _zeros(cached)) for t in tiers)],
    )
    for name in ("external_prefix_cache_queries", "external_prefix_cache_hits"):
        help_text = "Tokens through a KV connector (Lamina has none)."
        yield _family(name, help_text, "counter", [({}, _zeros(engines))])
    for name in ("mm_cache_queries", "mm_cache_hits"):
        help_text = "Multimodal cache items (Lamina serves text models: none)."
        yield _family(name, help_text, "counter", [({}, _zeros(engines))])


Key = tuple[tuple[str, str], ...]


def _samples(family: Metric | None, suffix: str) -> dict[Key, float]:
    """A per-worker family's values by its vLLM labels (``suffix``: the sample's)."""
    if family is None:
        return {}
    values = {}
    for sample in family.samples:
        labels = _labels(sample.labels)
        if sample.name == family.name + suffix and labels is not None:
            values[tuple(sorted(labels.items()))] = sample.value
    return values


def _zeros(values: dict[Key, float]) -> dict[Key, float]:
    return dict.fromkeys(values, 0.0)


def _family(
    name: str, help_text: str, kind: str, parts: list[tuple[dict[str, str], dict[Key, float]]]
) -> Metric:
    family = Metric(VLLM_PREFIX + name, help_text, kind)
    sample_name = family.name + ("_total" if kind == "counter" else "")
    for extra, values in parts:
        for key, value in values.items():
            family.samples.append(Sample(sample_name, dict(key) | extra, value))
    return family
