"""``lamina node``'s flags and its NATS node's cluster block (nothing is started)."""

from __future__ import annotations

import pytest

from lamina.libs.config import parse_config
from lamina.libs.nats_server import ROUTE_USER, NatsCluster
from lamina.services import node
from lamina.services.node import NodeConfig, Peer, parse_peers, parse_stages


def test_peers_take_this_hosts_ports_unless_they_name_their_own():
    assert parse_peers("10.0.0.2, 10.0.0.3:4333,10.0.0.4:4444:6444", 4222, 6222) == [
        Peer("10.0.0.2", 4222, 6222),
        Peer("10.0.0.3", 4333, 6222),
        Peer("10.0.0.4", 4444, 6444),
    ]
    assert parse_peers("", 4222, 6222) == []


@pytest.mark.parametrize("bad", ["10.0.0.2:x", ":4222", "h:1:2:3"])
def test_a_malformed_peer_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="--peers"):
        parse_peers(bad, 4222, 6222)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--peers", "10.0.0.2"], "--address is required"),
        (["--address", "10.0.0.1"], "--peers is required"),
        (["--address", "a", "--peers", "b", "--nats-url", "nats://c"], "exclude each other"),
        (["--address", "a", "--peers", "b", "--services", "gateway,cache"], "--services"),
        (["--address", "a", "--peers", "b", "--node-name", "host.one"], "--node-name"),
        (["--address", "a", "--peers", "b", "--services", ""], "--services"),
        (["--address", "a", "--peers", "b", "--pipeline-stage", "w-0"], "--pipeline-stage"),
        (["--address", "a", "--peers", "b", "--pipeline-stage", "w-0:0"], "--pipeline-stage"),
    ],
)
def test_a_node_that_cannot_work_is_refused_before_anything_starts(argv, problem, capsys):
    assert node.check(parse_config(NodeConfig, argv, env={})) is not None
    assert node.main(argv) == 2
    assert problem in capsys.readouterr().err


def test_a_valid_node_passes_its_checks():
    argv = ["--address", "10.0.0.1", "--peers", "10.0.0.2", "--services", "worker"]
    assert node.check(parse_config(NodeConfig, argv, env={})) is None
    # A host that only runs another host's worker's pipeline stage.
    argv = ["--address", "10.0.0.2", "--peers", "10.0.0.1", "--services", ""]
    argv += ["--pipeline-stage", "a-worker-0:1"]
    assert node.check(parse_config(NodeConfig, argv, env={})) is None


def test_pipeline_stages_name_a_worker_and_a_stage_after_its_first():
    assert parse_stages("a-worker-0:1, a-worker-1:2") == [("a-worker-0", 1), ("a-worker-1", 2)]
    assert parse_stages("") == []


def test_the_cluster_block_routes_to_every_peer_and_authenticates_routes_with_the_secret():
    cluster = NatsCluster("a", "10.0.0.1", 6222, ("10.0.0.2:6222", "10.0.0.3:6222"))
    text = cluster.config("s3cret")
    assert 'server_name: "a"' in text
    assert 'listen: "10.0.0.1:6222"' in text
    assert f'"nats-route://{ROUTE_USER}:s3cret@10.0.0.2:6222"' in text
    assert f'"nats-route://{ROUTE_USER}:s3cret@10.0.0.3:6222"' in text
    assert f'authorization {{user: "{ROUTE_USER}", password: "s3cret"}}' in text
    open_bus = cluster.config()
    assert "authorization" not in open_bus and '"nats-route://10.0.0.2:6222"' in open_bus
