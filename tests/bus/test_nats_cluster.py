"""A NATS cluster of embedded servers on loopback (``NatsCluster``): messages cross the
routes, a client fails over to the next server of its list, and routes are admitted only
with the credential store's route secret."""

from __future__ import annotations

import asyncio
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import nats

from lamina.libs.bus import Bus, flush
from lamina.libs.nats_auth import ROUTE_SECRET_FILE, CredentialStore
from lamina.libs.nats_server import NatsCluster, NatsServer, free_port
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel


def _nodes(count: int) -> list[tuple[NatsServer, NatsCluster]]:
    """``count`` servers, each routed to all the others (not started)."""
    ports = [(free_port(), free_port()) for _ in range(count)]
    nodes = []
    for i, (client, route) in enumerate(ports):
        others = tuple(f"127.0.0.1:{r}" for j, (_, r) in enumerate(ports) if j != i)
        cluster = NatsCluster(server_name=f"n{i}", host="127.0.0.1", port=route, routes=others)
        nodes.append((NatsServer(port=client, cluster=cluster), cluster))
    return nodes


async def _until_received(publish, got: asyncio.Queue, timeout: float = 10) -> object:
    """Publish (again, while the routes form) until something arrives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await publish()
        try:
            return await asyncio.wait_for(got.get(), 0.2)
        except TimeoutError:
            continue
    raise AssertionError("nothing crossed the cluster")


def test_a_message_crosses_the_routes_and_a_client_fails_over_to_the_next_node():
    (first, _), (second, _) = _nodes(2)

    async def main() -> list[str]:
        got: asyncio.Queue[Cancel] = asyncio.Queue()

        async def on_cancel(message: Cancel, _msg) -> None:
            got.put_nowait(message)

        listener = await Bus.connect(second.url, "test-listener")
        await listener.subscribe("t.cluster", Cancel, on_cancel)
        await listener.flush()
        sender = await Bus.connect(f"{first.url},{second.url}", "test-sender")
        assert sender.nc.connected_url.port == first.port  # the list's order is kept
        received = []
        for label in ("via-first", "via-second"):
            message = await _until_received(
                lambda label=label: sender.publish("t.cluster", Cancel(request_id=label)), got
            )
            received.append(message.request_id)
            if label == "via-first":
                first.stop()  # the sender's node is lost: it moves to the next one
        assert sender.nc.connected_url.port == second.port
        assert sender.reconnects == 1
        await sender.close()
        await listener.close()
        return received

    with first, second:
        assert asyncio.run(main()) == ["via-first", "via-second"]


def test_routes_are_admitted_only_with_the_stores_route_secret(tmp_path: Path):
    """Three nodes: two share a store; the third's copy has another route secret, so it
    cannot join (and so cannot read the others' traffic, nor inject into it)."""
    store = CredentialStore(tmp_path / "store")
    store.ensure("gateway", "worker.w")
    store.route_secret()
    other = CredentialStore(shutil.copytree(store.root, tmp_path / "other"))
    (other.root / ROUTE_SECRET_FILE).write_text(CredentialStore(tmp_path / "x").route_secret())
    assert other.route_secret() != store.route_secret()
    nodes = _nodes(3)
    for (server, cluster), owner in zip(nodes, (store, store, other), strict=True):
        server.config = owner.write_server_config(server.host, server.port, cluster=cluster)

    async def main() -> tuple[bytes, list[bytes]]:
        async def connect(server: NatsServer, owner: CredentialStore, identity: str):
            return await nats.connect(server.url, nkeys_seed=str(owner.path(identity)))

        member, outsider = asyncio.Queue(), asyncio.Queue()
        subscribers = []
        for (server, _), owner, queue in ((nodes[1], store, member), (nodes[2], other, outsider)):
            nc = await connect(server, owner, "gateway")

            async def on_message(msg, queue=queue) -> None:
                queue.put_nowait(msg.data)

            await nc.subscribe(subjects.WORKER_STATS_ALL, cb=on_message)
            await flush(nc)
            subscribers.append(nc)
        worker = await connect(nodes[0][0], store, "worker.w")
        crossed = await _until_received(
            lambda: worker.publish(subjects.worker_stats("w"), b"stats"), member
        )
        await asyncio.sleep(1.0)  # ample time for a route that was going to form
        await worker.publish(subjects.worker_stats("w"), b"stats")
        await worker.flush()
        await asyncio.sleep(0.5)
        for nc in [worker, *subscribers]:
            await nc.close()
        return crossed, [outsider.get_nowait() for _ in range(outsider.qsize())]

    with ExitStack() as running:
        for server, _ in nodes:
            running.enter_context(server)
        crossed, leaked = asyncio.run(main())
    assert crossed == b"stats"
    assert leaked == []
