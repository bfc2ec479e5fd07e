"""The Grafana dashboard asks only for metrics telemetry actually exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lamina.schemas.v1.records import PlacementRecord
from lamina.services.telemetry.metrics import Aggregator
from tests.telemetry.helpers import make_record, make_stats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/lamina.json"


def exposed_names() -> set[str]:
    aggregator = Aggregator()
    aggregator.observe_stats(make_stats())
    aggregator.observe_placement(
        PlacementRecord(
            request_id="r1",
            worker_id="w1",
            reason="placed",
            candidates=1,
            policy="kv",
            predicted_ttft_s=0.02,
        )
    )
    aggregator.observe_request(make_record())  # joins the prediction: an error is observed
    text = aggregator.render().decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_every_dashboard_query_names_an_exposed_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    referenced = {m for e in exprs for m in re.findall(r"lamina:[a-z0-9_]+", e)}
    assert referenced, "the dashboard queries nothing"
    missing = referenced - exposed_names()
    assert not missing, f"dashboard queries metrics telemetry does not expose: {missing}"
