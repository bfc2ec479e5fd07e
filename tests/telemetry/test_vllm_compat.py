"""``--metrics-compat vllm``: vLLM's names, labels and buckets, checked against vLLM 0.33.0's
list (``vllm_0_33.py``), so that its dashboard and alerts work unchanged."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lamina.schemas.v1.generate import EngineTimings
from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS
from lamina.services.telemetry import metrics, vllm_compat
from lamina.services.telemetry.metrics import Aggregator
from lamina.services.telemetry.vllm_compat import one_two_five_buckets
from tests.telemetry import vllm_0_33 as vllm
from tests.telemetry import vllm_0_34
from tests.telemetry.helpers import make_record, make_stats

NOT_SERVED = {"vllm:admission_rejections"}  # in vllm_compat.NOT_SERVED, with why
MAX_MODEL_LEN = 256  # make_stats'


def served(compat: str = "vllm") -> Aggregator:
    """An aggregator that has seen a heartbeat and each kind of request end."""
    aggregator = Aggregator(compat=compat)
    aggregator.observe_stats(
        make_stats(
            iteration_tokens=[3] + [1] * len(ITERATION_TOKEN_BUCKETS),
            iteration_tokens_sum=900,
            prompt_tokens_cached=16,
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=30,
            spec_decode_num_accepted_tokens=12,
            spec_decode_num_accepted_tokens_per_pos=[7, 4, 1],
            max_loras=2,
            lora_adapters=["sql", "chat"],
            running_lora_adapters=["chat", "sql"],
            waiting_lora_adapters=["sql"],
        )
    )
    timings = EngineTimings(queued_s=0.01, prefill_s=0.05, decode_s=0.2, num_preemptions=1)
    aggregator.observe_request(make_record(timings=timings, max_tokens=8), "ab" * 16)
    aggregator.observe_request(make_record(outcome="cancelled", finish_reason=None))
    aggregator.observe_request(  # refused before any worker took it: no engine
        make_record(outcome="rejected", worker_id=None, finish_reason=None, ttft_s=None)
    )
    return aggregator


def families(aggregator: Aggregator) -> dict:
    """The ``vllm:`` families served (without the ``_created`` series the text format
    shows as families of their own, as vLLM's exposition does too)."""
    text = aggregator.render().decode()
    return {
        f.name: f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }


def test_every_vllm_metric_is_served_with_its_type_and_labels():
    got = families(served())
    expected = vllm.METRICS | vllm.SPEC_DECODING | vllm.LORA
    assert set(got) == set(expected) - NOT_SERVED
    for name, family in got.items():
        kind, labels, _ = expected[name]
        assert family.type == kind, name
        assert family.samples, f"{name} has no series"
        for sample in family.samples:
            names = set(sample.labels) - {"le"}
            if name == "vllm:cache_config_info":
                assert names == {"engine", *vllm.CACHE_CONFIG_LABELS_USED}
            else:
                assert names == set(labels), (name, sample.labels)
            assert sample.labels.get("engine") == "w1"  # the worker's id; never empty


def test_every_family_of_vllm_0_34_is_served_or_listed_with_why():
    got = set(families(served()))
    for name in vllm_0_34.FAMILIES:
        bare = name.removeprefix("vllm:")
        listed = [
            k
            for k in vllm_compat.NOT_SERVED
            if bare == k or (k.endswith("_") and bare.startswith(k))
        ]
        assert (name in got) != bool(listed), name  # one or the other
    assert got <= set(vllm_0_34.FAMILIES) | set(vllm.METRICS)
    (lora,) = families(served())["vllm:lora_requests_info"].samples
    assert lora.labels == {
        "engine": "w1",
        "max_lora": "2",
        "running_lora_adapters": "chat,sql",
        "waiting_lora_adapters": "sql",
    }
    per_position = families(served())["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert [(s.labels["position"], s.value) for s in per_position.samples] == [
        ("0", 7.0),
        ("1", 4.0),
        ("2", 1.0),
    ]


def test_histogram_buckets_are_vllms():
    got = families(served())
    for name, (kind, _, buckets) in vllm.METRICS.items():
        if kind != "histogram":
            continue
        bounds = {s.labels["le"] for s in got[name].samples if s.name.endswith("_bucket")}
        expected = one_two_five_buckets(MAX_MODEL_LEN) if buckets == vllm.TOKENS else buckets
        assert bounds == {*(str(float(b)) for b in expected), "+Inf"}, name


@pytest.mark.parametrize("name", sorted(vllm_compat.HISTOGRAMS))
def test_lamina_buckets_hold_vllms_so_dropping_the_extra_ones_is_exact(name):
    """A cumulative histogram with fewer bounds is exact only when they are a subset."""
    lamina = Aggregator()
    lamina.observe_stats(make_stats(iteration_tokens=[0] * (len(ITERATION_TOKEN_BUCKETS) + 1)))
    timings = EngineTimings(queued_s=0, prefill_s=0, decode_s=0)
    lamina.observe_request(make_record(timings=timings, max_tokens=8))
    text = lamina.render().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "lamina:" + name]
    ours = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
    theirs = vllm_compat.HISTOGRAMS[name] or one_two_five_buckets(10_000_000)
    assert set(map(float, theirs)) <= ours


def test_the_values_are_laminas_own():
    samples = [s for family in families(served()).values() for s in family.samples]

    def value(name: str, **labels: str) -> float:
        (sample,) = [
            s
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return sample.value

    assert value("vllm:num_requests_running") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25
    assert value("vllm:prompt_tokens_total") == 40
    assert value("vllm:prompt_tokens_by_source_total", source="local_compute") == 40 - 16
    assert value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 16
    assert value("vllm:prompt_tokens_cached_by_source_total", source="device") == 16
    # vLLM counts a request whose client left as an abort; a refused one it never saw.
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="abort") == 1
    assert value("vllm:request_decode_time_seconds_sum") == 0.2
    assert value("vllm:request_inference_time_seconds_sum") == 0.25
    assert value("vllm:iteration_tokens_total_bucket", le="1.0") == 3
    assert value("vllm:iteration_tokens_total_bucket", le="+Inf") == 3 + len(
        ITERATION_TOKEN_BUCKETS
    )
    assert value("vllm:engine_sleep_state", sleep_state="awake") == 1
    (info,) = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert info.labels["num_gpu_blocks"] == "100" and info.labels["block_size"] == "16"
    assert info.labels["kv_cache_size_tokens"] == "1600"


def test_every_series_vllms_dashboard_queries_is_served_by_model_name():
    text = served().render().decode()
    by_series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            by_series.setdefault(sample.name, set()).add(sample.labels.get("model_name", ""))
    for series in vllm.DASHBOARD_SERIES:
        assert "tiny" in by_series.get(series, set()), series


def test_exemplars_carry_over_to_vllms_latency_histograms():
    text = served().render(openmetrics=True).decode()
    assert any(
        line.startswith("vllm:time_to_first_token_seconds_bucket") and "# {trace_id=" in line
        for line in text.splitlines()
    )
    assert text.rstrip().endswith("# EOF") and text.count("# EOF") == 1


def test_off_by_default_and_only_known_modes():
    assert "vllm:" not in served(compat="").render().decode()
    with pytest.raises(ValueError, match="metrics compat"):
        Aggregator(compat="sglang")
    assert metrics.COMPAT == ("", "vllm")
