"""The whole stack on a closed bus: every service connects with its own credential and
serves as before; NATS API clients each read only their own answers."""

from __future__ import annotations

import asyncio
import contextlib
import shutil

import httpx
import msgspec
import nats
import pytest

from lamina.libs.bus import Bus, NatsConfig, flush
from lamina.libs.errors import NotAdmitted
from lamina.libs.nats_auth import api_subject, inbox_prefix
from lamina.schemas.v1.api import ApiError, ApiEvent, ApiFinished, ApiRequest
from lamina.schemas.v1.generate import Sampling
from lamina.services import ctl
from tests.certificates import make_certificates
from tests.e2e.conftest import make_stack

REQUEST = ApiRequest(prompt="Hello", sampling=Sampling(max_tokens=4, ignore_eos=True))


async def ask(config: NatsConfig, identity: str, reply: str | None = None) -> list:
    """``REQUEST`` as API client ``identity``, its answers read on ``reply`` (by default
    its own inbox, where it then sees nothing); what arrived."""
    nc = await nats.connect(config.nats_url, **config.connect_options())
    inbox = reply or nc.new_inbox()
    events, done = [], asyncio.Event()

    async def on_event(msg) -> None:
        events.append(msgspec.json.decode(msg.data, type=ApiEvent))
        if isinstance(events[-1], ApiFinished | ApiError):
            done.set()

    if reply is None:
        await nc.subscribe(inbox, cb=on_event)
    await nc.publish(api_subject(identity), msgspec.json.encode(REQUEST), reply=inbox)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), 10 if reply is None else 2)
    await nc.drain()
    return events


async def listen(config: NatsConfig, seconds: float) -> list[bytes]:
    """What arrives in the client's own inbox within ``seconds``."""
    nc = await nats.connect(config.nats_url, **config.connect_options())
    got: list[bytes] = []

    async def on_msg(msg) -> None:
        got.append(msg.data)

    await nc.subscribe(inbox_prefix("api.default") + ".>", cb=on_msg)
    await flush(nc)
    await asyncio.sleep(seconds)
    await nc.drain()
    return got


def test_a_closed_bus_serves_its_own_and_refuses_the_rest(tiny_model, tmp_path, capsys):
    stack = make_stack(tiny_model, tmp_path, credentials=tmp_path / "nats")
    with stack:
        body = {"prompt": "Once", "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3

        default = stack.nats_config("api.default")
        events = asyncio.run(ask(default, "api.default"))
        assert isinstance(events[-1], ApiFinished), events
        assert events[-1].usage.completion_tokens == 4

        # Alice (admitted later, with a reload) gets her own answers, and cannot have the
        # gateway write hers into default's inbox.
        alice = stack.nats_config("api.alice")
        assert isinstance(asyncio.run(ask(alice, "api.alice"))[-1], ApiFinished)

        async def steer() -> list[bytes]:
            watching = asyncio.create_task(listen(default, 3.0))
            await asyncio.sleep(0.5)
            await ask(alice, "api.alice", reply=inbox_prefix("api.default") + ".stolen")
            return await watching

        assert asyncio.run(steer()) == []

        with pytest.raises(NotAdmitted):
            asyncio.run(asyncio.wait_for(Bus.connect(stack.nats_url, "anonymous"), 5))

        operator = stack.nats_config("operator").nats_credential
        code = ctl.main(["--nats-url", stack.nats_url, "--nats-credential", operator, "status"])
        assert code == 0 and "worker-0" in capsys.readouterr().out
        code = ctl.main(["--nats-url", stack.nats_url, "--nats-credential", "", "status"])
        assert code == 1 and "refused" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_the_whole_stack_over_tls_with_credentials(tiny_model, tmp_path):
    ca, cert, key = make_certificates(tmp_path)
    stack = make_stack(
        tiny_model, tmp_path, credentials=tmp_path / "nats", nats_tls=(cert, key, ca)
    )
    with stack:
        assert stack.nats_url.startswith("tls://")
        body = {"prompt": "Once", "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        events = asyncio.run(ask(stack.nats_config("api.default"), "api.default"))
        assert isinstance(events[-1], ApiFinished), events
