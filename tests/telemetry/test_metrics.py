"""The aggregator alone: records in, exposition lines out, liveness on an injected clock."""

from __future__ import annotations

import msgspec
import prometheus_client
from prometheus_client import generate_latest

from lamina.libs.cluster import FORGET_AFTER_S
from lamina.schemas.v1.generate import EngineTimings
from lamina.schemas.v1.records import BusHealth, PlacementRecord, ServiceStarted
from lamina.schemas.v1.stats import Rank
from lamina.services.telemetry.metrics import (
    TOKEN_BUCKETS,
    Aggregator,
    one_two_five_buckets,
)
from tests.telemetry.helpers import make_record, make_stats

WALL = 1_700_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_aggregator() -> tuple[Aggregator, FakeClock]:
    clock = FakeClock()
    return Aggregator(clock=clock, wall_clock=lambda: WALL), clock


def lines(agg: Aggregator) -> set[str]:
    return set(generate_latest(agg.registry).decode().splitlines())


def names(agg: Aggregator) -> set[str]:
    """Metric names that currently have samples."""
    return {line.split("{")[0].split(" ")[0] for line in lines(agg) if not line.startswith("#")}


W1 = 'model="tiny",worker_id="w1"'


def test_worker_gauges_and_counters():
    agg, _ = make_aggregator()
    agg.observe_stats(make_stats())
    expected = {
        f"lamina:worker_up{{{W1}}} 1.0",
        'lamina:worker_state{model="tiny",state="ready",worker_id="w1"} 1.0',
        'lamina:worker_state{model="tiny",state="draining",worker_id="w1"} 0.0',
        f"lamina:num_requests_running{{{W1}}} 2.0",
        f"lamina:num_requests_waiting{{{W1}}} 1.0",
        f"lamina:kv_cache_usage_perc{{{W1}}} 0.25",
        f"lamina:num_free_kv_blocks{{{W1}}} 75.0",
        f"lamina:prefix_cache_hit_ratio{{{W1}}} 0.5",
        f"lamina:num_queued_prefill_tokens{{{W1}}} 30.0",
        f"lamina:prefill_tokens_per_second{{{W1}}} 100.0",
        f"lamina:decode_tokens_per_second{{{W1}}} 20.0",
        "# TYPE lamina:prefix_cache_queries_total counter",
        f"lamina:prefix_cache_queries_total{{{W1}}} 10.0",
        f"lamina:prefix_cache_hits_total{{{W1}}} 5.0",
        f"lamina:prompt_tokens_total{{{W1}}} 40.0",
        f"lamina:generation_tokens_total{{{W1}}} 12.0",
        f"lamina:num_preemptions_total{{{W1}}} 3.0",
        "lamina:cluster_workers_live 1.0",
        "lamina:cluster_requests_running 2.0",
        "lamina:cluster_requests_waiting 1.0",
        "lamina:cluster_kv_cache_usage_perc 0.25",
    }
    assert expected <= lines(agg)


def test_a_tensor_parallel_worker_shows_its_size_and_each_ranks_memory():
    agg, _ = make_aggregator()
    ranks = [
        Rank(rank=r, host="h", device=f"cuda:{r}", pid=10 + r, weight_bytes=300, kv_bytes=700)
        for r in range(2)
    ]
    agg.observe_stats(make_stats(tensor_parallel_size=2, ranks=ranks))
    rank1 = 'device="cuda:1",host="h",kind="{}",model="tiny",rank="1",stage="0",worker_id="w1"'
    assert {
        f"lamina:tensor_parallel_size{{{W1}}} 2.0",
        f"lamina:worker_rank_memory_bytes{{{rank1.format('weights')}}} 300.0",
        f"lamina:worker_rank_memory_bytes{{{rank1.format('kv')}}} 700.0",
    } <= lines(agg)


def test_counters_report_the_latest_cumulative_values_even_after_a_restart():
    agg, _ = make_aggregator()
    agg.observe_stats(make_stats(generation_tokens_total=500))
    agg.observe_stats(make_stats(generation_tokens_total=9))  # the worker restarted
    assert f"lamina:generation_tokens_total{{{W1}}} 9.0" in lines(agg)


def test_cluster_totals_sum_and_average_over_live_workers():
    agg, clock = make_aggregator()
    agg.observe_stats(make_stats("w1", num_running=2, num_waiting=1, kv_cache_usage=0.2))
    agg.observe_stats(make_stats("w2", num_running=3, num_waiting=4, kv_cache_usage=0.6))
    assert {
        "lamina:cluster_workers_live 2.0",
        "lamina:cluster_requests_running 5.0",
        "lamina:cluster_requests_waiting 5.0",
        "lamina:cluster_kv_cache_usage_perc 0.4",
    } <= lines(agg)
    clock.now += 1.0
    agg.observe_stats(make_stats("w2", num_running=3, num_waiting=4, kv_cache_usage=0.6))
    clock.now += 1.0  # w1 silent for 2 s > 3 × 0.5 s; w2 for 1 s
    assert {
        "lamina:cluster_workers_live 1.0",
        "lamina:cluster_requests_running 3.0",
        "lamina:cluster_requests_waiting 4.0",
        "lamina:cluster_kv_cache_usage_perc 0.6",
    } <= lines(agg)


def test_liveness_flips_after_three_missed_heartbeats():
    agg, clock = make_aggregator()
    agg.observe_stats(make_stats(heartbeat_interval_s=0.5))
    clock.now += 1.5  # exactly three intervals: still live
    assert f"lamina:worker_up{{{W1}}} 1.0" in lines(agg)

    clock.now += 0.01
    dead = lines(agg)
    assert f"lamina:worker_up{{{W1}}} 0.0" in dead
    assert "lamina:cluster_workers_live 0.0" in dead
    assert "lamina:cluster_kv_cache_usage_perc 0.0" in dead
    # Stale load gauges and state go; counters (work really done) stay.
    assert "lamina:num_requests_running" not in names(agg)
    assert "lamina:worker_state" not in names(agg)
    assert f"lamina:prompt_tokens_total{{{W1}}} 40.0" in dead

    agg.observe_stats(make_stats(num_running=4))
    back = lines(agg)
    assert f"lamina:worker_up{{{W1}}} 1.0" in back
    assert f"lamina:num_requests_running{{{W1}}} 4.0" in back


def test_long_dead_workers_are_forgotten():
    agg, clock = make_aggregator()
    agg.observe_stats(make_stats())
    clock.now += 1.5 + FORGET_AFTER_S
    assert "lamina:worker_up" in names(agg)
    clock.now += 0.01
    assert "lamina:worker_up" not in names(agg)
    assert "lamina:prompt_tokens_total" not in names(agg)
    assert agg.cluster()["workers"] == []


def test_worker_state_is_one_hot():
    agg, _ = make_aggregator()
    agg.observe_stats(make_stats(state="draining"))
    state = sorted(line for line in lines(agg) if line.startswith("lamina:worker_state{"))
    assert state == [
        'lamina:worker_state{model="tiny",state="degraded",worker_id="w1"} 0.0',
        'lamina:worker_state{model="tiny",state="draining",worker_id="w1"} 1.0',
        'lamina:worker_state{model="tiny",state="failed",worker_id="w1"} 0.0',
        'lamina:worker_state{model="tiny",state="ready",worker_id="w1"} 0.0',
        'lamina:worker_state{model="tiny",state="starting",worker_id="w1"} 0.0',
    ]


def test_finished_request_feeds_histograms_and_counters():
    agg, _ = make_aggregator()
    agg.observe_request(make_record())
    m = 'model="tiny",worker_id="w1"'
    expected = {
        "# TYPE lamina:time_to_first_token_seconds histogram",
        f'lamina:time_to_first_token_seconds_bucket{{le="0.02",{m}}} 0.0',
        f'lamina:time_to_first_token_seconds_bucket{{le="0.04",{m}}} 1.0',
        f"lamina:time_to_first_token_seconds_count{{{m}}} 1.0",
        f"lamina:time_to_first_token_seconds_sum{{{m}}} 0.03",
        # one observation per inter-token gap
        f'lamina:inter_token_latency_seconds_bucket{{le="0.0025",{m}}} 0.0',
        f'lamina:inter_token_latency_seconds_bucket{{le="0.005",{m}}} 1.0',
        f'lamina:inter_token_latency_seconds_bucket{{le="0.025",{m}}} 2.0',
        f"lamina:inter_token_latency_seconds_count{{{m}}} 2.0",
        f"lamina:inter_token_latency_seconds_sum{{{m}}} 0.024",
        f'lamina:e2e_request_latency_seconds_bucket{{le="0.1",{m}}} 0.0',
        f'lamina:e2e_request_latency_seconds_bucket{{le="0.3",{m}}} 1.0',
        f"lamina:e2e_request_latency_seconds_count{{{m}}} 1.0",
        f"lamina:e2e_request_latency_seconds_sum{{{m}}} 0.2",
        f'lamina:request_prompt_tokens_bucket{{le="5.0",{m}}} 0.0',
        f'lamina:request_prompt_tokens_bucket{{le="10.0",{m}}} 1.0',
        f"lamina:request_prompt_tokens_sum{{{m}}} 7.0",
        f'lamina:request_generation_tokens_bucket{{le="2.0",{m}}} 0.0',
        f'lamina:request_generation_tokens_bucket{{le="5.0",{m}}} 1.0',
        f"lamina:request_generation_tokens_sum{{{m}}} 3.0",
        "# TYPE lamina:request_success_total counter",
        f'lamina:request_success_total{{finished_reason="stop",{m}}} 1.0',
        'lamina:request_outcome_total{model="tiny",outcome="finished",worker_id="w1"} 1.0',
    }
    assert expected <= lines(agg)


def test_unfinished_requests_count_outcomes_but_not_latency():
    agg, _ = make_aggregator()
    agg.observe_request(make_record(finish_reason="length"))
    agg.observe_request(
        make_record(
            outcome="rejected",
            worker_id=None,  # no worker took it
            finish_reason=None,
            ttft_s=None,
            e2e_s=0.001,
            inter_token_s=[],
        )
    )
    agg.observe_request(
        make_record(outcome="cancelled", finish_reason=None, ttft_s=0.5, inter_token_s=[0.1])
    )
    agg.observe_request(make_record(outcome="finished", finish_reason=None, inter_token_s=[]))
    m = 'model="tiny",worker_id="w1"'
    got = lines(agg)
    assert {
        'lamina:request_outcome_total{model="tiny",outcome="finished",worker_id="w1"} 2.0',
        'lamina:request_outcome_total{model="tiny",outcome="rejected",worker_id=""} 1.0',
        'lamina:request_outcome_total{model="tiny",outcome="cancelled",worker_id="w1"} 1.0',
        f'lamina:request_success_total{{finished_reason="length",{m}}} 1.0',
        f'lamina:request_success_total{{finished_reason="unknown",{m}}} 1.0',
        # vLLM counts a request its client left as an abort (a worker had it)
        f'lamina:request_success_total{{finished_reason="abort",{m}}} 1.0',
        f"lamina:e2e_request_latency_seconds_count{{{m}}} 2.0",
        f"lamina:request_prompt_tokens_count{{{m}}} 2.0",
        # the cancelled request did stream: its TTFT and gaps count
        f"lamina:time_to_first_token_seconds_count{{{m}}} 3.0",
        f"lamina:inter_token_latency_seconds_count{{{m}}} 3.0",
    } <= got
    assert not any('worker_id=""' in line and "success" in line for line in got)


def test_engine_phases_parameters_moves_and_retries_of_finished_requests():
    agg, _ = make_aggregator()
    timings = EngineTimings(queued_s=0.01, prefill_s=0.05, decode_s=0.2, num_preemptions=1)
    agg.observe_request(make_record(timings=timings, completion_tokens=5, max_tokens=16))
    agg.observe_request(
        make_record(timings=timings, moves=1, inexact_moves=1, attempts=3, accept_s=0.002)
    )
    agg.observe_request(make_record(outcome="failed", finish_reason=None, timings=None))
    m = 'model="tiny",worker_id="w1"'
    got = lines(agg)
    assert {
        f"lamina:request_queue_time_seconds_sum{{{m}}} 0.01",
        f"lamina:request_prefill_time_seconds_sum{{{m}}} 0.05",
        f"lamina:request_decode_time_seconds_sum{{{m}}} 0.2",
        f"lamina:request_inference_time_seconds_sum{{{m}}} 0.25",
        # decode time over the four tokens after the first
        f"lamina:request_time_per_output_token_seconds_sum{{{m}}} 0.05",
        f'lamina:request_num_preemptions_bucket{{le="1.0",{m}}} 1.0',
        # the moved request's phases were split across workers: left out
        f"lamina:request_queue_time_seconds_count{{{m}}} 1.0",
        # parameters of both finished requests; max_tokens only where it was set
        f"lamina:request_params_n_count{{{m}}} 2.0",
        f"lamina:request_params_max_tokens_sum{{{m}}} 16.0",
        f"lamina:request_params_max_tokens_count{{{m}}} 1.0",
        f"lamina:request_prefill_kv_computed_tokens_sum{{{m}}} 14.0",
        f"lamina:request_max_num_generation_tokens_sum{{{m}}} 8.0",
        'lamina:request_moves_total{model="tiny"} 1.0',
        'lamina:request_inexact_moves_total{model="tiny"} 1.0',
        'lamina:request_retries_total{model="tiny"} 1.0',  # three attempts: one move, one retry
        'lamina:request_accept_latency_seconds_count{model="tiny"} 1.0',
        f'lamina:request_success_total{{finished_reason="error",{m}}} 1.0',
    } <= got


def test_placements_count_by_policy_and_reason_with_their_time_and_queue():
    agg, _ = make_aggregator()
    for worker_id, reason in [("w1", "placed"), ("w2", "placed"), (None, "no_capacity")]:
        agg.observe_placement(
            PlacementRecord(
                request_id="r",
                worker_id=worker_id,
                reason=reason,
                candidates=2,
                policy="kv",
                decision_s=0.0003,
                scheduler_id="s1",
                queue_depth=4,
            )
        )
    agg.observe_placement(
        PlacementRecord(
            request_id="q",
            worker_id="w1",
            reason="placed",
            candidates=2,
            policy="kv",
            queued_s=0.3,
            scheduler_id="s1",
            queue_depth=3,
        )
    )
    got = lines(agg)
    assert {
        "# TYPE lamina:placements_total counter",
        'lamina:placements_total{policy="kv",reason="placed"} 3.0',
        'lamina:placements_total{policy="kv",reason="no_capacity"} 1.0',
        'lamina:placement_decision_seconds_bucket{le="0.0005",policy="kv"} 3.0',
        'lamina:placement_decision_seconds_count{policy="kv"} 3.0',
        'lamina:scheduler_queue_wait_seconds_sum{reason="placed"} 0.3',
        'lamina:scheduler_queue_depth{scheduler_id="s1"} 3.0',  # as of the latest decision
    } <= got


def test_the_predicted_ttft_is_shown_next_to_its_error_against_the_measured_one():
    agg, _ = make_aggregator()
    for request_id, predicted in [("fast", 0.02), ("slow", 0.5), ("retried", 0.1)]:
        agg.observe_placement(
            PlacementRecord(
                request_id=request_id,
                worker_id="w1",
                reason="placed",
                candidates=2,
                policy="kv",
                predicted_ttft_s=predicted,
            )
        )
    agg.observe_request(make_record(request_id="fast", ttft_s=0.03))  # 10 ms slower
    agg.observe_request(make_record(request_id="slow", ttft_s=0.2))  # 300 ms faster
    # Served by another worker than the one predicted for (a move): no error observed.
    agg.observe_request(make_record(request_id="retried", worker_id="w2", ttft_s=0.5))
    got = lines(agg)
    assert (
        'lamina:predicted_time_to_first_token_seconds_count{policy="kv",worker_id="w1"} 3.0' in got
    )
    assert 'lamina:ttft_prediction_error_seconds_count{worker_id="w1"} 2.0' in got
    assert 'lamina:ttft_prediction_error_seconds_bucket{le="-0.25",worker_id="w1"} 1.0' in got
    assert 'lamina:ttft_prediction_error_seconds_bucket{le="0.02",worker_id="w1"} 2.0' in got
    assert not agg.predictions._open  # every joined or ended request let go of its entry


def test_cluster_view_has_every_stats_field_plus_liveness():
    agg, clock = make_aggregator()
    stats = make_stats("w1")
    agg.observe_stats(stats)
    clock.now += 0.4
    agg.observe_stats(make_stats("w2", num_running=5))
    clock.now += 1.3  # w1 silent 1.7 s (dead), w2 1.3 s (live)
    view = agg.cluster()
    w1, w2 = view["workers"]
    assert w1 == msgspec.structs.asdict(stats) | {"alive": False, "last_seen_ms": int(WALL * 1000)}
    assert (w2["worker_id"], w2["alive"], w2["num_running"]) == ("w2", True, 5)
    assert view["totals"] == {
        "workers_total": 2,
        "workers_live": 1,
        "requests_running": 5,
        "requests_waiting": 1,
        "kv_cache_usage_perc": 0.25,
    }
    msgspec.json.encode(view)  # serialisable as is


def test_own_registry_not_the_global_one():
    agg, _ = make_aggregator()
    agg.observe_stats(make_stats())
    agg.observe_request(make_record())
    assert "lamina:worker_up" in names(agg)
    global_text = generate_latest(prometheus_client.REGISTRY).decode()
    assert "lamina:" not in global_text
    Aggregator()  # a second one registers without name clashes


def test_token_buckets_are_one_two_five():
    assert one_two_five_buckets(60) == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
    assert TOKEN_BUCKETS[-1] == 10_000_000.0


def test_service_starts_are_counted_and_the_supervisors_restarts_shown():
    agg, _ = make_aggregator()
    for restarts in (0, 1, 2):  # a worker started, then restarted twice by lamina up
        agg.observe_start(ServiceStarted(service="worker", instance="w0", restarts=restarts))
    agg.observe_start(ServiceStarted(service="gateway", instance="g1"))
    assert {
        'lamina:service_starts_total{service="worker"} 3.0',
        'lamina:service_starts_total{service="gateway"} 1.0',
        'lamina:service_restarts{instance="w0",service="worker"} 2.0',
        'lamina:service_restarts{instance="g1",service="gateway"} 0.0',
    } <= lines(agg)


def test_latencies_carry_their_requests_trace_as_an_exemplar_in_openmetrics():
    agg, _ = make_aggregator()
    agg.observe_request(make_record(ttft_s=0.03, e2e_s=0.2), trace_id="ab" * 16)
    agg.observe_request(make_record(ttft_s=0.04, e2e_s=0.3))  # untraced: no exemplar
    openmetrics = agg.render(openmetrics=True).decode()
    ttft = [
        line
        for line in openmetrics.splitlines()
        if "lamina:time_to_first_token_seconds_bucket" in line
    ]
    assert sum('# {trace_id="' + "ab" * 16 + '"}' in line for line in ttft) == 1
    e2e = [
        line
        for line in openmetrics.splitlines()
        if "lamina:e2e_request_latency_seconds_bucket" in line
    ]
    assert any("ab" * 16 in line for line in e2e)
    assert "trace_id" not in agg.render().decode()  # the classic text format has none


def test_each_processs_bus_errors_and_reconnects_as_it_last_reported_them():
    agg, _ = make_aggregator()
    agg.observe_bus(BusHealth(service="gateway", instance="gw-1", disconnects=1, reconnects=1))
    agg.observe_bus(BusHealth(service="gateway", instance="gw-1", disconnects=2, reconnects=2))
    agg.observe_bus(BusHealth(service="worker", instance="w1", errors=3))
    agg.observe_bus(BusHealth(service="gateway", instance="gw-2", refused=4))
    got = lines(agg)
    assert {
        'lamina:bus_reconnects_total{instance="gw-1",service="gateway"} 2.0',
        'lamina:bus_disconnects_total{instance="gw-1",service="gateway"} 2.0',
        'lamina:bus_errors_total{instance="w1",service="worker"} 3.0',
        'lamina:bus_refused_messages_total{instance="gw-2",service="gateway"} 4.0',
    } <= got


def test_the_n_of_a_group_of_sequences_is_counted_once():
    """Each of a request's ``n`` sequences is a request of its own; the first's record
    carries ``n``, the others 0, so vLLM's ``request_params_n`` sees the request once."""
    agg, _ = make_aggregator()
    for n in (3, 0, 0):
        agg.observe_request(make_record(n=n))
    m = 'model="tiny",worker_id="w1"'
    got = lines(agg)
    assert f"lamina:request_params_n_count{{{m}}} 1.0" in got
    assert f"lamina:request_params_n_sum{{{m}}} 3.0" in got
    assert f"lamina:e2e_request_latency_seconds_count{{{m}}} 3.0" in got
