"""``deploy/kubernetes/`` agrees with the code, checked without a cluster: every container
runs a real ``lamina`` service whose own parser takes its flags and variables, probes hit
``/health`` and ``/ready`` on the port the service is told to serve them on, workers ask
for a GPU and may drain before they are killed, every credential is one ``lamina creds
init`` makes, and the NATS chart's values admit exactly those credentials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lamina.libs.config import ENV_PREFIX, parse_config, settings
from lamina.libs.nats_auth import DEPLOYMENT, USERS_FILE
from lamina.libs.nats_server import ROUTE_USER
from lamina.services import cli
from tests.unit.test_compose import PROCESS_WIDE_ENV, STANDARD_ENV, flag_fields, service_config

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy/kubernetes/lamina.yaml"
NATS_VALUES = yaml.safe_load((ROOT / "deploy/kubernetes/nats-values.yaml").read_text())
DOCS = list(yaml.safe_load_all(MANIFEST.read_text()))
DEPLOYMENTS = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "Deployment"}
SECRET = "lamina-nats"


def container(name: str) -> dict[str, Any]:
    (only,) = DEPLOYMENTS[name]["spec"]["template"]["spec"]["containers"]
    return only


def plain_env(spec: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


def test_a_deployment_per_service_with_replicas_on_several_nodes():
    services = {container(name)["args"][0] for name in DEPLOYMENTS}
    assert services == set(cli.SERVICES)
    for name, deployment in DEPLOYMENTS.items():
        assert deployment["spec"]["replicas"] >= 2, f"{name}: one replica is a single point"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_flags_and_env_are_fields_of_the_service_config(name: str) -> None:
    spec = container(name)
    service, argv = spec["args"][0], spec["args"][1:]
    config_type = service_config(service)
    fields = {s.name: s for s in settings(config_type)}
    assert not set(flag_fields(argv)) - fields.keys(), f"{name}: unknown flags in {argv}"
    names = {e["name"] for e in spec.get("env", [])}
    for key in names - STANDARD_ENV:
        assert key.startswith(ENV_PREFIX), f"{name}: {key} is not a LAMINA_* variable"
        assert key in PROCESS_WIDE_ENV or key.removeprefix(ENV_PREFIX).lower() in fields, key
    env = {k: v for k, v in plain_env(spec).items() if k.startswith(ENV_PREFIX)}
    config = parse_config(config_type, argv, prog=f"lamina {service}", env=env)
    for field, raw in flag_fields(argv).items():
        value = fields[field].value(config)
        if raw:  # "" is a bare --flag
            assert str(value) == raw or (isinstance(value, float) and value == float(raw))
    # Every node of the chart's cluster, in order (the services fail over along it).
    replicas = NATS_VALUES["config"]["cluster"]["replicas"]
    assert config.nats.nats_url.split(",") == [
        f"nats://nats-{i}.nats-headless:4222" for i in range(replicas)
    ]


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_probes_hit_health_and_ready_where_the_service_serves_them(name: str) -> None:
    spec = container(name)
    argv = flag_fields(spec["args"][1:])
    port = int(argv.get("http_port") or argv["health_port"])
    assert spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    if "http_port" in argv:
        assert argv["http_host"] == "0.0.0.0", f"{name}: probes come from outside the pod"


def test_workers_get_a_gpu_their_pod_name_and_the_time_to_drain() -> None:
    spec = container("lamina-worker")
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    argv = flag_fields(spec["args"][1:])
    assert argv["device"] == "cuda"
    pod = DEPLOYMENTS["lamina-worker"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > float(argv["drain_timeout"])
    worker_id = next(e for e in spec["env"] if e["name"] == "LAMINA_WORKER_ID")
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert spec["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_service_connects_as_its_role_from_the_secret(name: str) -> None:
    spec = container(name)
    credential = Path(plain_env(spec)["LAMINA_NATS_CREDENTIAL"])
    (mount,) = spec["volumeMounts"]
    assert str(credential.parent) == mount["mountPath"] and mount["readOnly"]
    role = spec["args"][0]
    assert credential.stem == role and (role in DEPLOYMENT or role == "worker")
    (volume,) = DEPLOYMENTS[name]["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"] and volume["secret"]["secretName"] == SECRET


def test_the_nats_chart_admits_the_secrets_users_and_authenticates_routes() -> None:
    config = NATS_VALUES["config"]
    assert config["cluster"]["enabled"] and config["cluster"]["replicas"] >= 3
    assert config["cluster"]["routeURLs"]["user"] == ROUTE_USER
    # The chart turns "$include" keys into include directives relative to /etc/nats-config.
    included = config["merge"]["authorization"]["$include"]
    (mount,) = [p["value"] for p in NATS_VALUES["container"]["patch"]]
    assert f"/etc/nats-config/{included}" == f"{mount['mountPath']}/{USERS_FILE}"
    (volume,) = [p["value"] for p in NATS_VALUES["podTemplate"]["patch"]]
    assert volume["name"] == mount["name"] and volume["secret"]["secretName"] == SECRET
    assert volume["secret"]["items"] == [{"key": USERS_FILE, "path": USERS_FILE}]
