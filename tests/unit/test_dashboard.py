"""The Grafana dashboards ask only for metrics telemetry actually exposes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.schemas.v1.generate import EngineTimings
from lamina.schemas.v1.records import BusHealth, PlacementRecord
from lamina.schemas.v1.stats import ITERATION_TOKEN_BUCKETS
from lamina.services.telemetry.metrics import Aggregator
from tests.telemetry.helpers import make_record, make_stats

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))


def exposed_names() -> set[str]:
    aggregator = Aggregator()
    aggregator.observe_stats(make_stats(iteration_tokens=[1] * (len(ITERATION_TOKEN_BUCKETS) + 1)))
    aggregator.observe_placement(
        PlacementRecord(
            request_id="r1",
            worker_id="w1",
            reason="placed",
            candidates=1,
            policy="kv",
            predicted_ttft_s=0.02,
            decision_s=0.0002,
            queued_s=0.1,
            scheduler_id="s1",
        )
    )
    aggregator.observe_bus(BusHealth(service="gateway", instance="gw-1"))
    timings = EngineTimings(queued_s=0.01, prefill_s=0.02, decode_s=0.1)
    # joins the prediction: an error is observed
    aggregator.observe_request(make_record(timings=timings, accept_s=0.001, max_tokens=8))
    text = aggregator.render().decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_dashboard_query_names_an_exposed_metric(path):
    dashboard = json.loads(path.read_text())
    exprs = [t.get("expr", "") for panel in dashboard["panels"] for t in panel["targets"]]
    referenced = {m for e in exprs for m in re.findall(r"lamina:[a-z0-9_]+", e)}
    missing = referenced - exposed_names()
    assert not missing, f"dashboard queries metrics telemetry does not expose: {missing}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_queries_a_provisioned_datasource(path):
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] == path.stem and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in ("prometheus", "tempo"), panel["title"]


def test_the_dashboards_are_what_their_generator_writes():
    generate = ROOT / "deploy/grafana/generate.py"
    result = subprocess.run([sys.executable, generate, "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
