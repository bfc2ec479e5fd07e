"""Insiders on a closed bus (every service with its own credential and the generated
permissions): what a worker credential or a NATS API client can do to other people's
streams. Each attack is made as an attacker would, and the victims' streams are counted."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import msgspec
import nats
import pytest

from lamina.libs.bus import NatsConfig, flush
from lamina.libs.nats_auth import api_subject
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.api import ApiError, ApiEvent, ApiFinished, ApiRequest
from lamina.schemas.v1.generate import Failed, Sampling, Sla
from lamina.schemas.v1.stats import GatewayAlive
from tests.e2e.conftest import make_stack

STREAMS = 16
TOKENS = 48


@pytest.fixture(scope="module")
def closed(tiny_model, tmp_path_factory):
    """Two workers on a closed bus; API client ``api.bounded`` may ask for priority 5 at
    best and two sequences a minute, every other one for 0 at best."""
    tmp = tmp_path_factory.mktemp("insiders")
    policies = tmp / "api-clients"
    policies.write_text("api.bounded 5 rpm=2 concurrent=1\napi.* 0\n")
    with make_stack(
        tiny_model,
        tmp,
        workers=2,
        credentials=tmp / "nats",
        gateway_args=["--api-client-file", str(policies)],
    ) as stack:
        yield stack


async def _gateway_inbox(config: NatsConfig) -> str:
    """What any worker learns from the gateways' heartbeats: a gateway's inbox prefix."""
    nc = await nats.connect(config.nats_url, **config.connect_options())
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_alive(msg) -> None:
        if not found.done():
            found.set_result(msgspec.json.decode(msg.data, type=GatewayAlive).inbox_prefix)

    await nc.subscribe(subjects.GATEWAY_ALIVE_ALL, cb=on_alive)
    try:
        return await asyncio.wait_for(found, 30)
    finally:
        await nc.drain()


async def _forge(config: NatsConfig, prefix: str, own_id: str, count: int) -> None:
    """``Failed`` events, as fast as the connection takes them, on every subject a stream
    could have: counter-numbered attempts, and their stream subjects for each worker."""
    nc = await nats.connect(config.nats_url, error_cb=_quiet, **config.connect_options())
    for n in range(count):
        failed = Failed(
            request_id=f"r{n}", seq=1, message="forged", retryable=False, tokens_sent=True
        )
        data = msgspec.json.encode(failed)
        for subject in (f"{prefix}.{n}", f"{prefix}.{n}.worker-0", f"{prefix}.{n}.{own_id}"):
            await nc.publish(subject, data)
    await flush(nc)
    await nc.drain()


async def _quiet(exc: Exception) -> None:
    """The server's permission errors for the forger's refused publishes."""


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, int, str]:
    """One streamed completion: (status, tokens received, finish reason)."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, reason = 0, ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if "error" in chunk:
                return response.status_code, tokens, "error"
            started.set()
            for choice in chunk.get("choices", []):
                reason = choice.get("finish_reason") or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return response.status_code, tokens, reason


def _refused(stack) -> float:
    text = httpx.get(stack.metrics_url, timeout=5).text
    found = re.search(
        r'lamina:bus_refused_messages_total\{[^}]*service="gateway"[^}]*\} (\S+)', text
    )
    return float(found.group(1)) if found else 0.0


def test_a_worker_credential_cannot_end_other_streams(closed):
    """A worker that knows the gateway's inbox floods forged ``Failed`` events on every
    subject an attempt could have; every stream finishes whole, and the forged events
    that reached the gateway (those on the forger's own stream subjects: the server
    refuses the rest) are counted as refused."""
    forger = closed.nats_config("worker.worker-1")  # a worker's credential, stolen
    forged = 3000

    async def main() -> list[tuple[int, int, str]]:
        prefix = await _gateway_inbox(forger)
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=closed.base_url, timeout=120) as client:
            streams = [asyncio.create_task(_stream(client, started)) for _ in range(STREAMS)]
            await asyncio.wait_for(started.wait(), 60)
            await _forge(forger, prefix, "worker-1", forged)
            return await asyncio.gather(*streams)

    before = _refused(closed)
    results = asyncio.run(main())
    assert results == [(200, TOKENS, "length")] * STREAMS
    deadline = time.monotonic() + 30  # the gateway reports its counters every few seconds
    while _refused(closed) - before < forged and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _refused(closed) - before == forged


async def _ask(config: NatsConfig, identity: str, request: ApiRequest) -> list:
    """``request`` as API client ``identity``: every event it got back."""
    nc = await nats.connect(config.nats_url, **config.connect_options())
    inbox, events, done = nc.new_inbox(), [], asyncio.Event()

    async def on_event(msg) -> None:
        events.append(msgspec.json.decode(msg.data, type=ApiEvent))
        if isinstance(events[-1], ApiFinished | ApiError):
            done.set()

    await nc.subscribe(inbox, cb=on_event)
    await nc.publish(api_subject(identity), msgspec.json.encode(request), reply=inbox)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), 60)
    await nc.drain()
    return events


def test_an_api_client_cannot_cancel_anothers_request_by_its_id(closed):
    """Alice reuses the id of default's request while it streams: both are served in
    full, each seeing its own id on its events."""
    victim = ApiRequest(
        prompt="Once upon a time",
        request_id="shared-id",
        sampling=Sampling(max_tokens=TOKENS * 4, ignore_eos=True),
    )
    attack = msgspec.structs.replace(victim, sampling=Sampling(max_tokens=2, ignore_eos=True))
    default, alice = closed.nats_config("api.default"), closed.nats_config("api.alice")

    async def main() -> tuple[list, list[list]]:
        victim_events = asyncio.create_task(_ask(default, "api.default", victim))
        await asyncio.sleep(0.3)
        attacks = [await _ask(alice, "api.alice", attack) for _ in range(4)]
        return await victim_events, attacks

    victim_events, attacks = asyncio.run(main())
    assert isinstance(victim_events[-1], ApiFinished), victim_events[-1]
    assert victim_events[-1].usage.completion_tokens == TOKENS * 4
    assert {e.request_id for e in victim_events} == {"shared-id"}
    for events in attacks:
        assert isinstance(events[-1], ApiFinished), events[-1]
        assert events[-1].usage.completion_tokens == 2
        assert {e.request_id for e in events} == {"shared-id"}


def test_a_request_id_is_bounded_on_the_wire(closed):
    request = ApiRequest(prompt="Once", request_id="x" * 900_000, sampling=Sampling(max_tokens=2))
    (error,) = asyncio.run(_ask(closed.nats_config("api.default"), "api.default", request))
    assert isinstance(error, ApiError) and error.code == 400
    assert error.param == "request_id"


def test_nats_api_identities_have_priority_bounds_and_rate_limits(closed):
    bounded, default = closed.nats_config("api.bounded"), closed.nats_config("api.default")

    def ask(config: NatsConfig, identity: str, priority: int) -> object:
        request = ApiRequest(
            prompt="Once", sampling=Sampling(max_tokens=2), sla=Sla(priority=priority)
        )
        return asyncio.run(_ask(config, identity, request))[-1]

    best = ask(bounded, "api.bounded", -(2**63))
    assert isinstance(best, ApiError) and (best.code, best.param) == (403, "sla.priority")
    assert ask(default, "api.default", -1).code == 403  # api.*: 0 at best
    served = [ask(bounded, "api.bounded", 5) for _ in range(3)]
    assert [type(e) for e in served] == [ApiFinished, ApiFinished, ApiError]
    assert (served[2].code, served[2].error_code) == (429, "rate_limit_exceeded")
    assert 0 < served[2].retry_after_s <= 30
