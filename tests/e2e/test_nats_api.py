"""The NATS request API, with a plain nats-py client."""

from __future__ import annotations

import asyncio

import msgspec
import nats

from lamina.schemas.v1.api import ApiDelta, ApiError, ApiEvent, ApiFinished, ApiRequest
from lamina.schemas.v1.generate import Sampling


def call(url: str, request: ApiRequest) -> list:
    async def main():
        nc = await nats.connect(url)
        inbox = nc.new_inbox()
        events, done = [], asyncio.Event()

        async def on_event(msg):
            event = msgspec.json.decode(msg.data, type=ApiEvent)
            events.append(event)
            if isinstance(event, ApiFinished | ApiError):
                done.set()

        await nc.subscribe(inbox, cb=on_event)
        await nc.publish("lamina.v1.api.generate", msgspec.json.encode(request), reply=inbox)
        await asyncio.wait_for(done.wait(), 30)
        await nc.drain()
        return events

    return asyncio.run(main())


def test_nats_request_api_streams_text(stack):
    events = call(
        stack.nats_url,
        ApiRequest(
            prompt="Hello over NATS",
            sampling=Sampling(max_tokens=6, temperature=0, ignore_eos=True),
        ),
    )
    assert all(isinstance(e, ApiDelta) for e in events[:-1])
    final = events[-1]
    assert isinstance(final, ApiFinished) and final.finish_reason == "length"
    assert final.usage.completion_tokens == 6
    assert [e.seq for e in events] == list(range(len(events)))


def test_nats_request_api_errors_are_typed(stack):
    (error,) = call(stack.nats_url, ApiRequest(prompt="x", prompt_token_ids=[1]))
    assert isinstance(error, ApiError) and error.code == 400 and error.param == "prompt"
    (error,) = call(stack.nats_url, ApiRequest(prompt="x", sampling=Sampling(max_tokens=10**9)))
    assert isinstance(error, ApiError) and error.code == 400
    # Far beyond any worker's context as text: refused before it is tokenized, not lost
    # (over HTTP, token ids over max_payload are refused too: test_openai_api.py).
    (error,) = call(stack.nats_url, ApiRequest(prompt="Once upon a time. " * 40_000))
    assert isinstance(error, ApiError) and error.code == 400 and "cannot fit" in error.message
    # The API's events carry no logprobs: asking for them is refused, not ignored.
    for field in ("logprobs", "prompt_logprobs"):
        (error,) = call(stack.nats_url, ApiRequest(prompt="x", sampling=Sampling(**{field: 1})))
        assert isinstance(error, ApiError) and error.code == 400
        assert error.param == f"sampling.{field}"


def test_a_stop_string_is_kept_in_the_text_when_asked(stack):
    """vLLM's ``include_stop_str_in_output``, through the NATS API as over HTTP."""
    sampling = Sampling(max_tokens=12, temperature=0, ignore_eos=True)
    free = call(stack.nats_url, ApiRequest(prompt="Stop here", sampling=sampling))
    text = "".join(e.text for e in free[:-1]) + free[-1].text
    stop = text.strip()[2:5]  # a few characters the greedy output is sure to contain
    cut = text[: text.index(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        request = ApiRequest(
            prompt="Stop here", sampling=sampling, stop=[stop], include_stop_str_in_output=include
        )
        events = call(stack.nats_url, request)
        assert "".join(e.text for e in events[:-1]) + events[-1].text == expected
        assert events[-1].finish_reason == "stop"
