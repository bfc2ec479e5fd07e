"""Lamina's Grafana dashboards, written as JSON into ``dashboards/`` (which Grafana's
provisioning reads). Edit the panels here, run ``python deploy/grafana/generate.py``, and
commit both; ``--check`` (a unit test runs it) fails when the JSON is not what this writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}
DASHBOARDS: dict[str, dict] = {}


def q(expr: str, legend: str, exemplar: bool = False) -> dict:
    return {"expr": expr, "legendFormat": legend, "exemplar": exemplar}


def quantiles(metric: str, exemplar: bool = False, qs=(0.5, 0.9, 0.99)) -> list[dict]:
    """p50/p90/p99 of a histogram over every series."""
    return [
        q(
            f"histogram_quantile({x}, sum by (le) (rate({metric}_bucket[1m])))",
            f"p{round(x * 100)}",
            exemplar,
        )
        for x in qs
    ]


def panel(title, targets, unit="short", description="", kind="timeseries", w=12, h=8, ds=PROM):
    return {
        "title": title,
        "type": kind,
        "description": description,
        "datasource": ds,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [dict(t, refId=chr(65 + i), datasource=ds) for i, t in enumerate(targets)],
        "w": w,
        "h": h,
    }


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> None:
    """Lay ``panels`` out two to a row (or one, if wide) and keep the dashboard."""
    x = y = 0
    for i, p in enumerate(panels, 1):
        w, h = p.pop("w"), p.pop("h")
        if x + w > 24:
            x, y = 0, y + 8
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        p["id"] = i
        x += w
    DASHBOARDS[uid] = {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["lamina"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "links": [
            {"type": "dashboards", "tags": ["lamina"], "asDropdown": False, "title": "Lamina"}
        ],
        "panels": panels,
        "templating": {"list": []},
        "annotations": {"list": []},
    }


dashboard(
    "lamina-requests",
    "Lamina / Requests",
    "What clients see: latency quantiles, throughput and how requests end.",
    [
        panel(
            "Time to first token",
            quantiles("lamina:time_to_first_token_seconds", exemplar=True),
            "s",
            "As the gateway measured it. Exemplars (dots) open the request's trace in Tempo.",
        ),
        panel("Inter-token latency", quantiles("lamina:inter_token_latency_seconds"), "s"),
        panel(
            "End-to-end latency",
            quantiles("lamina:e2e_request_latency_seconds", exemplar=True),
            "s",
            "Finished requests, from arrival at the gateway to the last token.",
        ),
        panel(
            "Tokens / s",
            [
                q("sum(rate(lamina:generation_tokens_total[1m]))", "generated"),
                q("sum(rate(lamina:prompt_tokens_total[1m]))", "prompt"),
            ],
            "short",
        ),
        panel(
            "Requests / s by outcome",
            [q("sum by (outcome) (rate(lamina:request_outcome_total[1m]))", "{{outcome}}")],
            "reqps",
        ),
        panel(
            "Finish reasons",
            [
                q(
                    "sum by (finished_reason) (rate(lamina:request_success_total[1m]))",
                    "{{finished_reason}}",
                )
            ],
            "reqps",
            "Requests a worker took, by how they ended (abort: the client left).",
        ),
        panel(
            "Time to a worker's acceptance",
            quantiles("lamina:request_accept_latency_seconds", qs=(0.5, 0.99)),
            "s",
            "From the gateway's submission to Accepted: the scheduler's decision, its queue and the hops.",
        ),
        panel(
            "Moves and retries / s",
            [
                q("sum(rate(lamina:request_moves_total[5m]))", "moved mid-stream"),
                q(
                    "sum(rate(lamina:request_inexact_moves_total[5m]))",
                    "moved to other numerics",
                ),
                q("sum(rate(lamina:request_retries_total[5m]))", "retried before acceptance"),
            ],
            "reqps",
        ),
    ],
)

dashboard(
    "lamina-workers",
    "Lamina / Workers and KV cache",
    "The engines: load, KV cache, prefix hits, preemptions and where a request's time goes.",
    [
        panel(
            "Workers live",
            [
                q("lamina:cluster_workers_live", "live"),
                q("sum by (state) (lamina:worker_state)", "{{state}}"),
            ],
            "short",
        ),
        panel(
            "Running and waiting per worker",
            [
                q("lamina:num_requests_running", "{{worker_id}} running"),
                q("lamina:num_requests_waiting", "{{worker_id}} waiting"),
            ],
            "short",
        ),
        panel("KV cache usage", [q("lamina:kv_cache_usage_perc", "{{worker_id}}")], "percentunit"),
        panel(
            "Prefix cache hit rate",
            [
                q(
                    "sum by (worker_id) (rate(lamina:prefix_cache_hits_total[5m])) / sum by (worker_id) (rate(lamina:prefix_cache_queries_total[5m]))",
                    "{{worker_id}}",
                )
            ],
            "percentunit",
            "Prompt tokens found cached over prompt tokens looked up.",
        ),
        panel(
            "Preemptions / s",
            [q("sum by (worker_id) (rate(lamina:num_preemptions_total[5m]))", "{{worker_id}}")],
            "short",
        ),
        panel(
            "Queued prefill tokens",
            [q("lamina:num_queued_prefill_tokens", "{{worker_id}}")],
            "short",
        ),
        panel(
            "Engine phases (p50)",
            [
                q(
                    "histogram_quantile(0.5, sum by (le) (rate(lamina:request_queue_time_seconds_bucket[5m])))",
                    "queue",
                ),
                q(
                    "histogram_quantile(0.5, sum by (le) (rate(lamina:request_prefill_time_seconds_bucket[5m])))",
                    "prefill",
                ),
                q(
                    "histogram_quantile(0.5, sum by (le) (rate(lamina:request_decode_time_seconds_bucket[5m])))",
                    "decode",
                ),
            ],
            "s",
            "vLLM's request phases, measured in the engine that finished the request.",
        ),
        panel(
            "Tokens per engine step",
            [
                q(
                    "sum by (worker_id) (rate(lamina:iteration_tokens_total_sum[1m])) / sum by (worker_id) (rate(lamina:iteration_tokens_total_count[1m]))",
                    "{{worker_id}}",
                )
            ],
            "short",
        ),
        panel(
            "NATS connections: errors, disconnects, reconnects (5 min)",
            [
                q("sum by (service) (increase(lamina:bus_errors_total[5m]))", "{{service}} errors"),
                q(
                    "sum by (service) (increase(lamina:bus_disconnects_total[5m]))",
                    "{{service}} disconnects",
                ),
                q(
                    "sum by (service) (increase(lamina:bus_reconnects_total[5m]))",
                    "{{service}} reconnects",
                ),
            ],
            "short",
            "Each process's bus connection, as it reports it (every service, telemetry included).",
        ),
    ],
)

dashboard(
    "lamina-placement",
    "Lamina / Placement",
    "The schedulers' decisions: how many and why, how fast, how good their predictions were, their queues.",
    [
        panel(
            "Placements / s by reason",
            [
                q(
                    "sum by (policy, reason) (rate(lamina:placements_total[1m]))",
                    "{{policy}} {{reason}}",
                )
            ],
            "reqps",
        ),
        panel("Decision time", quantiles("lamina:placement_decision_seconds", qs=(0.5, 0.99)), "s"),
        panel(
            "Predicted vs measured TTFT (p50)",
            [
                q(
                    "histogram_quantile(0.5, sum by (le) (rate(lamina:predicted_time_to_first_token_seconds_bucket[5m])))",
                    "predicted",
                ),
                q(
                    "histogram_quantile(0.5, sum by (le) (rate(lamina:time_to_first_token_seconds_bucket[5m])))",
                    "measured",
                ),
            ],
            "s",
        ),
        panel(
            "TTFT prediction error (p90, measured minus predicted)",
            [
                q(
                    "histogram_quantile(0.9, sum by (le, worker_id) (rate(lamina:ttft_prediction_error_seconds_bucket[5m])))",
                    "{{worker_id}}",
                )
            ],
            "s",
        ),
        panel(
            "Scheduler queue depth",
            [q("lamina:scheduler_queue_depth", "{{scheduler_id}}")],
            "short",
        ),
        panel(
            "Scheduler queue wait",
            [
                q(
                    "histogram_quantile(0.9, sum by (le, reason) (rate(lamina:scheduler_queue_wait_seconds_bucket[5m])))",
                    "p90 {{reason}}",
                )
            ],
            "s",
            "Requests that waited in a scheduler's queue, by how they left it.",
        ),
    ],
)

dashboard(
    "lamina-traces",
    "Lamina / Traces",
    "The slowest requests' traces and the service graph, from Tempo.",
    [
        panel(
            "Slowest requests",
            [
                {
                    "queryType": "traceql",
                    "limit": 20,
                    "tableType": "traces",
                    "query": '{ resource.service.name = "gateway" && name =~ "generate .*" } | select(span.gen_ai.usage.output_tokens, span.lamina.outcome)',
                }
            ],
            "s",
            "Gateway request spans of the last 30 minutes; sort by duration, click to open.",
            kind="table",
            w=24,
            h=10,
            ds=TEMPO,
        ),
        panel(
            "Service graph",
            [{"queryType": "serviceMap"}],
            "short",
            "Calls between services, from the span metrics Tempo writes to Prometheus.",
            kind="nodeGraph",
            w=24,
            h=12,
            ds=TEMPO,
        ),
    ],
)


def main(argv: list[str]) -> int:
    stale = []
    for uid, board in DASHBOARDS.items():
        path, text = OUT / f"{uid}.json", json.dumps(board, indent=2) + "\n"
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run deploy/grafana/generate.py): {stale}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
