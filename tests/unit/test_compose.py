"""``compose.yaml`` and the ``Dockerfile`` agree with the code, checked without Docker.

Every Lamina container runs a real ``lamina`` subcommand, every ``--flag`` it passes is a
field of that service's config (parsed by the same ``parse_config`` the service uses), and
every ``LAMINA_*`` variable it sets names such a field.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lamina.libs.config import ENV_PREFIX, parse_config, settings
from lamina.libs.nats_auth import DEPLOYMENT
from lamina.services import cli, creds

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

#: Services that run someone else's image, not ours.
THIRD_PARTY = {"nats", "otel-collector", "tempo", "prometheus", "grafana"}
#: The stack: each runs ``lamina <service>``.
LAMINA_SERVICES = {"scheduler", "gateway", "worker", "telemetry"}
#: Runs once, before NATS: ``lamina creds init`` into the credential volume.
CREDENTIALS = "credentials"
#: ``LAMINA_*`` variables read process-wide (libs, default model), not config fields.
PROCESS_WIDE_ENV = {"LAMINA_HOME", "LAMINA_LOG_LEVEL", "LAMINA_TRACE_FILE"}
#: OpenTelemetry's standard variables (``libs/telemetry_setup.py`` reads them).
STANDARD_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"}


def default_of(value: str) -> str:
    """What compose makes of ``${VAR:-default}`` (or ``${VAR-default}``) with VAR unset."""
    match = re.fullmatch(r"\$\{\w+:?-(.*)\}", value)
    return match.group(1) if match else value


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


SERVICES = load_compose()
BUILT = sorted(name for name, spec in SERVICES.items() if "build" in spec)


def environment(spec: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (compose allows a mapping or ``KEY=VALUE`` items)."""
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def top_level_commands(capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The subcommands ``lamina --help`` lists (``{gateway,scheduler,...,generate}``)."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    return set(re.search(r"\{([\w,-]+)\}", usage).group(1).split(","))


def service_config(name: str) -> type:
    """The config dataclass the service's entry point parses."""
    module = importlib.import_module(cli.SERVICES[name])
    configs = [
        obj
        for key, obj in vars(module).items()
        if key.endswith("Config") and dataclasses.is_dataclass(obj) and isinstance(obj, type)
    ]
    assert len(configs) == 1, f"{cli.SERVICES[name]}: expected one *Config class, got {configs}"
    return configs[0]


def flag_fields(argv: list[str]) -> dict[str, str]:
    """``["--http-port", "8000"]`` → ``{"http_port": "8000"}`` (``--no-x`` → ``{"x": ...}``)."""
    fields, i = {}, 0
    while i < len(argv):
        token = argv[i]
        assert token.startswith("--"), f"unexpected positional argument {token!r} in {argv}"
        name = token[2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            fields[name], i = argv[i + 1], i + 2
        else:
            fields[name.removeprefix("no_")], i = "", i + 1
    return fields


def test_the_stack_is_all_there() -> None:
    assert set(BUILT) == LAMINA_SERVICES | {CREDENTIALS}
    assert set(SERVICES) - set(BUILT) <= THIRD_PARTY, "an unknown service without a build"


@pytest.mark.parametrize("name", BUILT)
def test_runs_a_real_lamina_subcommand(name: str, capsys) -> None:
    command = SERVICES[name].get("command")
    assert isinstance(command, list) and command, f"{name}: command must be a non-empty list"
    assert command[0] in cli.SERVICES or command[0] in top_level_commands(capsys), (
        f"{name}: `lamina {command[0]}` is not a lamina subcommand"
    )
    if name in cli.SERVICES:
        assert command[0] == name


@pytest.mark.parametrize("name", sorted(LAMINA_SERVICES))
def test_is_built_from_the_dockerfile_and_waits_for_nats(name: str) -> None:
    spec = SERVICES[name]
    build = spec["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    assert (ROOT / context / dockerfile).resolve() == DOCKERFILE
    depends_on = spec.get("depends_on") or []
    assert "nats" in depends_on
    assert environment(spec).get("LAMINA_NATS_URL") == "nats://nats:4222"


@pytest.mark.parametrize("name", sorted(LAMINA_SERVICES & set(cli.SERVICES)))
def test_flags_and_env_are_fields_of_the_service_config(name: str) -> None:
    spec = SERVICES[name]
    config_type = service_config(name)
    fields = {s.name: s for s in settings(config_type)}
    argv, env = spec["command"][1:], environment(spec)

    unknown_flags = sorted(set(flag_fields(argv)) - fields.keys())
    assert not unknown_flags, f"{name}: {unknown_flags} are not fields of {config_type.__name__}"
    for key in env.keys() - STANDARD_ENV:
        assert key.startswith(ENV_PREFIX), f"{name}: {key} is not a LAMINA_* variable"
        assert key in PROCESS_WIDE_ENV or key.removeprefix(ENV_PREFIX).lower() in fields, (
            f"{name}: {key} matches no field of {config_type.__name__}"
        )

    # The service's own parser takes the command line and environment as compose gives them.
    lamina_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    config = parse_config(config_type, argv, prog=f"lamina {name}", env=lamina_env)
    for field, raw in flag_fields(argv).items():
        if raw:
            assert str(fields[field].value(config)) == raw
    assert config.nats.nats_url == "nats://nats:4222"


def test_nats_admits_exactly_the_credentials_the_services_use() -> None:
    """``credentials`` makes the identities and the server's configuration; the server
    reads that configuration, and each service connects with one of those identities."""
    init = creds.parse(SERVICES[CREDENTIALS]["command"][1:])
    volume = SERVICES[CREDENTIALS]["volumes"][0].split(":")[1]
    assert init.command == "init" and str(init.dir) == volume
    made = set(DEPLOYMENT) | set(init.identities)
    nats = SERVICES["nats"]
    assert nats["command"][nats["command"].index("-c") + 1] == f"{volume}/server.conf"
    assert SERVICES["nats"]["depends_on"][CREDENTIALS]["condition"] == (
        "service_completed_successfully"
    )
    for name in sorted(LAMINA_SERVICES):
        credential = Path(environment(SERVICES[name])["LAMINA_NATS_CREDENTIAL"])
        assert str(credential.parent) == volume and credential.suffix == ".nk", name
        assert credential.stem in made, f"{name} connects as {credential.stem}, never made"
        assert f"{volume}:ro" in " ".join(SERVICES[name]["volumes"])


def test_worker_scales() -> None:
    worker = SERVICES["worker"]
    assert "container_name" not in worker, "a fixed name stops `--scale worker=N`"
    assert not worker.get("ports"), "a fixed host port stops `--scale worker=N`"


@pytest.mark.parametrize("name", [n for n in BUILT if "--http-port" in SERVICES[n]["command"]])
def test_http_services_publish_their_port_and_check_health(name: str) -> None:
    spec, command = SERVICES[name], SERVICES[name]["command"]
    port = command[command.index("--http-port") + 1]
    assert command[command.index("--http-host") + 1] == "0.0.0.0", "reachable from outside"
    assert any(str(p).endswith(f":{port}") for p in spec.get("ports", []))
    test = " ".join(spec["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in test


def test_nats_runs_jetstream_with_monitoring() -> None:
    nats = SERVICES["nats"]
    assert default_of(nats["image"]).startswith("nats:2.10")
    command = nats["command"]
    assert "-js" in command
    assert command[command.index("-m") + 1] == "8222"
    assert "${LAMINA_NATS_MONITOR_PORT:-8222}:8222" in nats["ports"]


def test_every_published_host_port_can_be_moved_by_a_variable() -> None:
    for name, spec in SERVICES.items():
        for published in spec.get("ports", []):
            host = str(published).rsplit(":", 1)[0]
            assert re.fullmatch(r"\$\{[A-Z_]+:-\d+\}", host), (name, published)


def test_prometheus_scrapes_telemetry() -> None:
    mounts = [v.split(":") for v in SERVICES["prometheus"]["volumes"]]
    local = next(src for src, dst, *_ in mounts if dst == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / local).read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    telemetry = SERVICES["telemetry"]["command"]
    assert f"telemetry:{telemetry[telemetry.index('--http-port') + 1]}" in targets


def test_dockerfile_installs_the_project_and_runs_lamina_unprivileged() -> None:
    lines = [
        line.strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"
    assert [line for line in lines if line.startswith("FROM ")] == [
        "FROM ${BASE_IMAGE} AS dependencies",
        "FROM ${BASE_IMAGE}",
    ]
    text = "\n".join(lines)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text, "CPU torch"
    assert "pip install --no-deps ." in text
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    model_init = next(i for i, line in enumerate(lines) if "lamina model init" in line)
    user_set = next(i for i, line in enumerate(lines) if line.startswith("USER "))
    assert user_set < model_init, "the model belongs to the runtime user"
    assert 'ENTRYPOINT ["lamina"]' in lines
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_grafana_is_provisioned_from_the_repo() -> None:
    mounts = dict(v.rsplit(":", 2)[:2] for v in SERVICES["grafana"]["volumes"])
    for local in mounts:
        assert (ROOT / local).is_dir(), local
    assert len(list((ROOT / "deploy/grafana/dashboards").glob("lamina-*.json"))) == 4
    source = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    urls = {d["uid"]: d["url"] for d in source["datasources"]}
    assert urls == {"prometheus": "http://prometheus:9090", "tempo": "http://tempo:3200"}


def test_built_images_take_their_base_and_torch_index_from_the_environment() -> None:
    """``deploy/images/build.sh`` points compose at images built without a registry."""
    for name in BUILT:
        build = SERVICES[name]["build"]
        assert default_of(build["args"]["BASE_IMAGE"]) == "python:3.11-slim"
        assert build["args"]["TORCH_INDEX_URL"].startswith("${LAMINA_TORCH_INDEX_URL-")
        assert build["network"] == "host"
    written = (ROOT / "deploy/images/build.sh").read_text()
    for variable in ("LAMINA_BASE_IMAGE", "LAMINA_TORCH_INDEX_URL", "NATS_IMAGE"):
        assert f"{variable}=" in written
    assert "PROMETHEUS_IMAGE=" in written
    assert SERVICES["prometheus"]["image"].startswith("${PROMETHEUS_IMAGE:-prom/prometheus:")
