"""``lamina node``: one host's share of a stack that spans several hosts.

Each host runs one NATS node, routed to every other host's (a NATS cluster: a message
published on any node reaches subscribers on all of them), and whichever services the
operator puts there: gateway and scheduler replicas on a few hosts, telemetry on one or
more, engine workers on every GPU host. Every service connects to its own host's node
first and to the other nodes after it, so it reconnects elsewhere when its node is lost.
The all-in-one ``lamina up`` stays the default for one machine; this is the same
supervisor (:class:`~lamina.services.launcher.Stack`) with a cluster around it::

    lamina node --address 10.0.0.1 --peers 10.0.0.2,10.0.0.3 --services gateway,scheduler,worker
    lamina node --address 10.0.0.2 --peers 10.0.0.1,10.0.0.3 --services gateway,scheduler,worker
    lamina node --address 10.0.0.3 --peers 10.0.0.1,10.0.0.2 --services telemetry,worker

With the bus closed (the default) every host holds a copy of one credential store: make
it once on one host (``lamina creds init`` with every host's worker identities,
``worker.<node>-worker-<i>``) and copy ``LAMINA_HOME/nats`` to the others. Its route
secret is what the NATS nodes admit each other's routes with.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import sys
from dataclasses import dataclass

from lamina.libs.config import option, parse_config
from lamina.libs.nats_server import NatsCluster
from lamina.schemas.v1 import subjects
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.launcher import SERVICES, UpConfig, nats_banner, preflight, serve, stack_of


@dataclass(frozen=True)
class NodeConfig(UpConfig):
    """Run one host's share of a multi-host stack: its NATS node, routed to the other
    hosts' nodes, and the services named by --services. Every flag of `lamina up` applies
    to this host's services."""

    http_host: str = option("", "address the gateway and telemetry listen on (default: --address)")
    address: str = option(
        "", "this host's address, where the other hosts reach its NATS node (required)"
    )
    peers: str = option(
        "",
        "the other hosts, comma-separated: address[:nats_port[:cluster_port]] "
        "(ports default to this host's --nats-port and --cluster-port)",
    )
    cluster_port: int = option(6222, "port this host's NATS node takes the other nodes' routes on")
    cluster_advertise: str = option(
        "", "host:port the other nodes reach this node's routes at, if not --address:--cluster-port"
    )
    node_name: str = option(
        "", "this host's name: its NATS server's, and its workers' ids <name>-worker-<i> "
        "(default: the host name)"
    )  # fmt: skip
    services: str = option(
        "gateway,scheduler,telemetry,worker",
        "the services this host runs, comma-separated (may be empty with --pipeline-stage)",
    )
    pipeline_stage: str = option(
        "",
        "pipeline stages this host runs for workers on other hosts, comma-separated "
        "<worker id>:<stage> (each worker runs with --remote-pipeline-stages), with this "
        "host's --model and --device",
    )


@dataclass(frozen=True)
class Peer:
    """Another host of the cluster, where its NATS node listens."""

    address: str
    nats_port: int
    cluster_port: int


def parse_peers(text: str, nats_port: int, cluster_port: int) -> list[Peer]:
    """``address[:nats_port[:cluster_port]]``, comma-separated; raises ValueError."""
    peers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        address, *ports = item.split(":")
        if not address or len(ports) > 2 or not all(port.isdigit() for port in ports):
            raise ValueError(f"{item!r} is not address[:nats_port[:cluster_port]] (--peers)")
        numbers = [int(port) for port in ports] + [nats_port, cluster_port][len(ports) :]
        peers.append(Peer(address, numbers[0], numbers[1]))
    return peers


def node_name(config: NodeConfig) -> str:
    """The configured name, else the host name made into a subject token."""
    return config.node_name or re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())


def parse_stages(text: str) -> list[tuple[str, int]]:
    """``<worker id>:<stage>``, comma-separated; raises ValueError."""
    stages = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        worker, _, stage = item.rpartition(":")
        if not re.fullmatch(subjects.TOKEN, worker) or not stage.isdigit() or int(stage) < 1:
            raise ValueError(
                f"{item!r} is not <worker id>:<stage>, a stage from 1 (--pipeline-stage)"
            )
        stages.append((worker, int(stage)))
    return stages


def services_of(config: NodeConfig) -> frozenset[str]:
    return frozenset(filter(None, (part.strip() for part in config.services.split(","))))


def check(config: NodeConfig) -> str | None:
    """What is wrong with ``config`` as a node's, before anything starts; None if fine."""
    services = services_of(config)
    if not services <= SERVICES or not (services or config.pipeline_stage):
        return f"--services: {config.services!r}; each one of {', '.join(sorted(SERVICES))}"
    if not config.address:
        return "--address is required: the address the other hosts reach this one at"
    if config.nats_url and config.peers:
        return "--nats-url and --peers exclude each other: join a cluster, or be a node of it"
    if not config.nats_url and not config.peers:
        return "--peers is required (the other hosts), unless --nats-url names the cluster"
    if not re.fullmatch(subjects.TOKEN, node_name(config)):
        return f"--node-name {node_name(config)!r}: letters, digits, '-' and '_' only"
    try:
        parse_stages(config.pipeline_stage)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    config = parse_config(NodeConfig, argv, prog="lamina node")
    problem = check(config)
    try:
        peers = parse_peers(config.peers, config.nats_port, config.cluster_port)
    except ValueError as exc:
        problem = problem or str(exc)
    if problem is not None:
        print(f"lamina node: {problem}", file=sys.stderr)
        return 2
    if not config.engine.distributed_address:  # its workers' remote ranks reach it here
        engine = dataclasses.replace(config.engine, distributed_address=config.address)
        config = dataclasses.replace(config, engine=engine)
    name, services = node_name(config), services_of(config)
    stages = parse_stages(config.pipeline_stage)  # checked
    workers = config.workers if "worker" in services else 0
    http_host = config.http_host or config.address
    model = config.engine.model or ensure_default_model()
    ports = [
        ("--http-port", http_host, config.http_port if "gateway" in services else 0),
        ("--metrics-port", http_host, config.metrics_port if "telemetry" in services else 0),
    ]
    if not config.nats_url:
        ports += [
            ("--nats-port", config.address, config.nats_port),
            ("--cluster-port", config.address, config.cluster_port),
        ]
    problem = preflight(config, model, ports)
    if problem is not None:
        print(f"lamina node: {problem}", file=sys.stderr)
        return 2
    scheme = "tls" if config.nats_tls_cert else "nats"
    cluster = NatsCluster(
        server_name=name,
        host=config.address,
        port=config.cluster_port,
        routes=tuple(f"{peer.address}:{peer.cluster_port}" for peer in peers),
        advertise=config.cluster_advertise,
    )
    stack = stack_of(
        config,
        model,
        http_host=http_host,
        services=services,
        nats_host=config.address,
        cluster=None if config.nats_url else cluster,
        peer_urls=tuple(f"{scheme}://{peer.address}:{peer.nats_port}" for peer in peers),
        worker_prefix=f"{name}-worker",
        scheduler_id=name,
        workers=workers,
        stages=tuple(stages),
        stage_device=config.engine.device,
        host_name=name,
    )
    return serve(
        stack,
        "lamina node",
        lambda: [
            f"Lamina node {name} is up: {', '.join(sorted(services))}; {workers} worker(s)"
            + "".join(f"; stage {stage} of {worker}" for worker, stage in stages),
            *([f"  OpenAI API   {stack.base_url}/v1"] if "gateway" in services else []),
            *nats_banner(stack),
            *([f"  metrics      {stack.metrics_url}"] if "telemetry" in services else []),
            f"  cluster      {config.address}:{config.cluster_port}, routes to "
            + ", ".join(cluster.routes or ("(none: --nats-url)",)),
        ],
    )


__all__ = ["NodeConfig", "Peer", "check", "main", "parse_peers", "parse_stages"]
