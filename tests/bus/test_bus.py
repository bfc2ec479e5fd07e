"""The bus library against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lamina.libs.bus import Bus, encode
from lamina.libs.errors import NoResponders, PayloadTooLarge, RequestTimeout
from lamina.libs.spans import RecordingProvider, flush
from lamina.schemas.v1.control import Cancel, ControlAck, Drain
from lamina.schemas.v1.errors import BadMessage

EXPORTER = InMemorySpanExporter()
CALLER = trace.get_tracer("test.caller")


@pytest.fixture(scope="module", autouse=True)
def tracing():
    provider = RecordingProvider()  # as the services record spans
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    yield


def finished():
    """The spans recorded so far (the services' recording thread flushed first)."""
    flush()
    return EXPORTER.get_finished_spans()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_typed_publish_subscribe_and_queue_groups(nats_url):
    async def main():
        bus = await Bus.connect(nats_url, "test")
        got: list[tuple[str, str]] = []

        async def member(name):
            async def handler(msg, raw):
                got.append((name, msg.request_id))

            await bus.subscribe("t.cancel", Cancel, handler, queue="q")

        await member("a")
        await member("b")
        for i in range(20):
            await bus.publish("t.cancel", Cancel(request_id=str(i)))
        await bus.drain()  # the barrier: every message delivered and handled, then closed
        return got

    got = run(main())
    assert sorted(int(rid) for _, rid in got) == list(range(20))  # each delivered once


def test_request_reply_and_errors(nats_url):
    async def main():
        bus = await Bus.connect(nats_url, "test")

        async def control(cmd, msg):
            await bus.reply(msg, ControlAck(worker_id="w", ok=True, state="draining"))

        await bus.subscribe("t.control", Drain, control)
        ack = await bus.request("t.control", Drain(), ControlAck)
        with pytest.raises(NoResponders):
            await bus.request("t.nobody", Drain(), ControlAck, timeout=1)
        await bus.subscribe("t.silent", Drain, lambda c, m: asyncio.sleep(0))
        with pytest.raises(RequestTimeout):
            await bus.request("t.silent", Drain(), ControlAck, timeout=0.2)
        with pytest.raises(PayloadTooLarge) as too_big:
            await bus.publish("t.cancel", Cancel(request_id="x" * (bus.max_payload + 1)))
        # The payload alone fits; with the trace context headers it does not. Sent, the
        # server would have cut the connection.
        fits_alone = bus.max_payload - 20 - len(encode(Cancel(request_id="")))
        with CALLER.start_as_current_span("caller"), pytest.raises(PayloadTooLarge):
            await bus.publish("t.cancel", Cancel(request_id="x" * fits_alone))
        assert await bus.request("t.control", Drain(), ControlAck) == ack  # still connected
        await bus.drain()
        return ack, too_big.value

    ack, too_big = run(main())
    assert ack == ControlAck(worker_id="w", ok=True, state="draining")
    assert too_big.size > too_big.max_payload


def test_undecodable_message_is_answered_with_a_typed_error_and_dropped(nats_url):
    async def main():
        bus = await Bus.connect(nats_url, "test")
        handled = []

        async def handler(msg, raw):
            handled.append(msg)

        await bus.subscribe("t.typed", Cancel, handler)
        reply = await bus.nc.request("t.typed", b'{"type":"Cancel","request_id":5}', timeout=2)
        bad = await bus.nc.request("t.typed", b"not json", timeout=2)
        await bus.publish("t.typed", Cancel(request_id="ok"))  # still subscribed
        await bus.drain()  # the barrier: every message delivered and handled, then closed
        return reply, bad, handled

    reply, bad, handled = run(main())
    from lamina.libs.bus import decoder

    error = decoder(BadMessage).decode(reply.data)
    assert error.subject == "t.typed" and "request_id" in error.error
    assert decoder(BadMessage).decode(bad.data).subject == "t.typed"
    assert handled == [Cancel(request_id="ok")]


def test_trace_context_crosses_the_bus(nats_url):
    EXPORTER.clear()

    async def main():
        bus = await Bus.connect(nats_url, "test")
        done = asyncio.Event()

        async def handler(msg, raw):
            done.set()

        await bus.subscribe("t.traced", Cancel, handler)
        with CALLER.start_as_current_span("caller"):
            await bus.publish("t.traced", Cancel(request_id="r"))
        await done.wait()
        await bus.drain()

    run(main())
    spans = {s.name: s for s in finished()}
    producer, consumer = spans["t.traced publish"], spans["t.traced process"]
    assert producer.parent.span_id == spans["caller"].context.span_id
    assert producer.kind == trace.SpanKind.PRODUCER and consumer.kind == trace.SpanKind.CONSUMER
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent.span_id == producer.context.span_id
    assert producer.attributes["messaging.system"] == "nats"
    assert producer.attributes["messaging.destination.name"] == "t.traced"
    operations = [
        (span.attributes["messaging.operation.name"], span.attributes["messaging.operation.type"])
        for span in (producer, consumer)
    ]
    assert operations == [("publish", "send"), ("process", "process")]
    assert consumer.attributes["messaging.destination.name"] == "t.traced"
    assert consumer.attributes["messaging.message.body.size"] > 0


def two_hops(nats_url: str, upstream) -> list[tuple[int, dict[str, str]]]:
    """A message sent under ``upstream`` (a remote parent, as a client's ``traceparent``
    gives) and forwarded once, as the scheduler does: at each hop, the current trace id
    in the handler and the headers it came with."""
    from opentelemetry.trace import NonRecordingSpan

    seen: list[tuple[int, dict[str, str]]] = []

    async def main():
        bus = await Bus.connect(nats_url, "test")
        done = asyncio.Event()

        async def first(msg, raw):
            seen.append((trace.get_current_span().get_span_context().trace_id, raw.headers))
            await bus.publish("t.hop2", msg)

        async def second(msg, raw):
            seen.append((trace.get_current_span().get_span_context().trace_id, raw.headers))
            done.set()

        await bus.subscribe("t.hop1", Cancel, first)
        await bus.subscribe("t.hop2", Cancel, second)
        parent = trace.set_span_in_context(NonRecordingSpan(upstream))
        await bus.publish("t.hop1", Cancel(request_id="r"), context=parent)
        await done.wait()
        await bus.drain()

    run(main())
    return seen


def test_without_a_tracing_sdk_the_trace_context_still_crosses_the_bus(nats_url, monkeypatch):
    """No SDK installed: no spans, but a request's upstream trace context travels in the
    headers and is the current context in the handler, two hops down."""
    from opentelemetry.trace import SpanContext, TraceFlags

    from lamina.libs import bus as bus_module

    monkeypatch.setattr(bus_module, "_recording", lambda: False)
    EXPORTER.clear()
    upstream = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=True, trace_flags=TraceFlags(1))
    seen = two_hops(nats_url, upstream)
    assert [trace_id for trace_id, _ in seen] == [0x1234, 0x1234]
    assert all(headers["traceparent"].startswith(f"00-{0x1234:032x}-") for _, headers in seen)
    assert finished() == ()


def test_draining_after_the_server_went_away_closes_promptly():
    from lamina.libs.nats_server import NatsServer

    server = NatsServer().start()

    async def main():
        bus = await Bus.connect(server.url, "test")
        server.stop()
        while bus.nc.is_connected:  # until the client notices and starts reconnecting
            await asyncio.sleep(0.01)
        await asyncio.wait_for(bus.drain(), timeout=5)
        return bus.nc.is_closed

    try:
        assert run(main())
    finally:
        server.stop()


def test_the_bus_continues_traces_and_never_starts_one(nats_url):
    """Outside any trace (a heartbeat) a publish makes no span and its handler runs
    without one; inside one, ``traced=False`` skips the PRODUCER span but still carries
    the context, so the handler's span continues the caller's trace."""
    EXPORTER.clear()

    async def main() -> list:
        bus = await Bus.connect(nats_url, "test")
        seen: list = []

        async def handler(msg, raw) -> None:
            seen.append(trace.get_current_span().get_span_context())

        await bus.subscribe("t.housekeeping", Cancel, handler)
        await bus.publish("t.housekeeping", Cancel(request_id="beat"))
        with CALLER.start_as_current_span("caller"):
            await bus.publish("t.housekeeping", Cancel(request_id="token"), traced=False)
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        await bus.drain()
        return seen

    beat, token = run(main())
    spans = {s.name: s for s in finished()}
    assert not beat.is_valid  # the heartbeat's handler ran in no trace
    assert "t.housekeeping publish" not in spans  # neither publish made a span
    consumer = spans["t.housekeeping process"]  # only the traced one was handled in a span
    assert consumer.parent.span_id == spans["caller"].context.span_id
    assert token.trace_id == spans["caller"].context.trace_id


def test_an_unsampled_trace_crosses_the_bus_unchanged_and_makes_no_span(nats_url):
    """A caller that does not sample (``traceparent`` flags ``00``): every hop passes its
    context on as it came, and no hop spends a span on it."""
    from opentelemetry.trace import SpanContext, TraceFlags

    EXPORTER.clear()
    upstream = SpanContext(trace_id=0x5678, span_id=0x42, is_remote=True, trace_flags=TraceFlags(0))
    seen = two_hops(nats_url, upstream)
    assert [headers["traceparent"] for _, headers in seen] == [
        f"00-{0x5678:032x}-{0x42:016x}-00"
    ] * 2
    assert finished() == ()


def test_closing_the_bus_is_not_a_lost_connection(nats_url, caplog):
    """Only a connection lost counts (and warns) as a disconnect, not one the bus closed."""

    async def main() -> int:
        bus = await Bus.connect(nats_url, "test-close")
        await bus.publish("t.close", Cancel(request_id="x"))
        await bus.close()
        return bus.disconnects

    with caplog.at_level("WARNING", logger="lamina.bus"):
        assert asyncio.run(main()) == 0
    assert "disconnected from nats" not in caplog.text
