"""The stack on three hosts (network namespaces, ``tests/multihost/netns.py``), each a
``lamina node`` with its own NATS node in one three-node cluster, on one credential store:

- host a: gateway, scheduler, worker ``a-worker-0``
- host b: gateway, scheduler, worker ``b-worker-0``
- host c: telemetry, worker ``c-worker-0``

Greedy output through either gateway equals a single-host stack's; then a host is
partitioned and healed, and a host is lost mid-load, each counted from the clients (every
stream's text against the reference) and from the bus (placement and request records, as
telemetry hears them). The tests share one cluster and run in file order: the last one
takes host b away for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lamina.libs.bus import NatsConfig
from lamina.libs.errors import NoResponders, RequestTimeout
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord, RequestRecord
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest, WorkerState
from tests.e2e.conftest import make_stack
from tests.multihost import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ROLES = {"a": "gateway,scheduler,worker", "b": "gateway,scheduler,worker", "c": "telemetry,worker"}
WORKERS = {f"{name}-worker-0" for name in ROLES}
ENGINE = ["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]
PROMPTS = [f"{i} said host number {i}, once upon a time" for i in range(6)]
# Prompts no worker has cached yet (KV-aware placement sends a cached prefix back where it
# is cached): for the partition, for the lost host, and for after the heal.
CUT_OFF = [f"{i} was the word the partitioned host heard" for i in range(6)]
LOST = [f"{i} was the last word the lost host heard" for i in range(6)]
SHORT, LONG = 24, 600
"""Tokens per request: LONG streams are long enough to be cut in the middle."""
GREEDY = {  # and output-sensitive penalties: a moved stream must carry its output
    "temperature": 0,
    "ignore_eos": True,
    "frequency_penalty": 0.6,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.3,
}
LAMINA = [sys.executable, "-m", "lamina.services.cli"]


@dataclass
class Cluster:
    hosts: dict[str, netns.Host]
    home: Path
    reference: dict[tuple[str, int], str]
    """(prompt, max_tokens) -> the single-host stack's greedy text."""

    def gateway(self, name: str) -> str:
        return f"http://{self.hosts[name].address}:8000"

    def bus(self, identity: str, *hosts: str) -> NatsConfig:
        """How the test joins the bus as ``identity``, through ``hosts``' NATS nodes."""
        urls = ",".join(f"nats://{self.hosts[h].address}:4222" for h in hosts)
        return NatsConfig(urls, nats_credential=str(self.home / "nats" / f"{identity}.nk"))


@dataclass
class Heard:
    """What telemetry would hear: every placement and every finished request."""

    placements: list[PlacementRecord] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    def placed_on(self, worker: str, request_ids: set[str]) -> set[str]:
        """Those of ``request_ids`` whose first placement was on ``worker``."""
        return {
            p.request_id
            for p in self.placements
            if p.request_id in request_ids and p.attempt == 0 and p.worker_id == worker
        }


@contextlib.asynccontextmanager
async def listening(c: Cluster, *hosts: str):
    bus = await c.bus("telemetry", *hosts).connect("test-listener")
    heard = Heard()

    async def on_placement(record: PlacementRecord, _msg) -> None:
        heard.placements.append(record)

    async def on_request(record: RequestRecord, _msg) -> None:
        heard.records.append(record)

    await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_placement)
    await bus.subscribe(subjects.EVENTS_REQUEST, RequestRecord, on_request)
    await bus.nc.flush()
    try:
        yield heard
    finally:
        await bus.drain()  # everything published before now has arrived


async def views(c: Cluster, replicas: tuple[str, ...]) -> dict[str, set[str]]:
    """Each scheduler replica's workers that take requests (alive and ready), as it
    answers ``sched.status``."""
    bus = await c.bus("operator", *replicas).connect("test-operator")
    found: dict[str, set[str]] = {}
    try:
        for replica in replicas:
            with contextlib.suppress(RequestTimeout, NoResponders):
                answers = await bus.request_many(
                    subjects.SCHED_STATUS,
                    ClusterStatusRequest(),
                    ClusterStatus,
                    lambda status, r=replica: status.scheduler_id == r,
                    timeout=1,
                )
                found[replica] = {
                    w.stats.worker_id
                    for w in answers[-1].workers
                    if w.alive and w.stats.state == WorkerState.READY
                }
    finally:
        await bus.close()
    return found


async def converge(c: Cluster, replicas: tuple[str, ...], workers: set[str], timeout: float):
    """Until every scheduler replica in ``replicas`` sees exactly ``workers`` ready."""
    deadline, seen = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        seen = await views(c, replicas)
        if seen == dict.fromkeys(replicas, workers):
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"the schedulers did not converge on {sorted(workers)}: {seen}")


async def complete(
    base_url: str, prompts: list[str], max_tokens: int, at_once: bool = True
) -> list[str]:
    """Each prompt's greedy text: all at once, or one request at a time (a reference:
    the random-weight model's near-tied logits may tip with how a batch is composed)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(prompt: str) -> httpx.Response:
            body = GREEDY | {"prompt": prompt, "max_tokens": max_tokens}
            return await client.post("/v1/completions", json=body)

        if at_once:
            responses = await asyncio.gather(*map(one, prompts))
        else:
            responses = [await one(p) for p in prompts]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


@dataclass
class Stream:
    """One streamed completion as its client saw it."""

    prompt: str
    request_id: str = ""
    text: str = ""
    error: BaseException | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False


async def stream(base_url: str, s: Stream, timeout: float = 60) -> None:
    body = GREEDY | {"prompt": s.prompt, "max_tokens": LONG, "stream": True}
    try:
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=timeout) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    s.finished = True
                    break
                chunk = json.loads(line[6:])
                s.request_id = chunk["id"]
                for choice in chunk["choices"]:
                    s.text += choice["text"]
                s.started.set()
    except (httpx.HTTPError, OSError) as exc:
        s.error = exc
    finally:
        s.started.set()


def request_id(s: Stream) -> str:
    """The bus's request id of a completion (``cmpl-<id>``)."""
    return s.request_id.removeprefix("cmpl-")


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three-hosts")
    reference: dict[tuple[str, int], str] = {}
    with make_stack(tiny_model, tmp / "single", worker_args=ENGINE) as single:
        for prompts, max_tokens in ((PROMPTS, SHORT), (CUT_OFF, LONG), (LOST, LONG)):
            texts = asyncio.run(complete(single.base_url, prompts, max_tokens, at_once=False))
            reference.update({(p, max_tokens): t for p, t in zip(prompts, texts, strict=True)})
    home = tmp / "home"
    env = {**os.environ, "LAMINA_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    # One credential store for every host, made once, as an operator would (and copy it).
    workers = [f"worker.{w}" for w in sorted(WORKERS)]
    subprocess.run([*LAMINA, "creds", "init", *workers], env=env, check=True, capture_output=True)
    with netns.TestHosts(3, tmp / "logs") as hosts:
        for host in hosts:
            peers = ",".join(other.address for other in hosts if other is not host)
            host.spawn(
                [*LAMINA, "node", "--address", host.address, "--peers", peers,
                 "--node-name", host.name, "--services", ROLES[host.name],
                 "--model", str(tiny_model), *ENGINE],
                env,
                "node",
            )  # fmt: skip
        c = Cluster({host.name: host for host in hosts}, home, reference)
        asyncio.run(converge(c, ("a", "b"), WORKERS, timeout=240))
        yield c


def test_requests_through_either_gateway_equal_the_single_host_stacks(cluster):
    async def main() -> Heard:
        async with listening(cluster, "c", "a") as heard:
            for gateway in ("a", "b"):
                texts = await complete(cluster.gateway(gateway), PROMPTS, SHORT, at_once=False)
                assert texts == [cluster.reference[(p, SHORT)] for p in PROMPTS], gateway
            # A burst through both at once: placed across the hosts, each gateway's local
            # scheduler seeing every host's worker.
            await asyncio.gather(
                *(complete(cluster.gateway(g), PROMPTS, SHORT) for g in ("a", "b"))
            )
        return heard

    heard = asyncio.run(main())
    assert len(heard.records) == 4 * len(PROMPTS)
    assert {r.outcome for r in heard.records} == {"finished"}
    assert {p.worker_id for p in heard.placements} == WORKERS
    assert {p.scheduler_id for p in heard.placements} == {"a", "b"}


def test_a_partitioned_host_loses_its_streams_without_duplicates_and_serves_again(cluster):
    """Host c's cable is pulled while it serves streams of gateway a, then put back."""
    c_host = cluster.hosts["c"]

    async def main() -> tuple[list[Stream], Heard]:
        async with listening(cluster, "a") as heard:
            streams = [Stream(p) for p in CUT_OFF]
            tasks = [asyncio.create_task(stream(cluster.gateway("a"), s)) for s in streams]
            for s in streams:
                await s.started.wait()
            c_host.link(up=False)
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), 90)
                # The scheduler's view loses c ...
                await converge(cluster, ("a", "b"), WORKERS - {"c-worker-0"}, timeout=30)
            finally:
                c_host.link(up=True)
            # ... and converges on all three again once c is back.
            await converge(cluster, ("a", "b"), WORKERS, timeout=60)
            # c takes work again: bursts of new prompts until one is placed there.
            for burst in range(20):
                fresh = [f"{i} is burst {burst} after the heal" for i in range(6)]
                await complete(cluster.gateway("a"), fresh, SHORT)
                if any(p.worker_id == "c-worker-0" for p in heard.placements[-len(fresh) :]):
                    break
            else:
                raise AssertionError("nothing was placed on c-worker-0 after the heal")
        return streams, heard

    streams, heard = asyncio.run(main())
    assert [s.error for s in streams] == [None] * len(streams)
    # Every token once, in order: the text is the reference's, no more, no less.
    assert [s.text for s in streams] == [cluster.reference[(s.prompt, LONG)] for s in streams]
    ids = {request_id(s) for s in streams}
    on_c = heard.placed_on("c-worker-0", ids)
    assert on_c, [(p.request_id in ids, p.worker_id, p.attempt) for p in heard.placements]
    moved = {r.request_id for r in heard.records if r.request_id in on_c and r.moves >= 1}
    assert moved == on_c


def test_a_lost_host_s_streams_move_and_its_gateway_s_clients_get_an_error(cluster):
    """Host b (gateway, scheduler, worker and NATS node) is killed mid-load."""
    b_host = cluster.hosts["b"]

    async def main() -> tuple[list[Stream], list[Stream], Heard]:
        async with listening(cluster, "a", "c") as heard:
            via_a = [Stream(p) for p in LOST]
            via_b = [Stream(p) for p in LOST]
            tasks = [asyncio.create_task(stream(cluster.gateway("a"), s)) for s in via_a]
            tasks += [asyncio.create_task(stream(cluster.gateway("b"), s)) for s in via_b]
            for s in via_a + via_b:
                await s.started.wait()
            b_host.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
            await converge(cluster, ("a",), WORKERS - {"b-worker-0"}, timeout=30)
        return via_a, via_b, heard

    via_a, via_b, heard = asyncio.run(main())
    assert b_host.wait_empty(10)
    # The surviving gateway's clients: nothing lost, nothing duplicated, no errors.
    assert [s.error for s in via_a] == [None] * len(via_a)
    assert [s.text for s in via_a] == [cluster.reference[(s.prompt, LONG)] for s in via_a]
    on_b = heard.placed_on("b-worker-0", {request_id(s) for s in via_a})
    assert on_b, "no stream of gateway a was on host b when it was lost"
    moved = {r.request_id for r in heard.records if r.request_id in on_b and r.moves >= 1}
    assert moved == on_b
    # The lost gateway's clients: a connection error, at once, not a hang or a clean end.
    for s in via_b:
        assert not s.finished
        assert isinstance(s.error, httpx.TransportError), s.error
        assert not isinstance(s.error, httpx.TimeoutException), s.error
