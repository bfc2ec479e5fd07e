"""A Lamina cluster on test hosts (``netns.py``): one ``lamina node`` per host, one NATS
node each, routed to all the others, on one credential store (made once, as an operator
makes it and copies it to every host). The tests and ``benchmarks/multi_host.py`` share
it.

With ``delay_ms``, every route between NATS nodes runs through a delaying TCP proxy
(``benchmarks/delay_proxy.py``) in front of each node's route port: the node listens on
port 6223 and advertises the proxy's 6222, so each route connection, whichever node
solicited it, crosses exactly one proxy (``delay_ms`` each way).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.errors import NoResponders, RequestTimeout
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import ControlAck, Cordon, Ping, Uncordon
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest, WorkerState
from tests.multihost import netns

LAMINA = [sys.executable, "-m", "lamina.services.cli"]
PROXY = Path(__file__).resolve().parents[2] / "benchmarks" / "delay_proxy.py"
NATS_PORT, ROUTE_PORT, PROXIED_ROUTE_PORT = 4222, 6222, 6223


@dataclass
class Cluster:
    hosts: dict[str, netns.Host]
    home: Path
    """The shared ``LAMINA_HOME`` (its ``nats/`` is the credential store)."""

    def gateway(self, name: str) -> str:
        return f"http://{self.hosts[name].address}:8000"

    def bus(self, identity: str, *hosts: str) -> NatsConfig:
        """How a client joins the bus as ``identity``, through ``hosts``' NATS nodes."""
        urls = ",".join(f"nats://{self.hosts[h].address}:{NATS_PORT}" for h in hosts)
        return NatsConfig(urls, nats_credential=str(self.home / "nats" / f"{identity}.nk"))


def workers_of(roles: dict[str, str]) -> set[str]:
    """The worker ids of hosts whose roles include a worker (one each)."""
    return {f"{name}-worker-0" for name, services in roles.items() if "worker" in services}


@contextlib.contextmanager
def running(
    roles: dict[str, str],
    model: Path,
    engine: list[str],
    tmp: Path,
    delay_ms: float = 0.0,
    network: int = 0,
    extra: dict[str, list[str]] | None = None,
) -> Iterator[Cluster]:
    """Hosts named by ``roles`` (host -> its ``--services``), each a node (``extra``:
    more flags of some host's); removed on exit. Returns once the nodes are spawned: wait
    with :func:`converge`."""
    home = tmp / "home"
    env = {**os.environ, "LAMINA_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    workers = sorted(workers_of(roles))
    # The test hosts share this machine's CPUs: each worker gets its share of threads, as
    # ``lamina up`` gives each of several workers on one host (``Stack.worker_env``). With
    # a thread per CPU each, every step's parallel regions would wait on threads
    # descheduled for another worker's: several times slower, past the tests' bounds on
    # a loaded machine.
    cpus = len(os.sched_getaffinity(0))
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(1, len(workers)))))
    identities = [f"worker.{w}" for w in workers]
    subprocess.run(
        [*LAMINA, "creds", "init", *identities], env=env, check=True, capture_output=True
    )
    with netns.TestHosts(len(roles), tmp / "logs", network) as hosts:
        named = dict(zip(roles, hosts, strict=True))
        for name, host in named.items():
            others = [o for o in hosts if o is not host]
            peers = ",".join(f"{o.address}:{NATS_PORT}:{ROUTE_PORT}" for o in others)
            placement = []
            if delay_ms:
                host.spawn(
                    [sys.executable, str(PROXY), "--listen", f"{host.address}:{ROUTE_PORT}",
                     "--to", f"{host.address}:{PROXIED_ROUTE_PORT}", "--delay-ms", str(delay_ms)],
                    env,
                    "proxy",
                )  # fmt: skip
                placement = ["--cluster-port", str(PROXIED_ROUTE_PORT),
                             "--cluster-advertise", f"{host.address}:{ROUTE_PORT}"]  # fmt: skip
            host.spawn(
                [*LAMINA, "node", "--address", host.address, "--peers", peers,
                 "--node-name", name, "--services", roles[name], *placement,
                 "--model", str(model), *engine, *(extra or {}).get(name, [])],
                env,
                "node",
            )  # fmt: skip
        yield Cluster(named, home)


async def views(c: Cluster, replicas: tuple[str, ...]) -> dict[str, set[str]]:
    """Each scheduler replica's workers that take requests, as it answers
    ``sched.status`` (alive, ready, not quarantined), and that answer a ping through the
    replica's own NATS node. After a partition heals, heartbeats can flow one way while
    the other still waits out TCP's retransmission back-off: only a ping shows both."""
    found: dict[str, set[str]] = {}
    for replica in replicas:
        bus = await c.bus("operator", replica).connect(f"test-operator-{replica}")
        try:
            with contextlib.suppress(RequestTimeout, NoResponders):
                answers = await bus.request_many(
                    subjects.SCHED_STATUS,
                    ClusterStatusRequest(),
                    ClusterStatus,
                    lambda status, r=replica: status.scheduler_id == r,
                    timeout=1,
                )
                ready = [
                    w.stats.worker_id
                    for w in answers[-1].workers
                    if w.alive and w.stats.state == WorkerState.READY and not w.quarantined
                ]
                found[replica] = {w for w in ready if await _answers(bus, w)}
        finally:
            await bus.close()
    return found


async def _answers(bus: Bus, worker: str) -> bool:
    try:
        await bus.request(subjects.worker_control(worker), Ping(), ControlAck, timeout=1)
    except (RequestTimeout, NoResponders):
        return False
    return True


async def converge(
    c: Cluster,
    replicas: tuple[str, ...],
    workers: set[str],
    timeout: float,
    stable_for: float = 0.0,
) -> None:
    """Until every scheduler replica in ``replicas`` sees exactly ``workers`` ready, and
    has for ``stable_for`` seconds (after a partition heals, a host's heartbeats can come
    in bursts while TCP's retransmission back-off runs down, and it flaps)."""
    deadline, seen, since = time.monotonic() + timeout, {}, None
    while time.monotonic() < deadline:
        seen = await views(c, replicas)
        if seen != dict.fromkeys(replicas, workers):
            since = None
        elif since is None:
            since = time.monotonic()
        if since is not None and time.monotonic() - since >= stable_for:
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"the schedulers did not converge on {sorted(workers)}: {seen}")


async def cordon(
    operator: NatsConfig, workers: set[str], serving: set[str], timeout: float = 60
) -> None:
    """Leave only ``serving`` of ``workers`` taking new requests (``lamina ctl cordon``
    on the others, ``uncordon`` on these), waiting out workers still loading (not
    subscribed yet) and routes still recovering from a partition (no reply yet)."""
    bus = await operator.connect("test-cordon")
    try:
        for worker in sorted(workers):
            command = Uncordon() if worker in serving else Cordon()
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await bus.request(subjects.worker_control(worker), command, ControlAck)
                    break
                except (NoResponders, RequestTimeout):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
    finally:
        await bus.close()
    await asyncio.sleep(0.3)  # every scheduler replica has the workers' new heartbeats
