"""The observability profile's pieces agree with each other and with the code.

The collector, Tempo and Grafana have no package or image that can be had here, so they
are not run (Prometheus is: ``tests/e2e/test_prometheus.py``, ``test_compose.py``). What
is checked is every address, port, datasource uid and label one file names and another
must serve, against the formats of the pinned versions (collector 0.116, Tempo 2.6,
Grafana 11.3)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import yaml

from tests.unit.test_compose import LAMINA_SERVICES, SERVICES, default_of, environment

ROOT = Path(__file__).resolve().parents[2]
COLLECTOR = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
TEMPO = yaml.safe_load((ROOT / "deploy/tempo.yaml").read_text())
DATASOURCES = {
    d["uid"]: d
    for d in yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
}


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_every_lamina_service_exports_to_the_collectors_otlp_http_receiver():
    receiver = COLLECTOR["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for name in LAMINA_SERVICES:
        url = urlparse(default_of(environment(SERVICES[name])["OTEL_EXPORTER_OTLP_ENDPOINT"]))
        assert (url.hostname, url.port) == ("otel-collector", port_of(receiver)), name


def test_the_collectors_pipeline_is_wired_to_tempos_receiver():
    (pipeline,) = COLLECTOR["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(COLLECTOR[kind]), kind
    (exporter,) = pipeline["exporters"]
    host, port = COLLECTOR["exporters"][exporter]["endpoint"].split(":")
    grpc = TEMPO["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert host == "tempo" and exporter.startswith("otlp") and int(port) == port_of(grpc)
    assert "tempo" in SERVICES["otel-collector"]["depends_on"]


def test_tempo_writes_its_span_metrics_to_a_prometheus_that_accepts_them():
    (write,) = TEMPO["metrics_generator"]["storage"]["remote_write"]
    url = urlparse(write["url"])
    assert url.hostname == "prometheus" and url.path == "/api/v1/write"
    flags = SERVICES["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in flags
    assert "--enable-feature=exemplar-storage" in flags
    processors = TEMPO["overrides"]["defaults"]["metrics_generator"]["processors"]
    assert {"service-graphs", "span-metrics"} <= set(processors)


def test_grafana_links_metrics_to_traces_and_back():
    prometheus, tempo = DATASOURCES["prometheus"], DATASOURCES["tempo"]
    assert urlparse(tempo["url"]).port == TEMPO["server"]["http_listen_port"]
    # The exemplar label telemetry writes (services/telemetry/metrics.py) opens Tempo.
    (destination,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": "tempo"}
    assert tempo["jsonData"]["serviceMap"]["datasourceUid"] == "prometheus"
    assert tempo["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"


def test_third_party_images_are_pinned():
    for name in ("otel-collector", "tempo", "prometheus", "grafana", "nats"):
        image = default_of(SERVICES[name]["image"])
        assert ":" in image and not image.endswith(":latest"), name


def test_the_traces_dashboard_searches_the_gateways_request_spans():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/lamina-traces.json").read_text())
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert {t["queryType"] for t in targets} == {"traceql", "serviceMap"}
    (search,) = [t["query"] for t in targets if t["queryType"] == "traceql"]
    # The gateway's service name and request span (libs/telemetry_setup.py,
    # services/gateway/remote_request.py).
    assert 'resource.service.name = "gateway"' in search and '"generate .*"' in search
