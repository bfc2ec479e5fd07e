"""The generated nats-server configuration, enforced by a real nats-server: who may
connect, and what each identity may publish and subscribe to."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat

import nats
import pytest

from lamina.libs.bus import Bus, NatsConfig, encode, flush
from lamina.libs.errors import NotAdmitted
from lamina.libs.nats_auth import CredentialStore, api_subject
from lamina.libs.nats_server import NatsServer
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Drain
from tests.certificates import make_certificates

IDENTITIES = ("gateway", "scheduler", "telemetry", "operator", "worker.w0", "worker.w1")
IDENTITIES += ("api.alice", "api.bob")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    store = CredentialStore(tmp_path_factory.mktemp("creds") / "nats")
    store.ensure(*IDENTITIES)
    server = NatsServer()
    server.config = store.write_server_config(server.host, server.port)
    with server:
        yield server, store


class Client:
    """A raw connection as one identity, recording the server's permission errors."""

    def __init__(self, nc: nats.NATS, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.received: list[tuple[str, bytes]] = []

    async def watch(self, subject: str) -> None:
        async def on_msg(msg) -> None:
            self.received.append((msg.subject, msg.data))

        await self.nc.subscribe(subject, cb=on_msg)
        await flush(self.nc)


async def connect_as(secured, identity: str) -> Client:
    server, store = secured
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    options = NatsConfig(server.url, str(store.path(identity))).connect_options()
    nc = await nats.connect(server.url, error_cb=on_error, allow_reconnect=False, **options)
    return Client(nc, errors)


async def settle(*clients: Client) -> None:
    for client in clients:
        await flush(client.nc)
    await asyncio.sleep(0.2)


def test_credentials_are_owner_only_and_the_server_config_holds_no_secret(secured):
    _, store = secured
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    for identity in IDENTITIES:
        assert stat.S_IMODE(os.stat(store.path(identity)).st_mode) == 0o600
    users = (store.root / "users.conf").read_text()
    for identity in IDENTITIES:
        assert store.path(identity).read_text().strip() not in users


def test_an_unauthenticated_or_unknown_connection_is_refused_at_once(secured, tmp_path):
    server, _ = secured

    async def main() -> None:
        with pytest.raises(NotAdmitted, match="refused"):
            await asyncio.wait_for(Bus.connect(server.url, "anonymous"), 5)
        stranger = CredentialStore(tmp_path / "other")
        (path,) = stranger.ensure("gateway")  # a valid seed the server never admitted
        with pytest.raises(NotAdmitted):
            await asyncio.wait_for(NatsConfig(server.url, str(path)).connect("stranger"), 5)

    asyncio.run(main())


def test_the_gateway_cannot_command_workers_but_the_operator_can(secured):
    async def main() -> None:
        worker = await connect_as(secured, "worker.w0")
        gateway = await connect_as(secured, "gateway")
        operator = await connect_as(secured, "operator")
        await worker.watch(subjects.worker_control("w0"))
        drain = encode(Drain())
        await gateway.nc.publish(subjects.worker_control("w0"), drain)
        await settle(gateway, worker)
        assert worker.received == []
        assert any("permissions violation for publish" in e for e in gateway.errors)
        await operator.nc.publish(subjects.worker_control("w0"), drain)
        await settle(operator, worker)
        assert worker.received == [(subjects.worker_control("w0"), drain)]

    asyncio.run(main())


def test_a_worker_speaks_only_for_itself_and_reads_no_inbox_but_its_own(secured):
    async def main() -> None:
        w0 = await connect_as(secured, "worker.w0")
        scheduler = await connect_as(secured, "scheduler")
        await scheduler.watch(subjects.WORKER_STATS_ALL)
        await w0.nc.publish(subjects.worker_stats("w1"), b"{}")  # posing as w1
        await w0.nc.publish(subjects.worker_stats("w0"), b"{}")
        await w0.nc.subscribe("_INBOX.gateway.>")  # a gateway's token streams
        await w0.nc.subscribe(subjects.worker_generate("w1"))  # another worker's requests
        await settle(w0, scheduler)
        assert scheduler.received == [(subjects.worker_stats("w0"), b"{}")]
        assert sum("permissions violation for subscription" in e for e in w0.errors) == 2

    asyncio.run(main())


def test_a_worker_streams_only_on_its_own_stream_subjects(secured):
    """``<gateway inbox>.<attempt>.<worker id>``: no worker can publish into an attempt's
    own subject (the scheduler's), nor into a stream another worker holds."""

    async def main() -> None:
        w0 = await connect_as(secured, "worker.w0")
        gateway = await connect_as(secured, "gateway")
        await gateway.watch("_INBOX.gateway.>")
        inbox = "_INBOX.gateway.nuid"
        for subject in (
            f"{inbox}.attempt",  # the scheduler's subject of an attempt
            f"{inbox}.7",  # what a counter-numbered attempt would be
            subjects.worker_stream(f"{inbox}.attempt", "w1"),  # w1's stream
            subjects.worker_stream(f"{inbox}.attempt", "w0") + ".x",
        ):
            await w0.nc.publish(subject, b"{}")
        await w0.nc.publish(subjects.worker_stream(f"{inbox}.attempt", "w0"), b"{}")
        await settle(w0, gateway)
        assert gateway.received == [(f"{inbox}.attempt.w0", b"{}")]
        assert sum("permissions violation for publish" in e for e in w0.errors) == 4

    asyncio.run(main())


def test_an_api_client_reads_only_its_own_inbox_and_publishes_only_its_requests(secured):
    async def main() -> None:
        alice = await connect_as(secured, "api.alice")
        gateway = await connect_as(secured, "gateway")
        await gateway.watch(f"{subjects.API_GENERATE}.*")
        for subject in (">", "_INBOX.api.bob.>", subjects.SCHED_SUBMIT):
            await alice.nc.subscribe(subject)
        await alice.nc.publish(api_subject("api.bob"), b"{}")  # as bob
        await alice.nc.publish(subjects.SCHED_SUBMIT, b"{}")  # around the gateway
        await alice.nc.publish(api_subject("api.alice"), b"{}", reply="_INBOX.api.alice.1")
        await settle(alice, gateway)
        assert sum("permissions violation for subscription" in e for e in alice.errors) == 3
        assert sum("permissions violation for publish" in e for e in alice.errors) == 2
        assert gateway.received == [(api_subject("api.alice"), b"{}")]

    asyncio.run(main())


def test_telemetry_only_listens(secured):
    async def main() -> None:
        telemetry = await connect_as(secured, "telemetry")
        await telemetry.nc.publish(subjects.SCHED_SUBMIT, b"{}")
        await telemetry.nc.subscribe(subjects.SCHED_SUBMIT)  # prompts: not its business
        await settle(telemetry)
        assert any("violation for publish" in e for e in telemetry.errors)
        assert any("violation for subscription" in e for e in telemetry.errors)

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_tls_with_credentials(tmp_path):
    ca, cert, key = make_certificates(tmp_path)
    store = CredentialStore(tmp_path / "nats")
    (gateway,) = store.ensure("gateway")
    server = NatsServer()
    server.config = store.write_server_config(server.host, server.port, cert, key)

    async def main() -> None:
        url = f"tls://{server.host}:{server.port}"
        bus = await NatsConfig(url, str(gateway), ca).connect("tls-test")
        await bus.flush()
        assert bus.nc.is_connected and bus.nc.connected_url.scheme == "tls"
        await bus.close()
        with pytest.raises(TimeoutError):  # a server it cannot verify: never connected
            await asyncio.wait_for(NatsConfig(url, str(gateway)).connect("no-ca"), 2)

    with server:
        asyncio.run(main())
