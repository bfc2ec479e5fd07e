"""Typed publish / request / subscribe over NATS, with trace context on every message.

Every payload is a tagged ``msgspec`` struct encoded as JSON. Each subscription owns one
reusable typed decoder. A message that does not decode is logged with its subject and
dropped, or answered with a typed :class:`BadMessage` when it expects a reply: it never
reaches the handler and never crashes the service.

Tracing follows the OpenTelemetry messaging conventions: a publish is a PRODUCER span
``"<subject> publish"`` whose W3C context travels in the NATS headers; a handler runs
inside a CONSUMER span ``"<subject> process"`` that continues it. Reply inboxes are
temporary destinations and are named ``(temporary)`` to keep span names low-cardinality.

The bus continues traces; it never starts one. A publish outside any sampled trace (a
heartbeat, a KV event batch, a readiness poll) makes no span, and a message that arrives
without a sampled trace context is handled without one: housekeeping every half second
would otherwise be most of the trace store, and an unsampled request would pay at each hop
for spans nobody records. An unsampled context still travels, unchanged. A publish inside
a trace can opt out of its own span too (``traced=False``: a request's token events, one
per engine step; a request forwarded as the last act of its span) and still carries the
context, so whoever receives it continues the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionReconnectingError, MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from lamina.libs import spans
from lamina.libs.config import option
from lamina.libs.errors import (
    BadReply,
    NoResponders,
    NotAdmitted,
    PayloadTooLarge,
    RequestTimeout,
    Unreachable,
)
from lamina.libs.nats_auth import identity_of, inbox_prefix
from lamina.libs.trace_context import extract, inject
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.records import BusHealth

log = logging.getLogger("lamina.bus")
tracer = spans.Tracer("lamina.bus")

HEALTH_PERIOD_S = 5.0
"""How often :meth:`Bus.report_health` looks for changed counters."""

T = TypeVar("T")
Handler = Callable[[Any, Msg], Awaitable[None]]

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def decoder(message_type: Any) -> msgspec.json.Decoder:
    """The one reusable decoder for ``message_type`` (a struct or a union of structs)."""
    dec = _decoders.get(message_type)
    if dec is None:
        dec = _decoders[message_type] = msgspec.json.Decoder(message_type)
    return dec


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def _recording() -> bool:
    """Whether an SDK tracer provider is installed. Without one every span is a no-op,
    but the trace context a request arrived with must still travel: the bus then only
    propagates it, which costs a fifth of a no-op span's bookkeeping per message."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _span_subject(subject: str) -> str:
    return "(temporary)" if subject.startswith("_INBOX.") else subject


def _attributes(subject: str, size: int, operation: str) -> dict[str, Any]:
    return {
        "messaging.system": "nats",
        "messaging.operation.name": operation,
        "messaging.operation.type": "process" if operation == "process" else "send",
        "messaging.destination.name": subject,
        "messaging.destination.temporary": subject.startswith("_INBOX."),
        "messaging.message.body.size": size,
    }


async def flush(nc: Client) -> None:
    """Return once the server has every command this connection sent so far (a barrier:
    a subscription just made is in place, a message just published was read).
    ``nats-py``'s ``flush`` writes its PING straight to the socket, ahead of commands still
    queued for its flusher task, so its PONG can come back before a ``SUB`` queued just
    before it was read. The first round trip lets the flusher write what was queued; the
    second PING goes after it."""
    await nc.flush()
    await nc.flush()


@dataclass(frozen=True)
class NatsConfig:
    """How a process reaches the bus; embedded in every service's config."""

    nats_url: str = option(
        "nats://127.0.0.1:4222", "NATS server URL (several, comma-separated: a cluster)"
    )
    nats_credential: str = option(
        "", "this process's NATS credential, an nkey seed file <identity>.nk (none: anonymous)"
    )
    nats_tls_ca: str = option(
        "", "CA certificate to verify the NATS server's with (tls:// URLs; none: system CAs)"
    )
    nats_connect_timeout: float = option(
        60.0,
        "seconds to reach NATS when the process starts before it gives up and exits 1 (once "
        "connected, a lost server is retried forever)",
    )

    def connect_options(self) -> dict[str, Any]:
        """``nats.connect`` keywords for the credential and TLS settings."""
        options: dict[str, Any] = {}
        if self.nats_credential:
            options["nkeys_seed"] = self.nats_credential
            options["inbox_prefix"] = inbox_prefix(identity_of(self.nats_credential))
        if self.nats_tls_ca:
            options["tls"] = ssl.create_default_context(cafile=self.nats_tls_ca)
        return options

    async def connect(self, name: str, **options: Any) -> Bus:
        options = self.connect_options() | options
        return await Bus.connect(self.nats_url, name, self.nats_connect_timeout, **options)


class Bus:
    """A NATS connection with typed, traced messaging."""

    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.name = name
        self.on_reconnect: list[Callable[[], Awaitable[None]]] = []
        """Called after each reconnect: what was published meanwhile was not received."""
        self.errors = self.disconnects = self.reconnects = 0
        """What happened to the connection since it was made (``BusHealth``)."""
        self.refused = 0
        """Messages this process's handlers refused as not from whom they claim to be
        (``BusHealth.refused``): a forged stream event, a worker posing as another."""
        self._health: asyncio.Task | None = None

    @classmethod
    async def connect(cls, url: str, name: str, timeout: float = 60.0, **options: Any) -> Bus:
        """Connect to ``url`` (comma-separated: the first that answers, in that order, and
        the next ones when it is lost); once connected, reconnects forever.
        Raises :class:`NotAdmitted` at once when the server refuses the credential on the
        first connection (retrying would not change its mind), and :class:`Unreachable`
        when no server answered within ``timeout`` seconds (said once, not per attempt);
        later refusals, while a server reloads its users, are retried like any other
        disconnection."""
        bus: Bus | None = None
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        first_error: list[str] = []

        async def on_error(exc: Exception) -> None:
            if bus is None:  # still making the first connection
                if "authorization violation" in str(exc).lower() and not refused.done():
                    refused.set_result(str(exc))
                elif not first_error:
                    first_error.append(str(exc) or type(exc).__name__)
                    log.warning("cannot reach NATS at %s yet (%s); retrying", url, exc)
                return
            log.warning("nats error: %s", exc)
            bus.errors += 1

        async def on_disconnect() -> None:
            # Not the first connection's attempts (said once above), nor a close of ours.
            if bus is not None and not client.is_closed:
                log.warning("disconnected from nats")
                bus.disconnects += 1

        async def on_reconnect() -> None:
            log.info("reconnected to nats")
            if bus is not None:
                bus.reconnects += 1
            for callback in bus.on_reconnect if bus is not None else []:
                await callback()

        client = Client()
        connecting = asyncio.ensure_future(
            client.connect(
                url.split(","),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                # The servers in the order given: a cluster's node on this host first, so
                # queue groups stay local (NATS prefers a queue member on the same node).
                dont_randomize=True,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                **options,
            )
        )
        try:
            await asyncio.wait(
                {connecting, refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:  # answered, refused, timed out, or the caller was cancelled (a SIGTERM)
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await client.close()
        if refused.done():
            raise NotAdmitted(url, refused.result())
        if connecting.cancelled():
            raise Unreachable(url, timeout, first_error[0] if first_error else "no answer")
        connecting.result()
        bus = cls(client, name)
        return bus

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    def health(self, service: str, instance: str) -> BusHealth:
        return BusHealth(
            service=service,
            instance=instance,
            errors=self.errors,
            disconnects=self.disconnects,
            reconnects=self.reconnects,
            refused=self.refused,
        )

    def report_health(
        self,
        service: str,
        instance: str,
        send: Callable[[BusHealth], Awaitable[None]] | None = None,
        period: float = HEALTH_PERIOD_S,
    ) -> None:
        """``send`` the counters now (default: publish on ``events.service``), then every
        ``period`` seconds when they changed; stopped by :meth:`drain` or :meth:`close`."""

        async def publish(health: BusHealth) -> None:
            await self.publish(subjects.EVENTS_SERVICE, health, traced=False)

        async def report() -> None:
            sent = None
            while True:
                now = (self.errors, self.disconnects, self.reconnects, self.refused)
                if now != sent and self.nc.is_connected:
                    with contextlib.suppress(Exception):  # the next round tries again
                        await (send or publish)(self.health(service, instance))
                        sent = now
                await asyncio.sleep(period)

        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(report())

    def inbox(self) -> str:
        return self.nc.new_inbox()

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        reply: str = "",
        context: otel_context.Context | None = None,
        traced: bool = True,
    ) -> None:
        """Publish ``message``; raises :class:`PayloadTooLarge` over the server's limit.

        ``context`` parents the PRODUCER span when the caller is not inside the request's
        span (e.g. a worker publishing a request's tokens from its engine loop);
        ``traced=False`` sends that context without a span of its own.
        """
        data = encode(message)
        headers: dict[str, str] = {}
        if not traced or not _recording() or not spans.sampled(context):
            inject(headers, context)
            self._check_size(subject, data, headers)
            await self._send(subject, data, reply, headers)
            return
        span = spans.start(
            tracer,
            f"{_span_subject(subject)} publish",
            context=context,
            kind=SpanKind.PRODUCER,
            attributes=_attributes(subject, len(data), "publish"),
        )
        with spans.Current(span, context):
            inject(headers)
            self._check_size(subject, data, headers)
            await self._send(subject, data, reply, headers)

    async def _send(self, subject: str, data: bytes, reply: str, headers: dict[str, str]) -> None:
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers or None)
        except MaxPayloadError as exc:
            raise PayloadTooLarge(subject, len(data), self.max_payload) from exc

    async def request(
        self, subject: str, message: msgspec.Struct, response_type: type[T], timeout: float = 2.0
    ) -> T:
        """Send ``message`` and decode the single reply as ``response_type``."""
        data = encode(message)
        scope: contextlib.AbstractContextManager = contextlib.nullcontext()
        if _recording() and spans.sampled():
            span = spans.start(
                tracer,
                f"{_span_subject(subject)} publish",
                kind=SpanKind.PRODUCER,
                attributes=_attributes(subject, len(data), "request"),
            )
            scope = spans.Current(span)
        with scope:
            headers: dict[str, str] = {}
            inject(headers)
            self._check_size(subject, data, headers)
            try:
                reply = await self.nc.request(subject, data, timeout=timeout, headers=headers)
            except NoRespondersError as exc:
                raise NoResponders(subject) from exc
            except NatsTimeout as exc:
                raise RequestTimeout(subject, timeout) from exc
        try:
            return decoder(response_type).decode(reply.data)
        except msgspec.DecodeError as exc:
            bad = _try_decode_bad_message(reply.data)
            raise BadReply(subject, bad or str(exc)) from exc

    async def request_many(
        self,
        subject: str,
        message: msgspec.Struct,
        response_type: type[T],
        last: Callable[[T], bool],
        timeout: float = 5.0,
    ) -> list[T]:
        """Send ``message`` and collect its replies, decoded as ``response_type``, up to
        the one for which ``last(reply)`` is true (a reply too large for one message, sent
        in parts). Raises :class:`NoResponders` or :class:`RequestTimeout` as
        :meth:`request` does, and :class:`BadReply` for a part that does not decode."""
        inbox = self.inbox()
        parts: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_part(msg: Msg) -> None:
            parts.put_nowait(msg)

        subscription = await self.nc.subscribe(inbox, cb=on_part)
        dec = decoder(response_type)
        replies: list[T] = []
        try:
            await self.publish(subject, message, reply=inbox)
            async with asyncio.timeout(timeout):
                while not replies or not last(replies[-1]):
                    msg = await parts.get()
                    if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
                        raise NoResponders(subject)
                    try:
                        replies.append(dec.decode(msg.data))
                    except msgspec.DecodeError as exc:
                        raise BadReply(subject, str(exc)) from exc
        except TimeoutError as exc:
            raise RequestTimeout(subject, timeout) from exc
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        return replies

    async def reply(self, msg: Msg, message: msgspec.Struct) -> None:
        if msg.reply:
            await self.publish(msg.reply, message)

    async def subscribe(
        self,
        subject: str,
        message_type: Any,
        handler: Handler,
        queue: str = "",
        traced: bool = True,
        bad_reply: Callable[[Msg, msgspec.DecodeError], msgspec.Struct] | None = None,
        no_responders: Callable[[Msg], Awaitable[None]] | None = None,
    ) -> Subscription:
        """Call ``handler(decoded, msg)`` for each message on ``subject``.

        ``queue`` joins a queue group (one member gets each message). ``traced=False`` skips
        the CONSUMER span, for very hot subscriptions whose publishers are already traced.
        A message that does not decode is answered, when it has a reply subject, with
        ``bad_reply(msg, error)`` (default: a :class:`BadMessage`): a subject whose clients
        read their own error type (the NATS request API) says so here. On a reply
        subject, ``no_responders(msg)`` is called for the server's "no responders" status
        (what was published with this reply subject reached no subscriber).
        """
        dec = decoder(message_type)

        async def callback(msg: Msg) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            if status == NO_RESPONDERS_STATUS and no_responders is not None:
                await no_responders(msg)
                return
            try:
                decoded = dec.decode(msg.data)
            except (msgspec.DecodeError, RecursionError) as exc:
                if isinstance(exc, RecursionError):  # hostile nesting, not a bug of ours
                    exc = msgspec.DecodeError("JSON nested too deeply")
                log.warning("dropped undecodable message on %s: %s", msg.subject, exc)
                if msg.reply:
                    answer = (bad_reply or _bad_message)(msg, exc)
                    await self.publish(msg.reply, answer)
                return
            if not traced:
                await self._run(handler, decoded, msg)
                return
            context = extract(msg.headers)
            if not _recording() or not spans.sampled(context):  # no span to record or continue
                token = otel_context.attach(context)
                try:
                    await self._run(handler, decoded, msg)
                finally:
                    otel_context.detach(token)
                return
            span = spans.start(
                tracer,
                f"{_span_subject(msg.subject)} process",
                context=context,
                kind=SpanKind.CONSUMER,
                attributes=_attributes(msg.subject, len(msg.data), "process"),
            )
            with spans.Current(span, context):
                await self._run(handler, decoded, msg)

        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    async def _run(self, handler: Handler, decoded: Any, msg: Msg) -> None:
        try:
            await handler(decoded, msg)
        except Exception:  # a handler bug must not kill the subscription
            log.exception("handler for %s failed", msg.subject)

    def _check_size(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Refuse what the server would refuse: its ``max_payload`` bounds the headers
        (the trace context) and the payload together, and a client that sends more is
        disconnected, taking every in-flight message of the connection with it."""
        size = len(data)
        if headers:  # "NATS/1.0\r\n", "key: value\r\n" each, "\r\n"
            size += 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())
        if self.nc.is_connected and size > self.max_payload:
            raise PayloadTooLarge(subject, size, self.max_payload)

    async def drain(self) -> None:
        """Finish in-flight handlers and flush pending publishes, then close. Without a
        server to flush to (it went away first), just close."""
        self._stop_health()
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.drain()
                return
            except ConnectionReconnectingError:  # lost between the check and the drain
                pass
        log.warning("draining with no NATS server connected: closing instead")
        await self.nc.close()

    async def flush(self) -> None:
        """Until the server has everything sent so far (:func:`flush`)."""
        await flush(self.nc)

    async def close(self) -> None:
        self._stop_health()
        if not self.nc.is_closed:
            await self.nc.close()

    def _stop_health(self) -> None:
        if self._health is not None:
            self._health.cancel()
            self._health = None


def _bad_message(msg: Msg, exc: msgspec.DecodeError) -> BadMessage:
    return BadMessage(subject=msg.subject, error=str(exc))


def _try_decode_bad_message(data: bytes) -> str | None:
    try:
        return decoder(BadMessage).decode(data).error
    except msgspec.DecodeError:
        return None
