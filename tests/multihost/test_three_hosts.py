"""The stack on three hosts (network namespaces, ``tests/multihost/netns.py``), each a
``lamina node`` with its own NATS node in one three-node cluster, on one credential store:

- host a: gateway, scheduler, telemetry, worker ``a-worker-0``
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
from dataclasses import dataclass, field

import httpx
import pytest

from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord, RequestRecord
from tests.e2e.conftest import make_stack
from tests.multihost import netns, nodes
from tests.multihost.nodes import converge

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ROLES = {
    "a": "gateway,scheduler,telemetry,worker",
    "b": "gateway,scheduler,worker",
    "c": "telemetry,worker",
}
WORKERS = nodes.workers_of(ROLES)
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


@dataclass
class Checked(nodes.Cluster):
    """The cluster, and what a single-host stack answered to the same requests."""

    reference: dict[tuple[str, int], str] = field(default_factory=dict)
    """(prompt, max_tokens) -> the single-host stack's greedy text."""


@dataclass
class Heard:
    """What telemetry would hear: every placement and every finished request."""

    placements: list[PlacementRecord] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    async def recorded(self, count: int, timeout: float = 30) -> None:
        """Wait until ``count`` request records have arrived. A gateway publishes its record
        as its response ends, through its own host's NATS node: another host's listener
        hears it a route later, possibly after the client has its answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.records) < count and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def placed_on(self, worker: str, request_ids: set[str]) -> set[str]:
        """Those of ``request_ids`` whose first placement was on ``worker``."""
        return {
            p.request_id
            for p in self.placements
            if p.request_id in request_ids and p.attempt == 0 and p.worker_id == worker
        }


@contextlib.asynccontextmanager
async def listening(c: nodes.Cluster, *hosts: str):
    bus = await c.bus("telemetry", *hosts).connect("test-listener")
    heard = Heard()

    async def on_placement(record: PlacementRecord, _msg) -> None:
        heard.placements.append(record)

    async def on_request(record: RequestRecord, _msg) -> None:
        heard.records.append(record)

    await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_placement)
    await bus.subscribe(subjects.EVENTS_REQUEST, RequestRecord, on_request)
    await bus.flush()
    try:
        yield heard
    finally:
        await bus.drain()  # everything published before now has arrived


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
    pairs = zip(prompts, responses, strict=True)
    failed = [(p, r.status_code, r.text) for p, r in pairs if r.status_code != 200]
    assert not failed, failed  # each failure whole: a list of every reply gets truncated
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
                s.request_id = chunk["id"].removeprefix("cmpl-")  # the bus's request id
                for choice in chunk["choices"]:
                    s.text += choice["text"]
                s.started.set()
    except (httpx.HTTPError, OSError) as exc:
        s.error = exc
    finally:
        s.started.set()


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three-hosts")
    reference: dict[tuple[str, int], str] = {}
    with make_stack(tiny_model, tmp / "single", worker_args=ENGINE) as single:
        for prompts, max_tokens in ((PROMPTS, SHORT), (CUT_OFF, LONG), (LOST, LONG)):
            texts = asyncio.run(complete(single.base_url, prompts, max_tokens, at_once=False))
            reference.update({(p, max_tokens): t for p, t in zip(prompts, texts, strict=True)})
    with nodes.running(ROLES, tiny_model, ENGINE, tmp) as c:
        asyncio.run(converge(c, ("a", "b"), WORKERS, timeout=240))
        yield Checked(c.hosts, c.home, reference)


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
            await heard.recorded(4 * len(PROMPTS))
        return heard

    heard = asyncio.run(main())
    assert len(heard.records) == 4 * len(PROMPTS)
    assert {r.outcome for r in heard.records} == {"finished"}
    assert {p.worker_id for p in heard.placements} == WORKERS
    assert {p.scheduler_id for p in heard.placements} == {"a", "b"}
    # Both telemetry replicas see the whole cluster, whichever host they are on.
    for host in ("a", "c"):
        url = f"http://{cluster.hosts[host].address}:9400/v1/cluster"
        seen = {w["worker_id"] for w in httpx.get(url, timeout=10).json()["workers"]}
        assert seen == WORKERS, host


def test_a_partitioned_host_loses_its_streams_without_duplicates_and_serves_again(cluster):
    """Host c's cable is pulled while it serves streams of gateway a, then put back."""
    c_host, operator = cluster.hosts["c"], cluster.bus("operator", "a")

    async def main() -> tuple[list[Stream], Heard]:
        async with listening(cluster, "a") as heard:
            await nodes.cordon(operator, WORKERS, {"c-worker-0"})  # the streams go to c
            streams = [Stream(p) for p in CUT_OFF]
            tasks = [asyncio.create_task(stream(cluster.gateway("a"), s)) for s in streams]
            for s in streams:
                await s.started.wait()
            await nodes.cordon(operator, WORKERS, WORKERS)  # and may move anywhere
            c_host.link(up=False)
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), 90)
                # The scheduler's view loses c ...
                await converge(cluster, ("a", "b"), WORKERS - {"c-worker-0"}, timeout=30)
            finally:
                c_host.link(up=True)
            # ... and converges on all three again once c is back.
            await converge(cluster, ("a", "b"), WORKERS, timeout=60, stable_for=3.0)
            # c takes work again: with the others cordoned, requests go there and finish.
            await nodes.cordon(operator, WORKERS, {"c-worker-0"})
            before = len(heard.placements)
            fresh = [f"{i} is a request after the heal" for i in range(3)]
            await complete(cluster.gateway("a"), fresh, SHORT)
            await heard.recorded(len(streams) + len(fresh))
            after_heal = {p.worker_id for p in heard.placements[before:] if p.worker_id}
            await nodes.cordon(operator, WORKERS, WORKERS)
        assert after_heal == {"c-worker-0"}
        return streams, heard

    streams, heard = asyncio.run(main())
    assert [s.error for s in streams] == [None] * len(streams)
    # Every token once, in order: the text is the reference's, no more, no less.
    assert [s.text for s in streams] == [cluster.reference[(s.prompt, LONG)] for s in streams]
    ids = {s.request_id for s in streams}
    assert heard.placed_on("c-worker-0", ids) == ids
    moved = {r.request_id for r in heard.records if r.request_id in ids and r.moves >= 1}
    assert moved == ids


def test_a_lost_host_s_streams_move_and_its_gateway_s_clients_get_an_error(cluster):
    """Host b (gateway, scheduler, worker and NATS node) is killed mid-load."""
    b_host, operator = cluster.hosts["b"], cluster.bus("operator", "a")

    async def main() -> tuple[list[Stream], list[Stream], Heard]:
        async with listening(cluster, "a", "c") as heard:
            # Half of gateway a's streams on b's worker, half elsewhere.
            via_a = [Stream(p) for p in LOST]
            via_b = [Stream(p) for p in LOST]
            a, b = cluster.gateway("a"), cluster.gateway("b")
            tasks = []
            for serving, streams in (
                (WORKERS - {"b-worker-0"}, [(a, s) for s in via_a[:3]]),
                ({"b-worker-0"}, [(a, s) for s in via_a[3:]] + [(b, s) for s in via_b]),
            ):
                await nodes.cordon(operator, WORKERS, serving)
                tasks += [asyncio.create_task(stream(url, s)) for url, s in streams]
                for _, s in streams:
                    await s.started.wait()
            await nodes.cordon(operator, WORKERS, WORKERS)
            b_host.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
            await converge(cluster, ("a",), WORKERS - {"b-worker-0"}, timeout=30)
            await heard.recorded(len(via_a))  # gateway b's clients got errors, and no record
        return via_a, via_b, heard

    via_a, via_b, heard = asyncio.run(main())
    assert b_host.wait_empty(10)
    # The surviving gateway's clients: nothing lost, nothing duplicated, no errors.
    assert [s.error for s in via_a] == [None] * len(via_a)
    assert [s.text for s in via_a] == [cluster.reference[(s.prompt, LONG)] for s in via_a]
    on_b = {s.request_id for s in via_a[3:]}
    assert heard.placed_on("b-worker-0", on_b) == on_b
    moved = {r.request_id for r in heard.records if r.moves >= 1}
    assert moved == on_b  # and the others never noticed
    # The lost gateway's clients: a connection error, at once, not a hang or a clean end.
    for s in via_b:
        assert not s.finished
        assert isinstance(s.error, httpx.TransportError), s.error
        assert not isinstance(s.error, httpx.TimeoutException), s.error
