"""The lifecycle every service shares: uvloop, signals, graceful drain.

A service is an object with ``async start()`` (connect, subscribe, begin serving),
``async drain()`` (stop taking work, finish in-flight work) and ``async close()``.
:func:`run` starts it, waits for SIGTERM or SIGINT, drains, closes and returns 0. A
signal while it starts (waiting for NATS, loading a model) stops it there; a start that
cannot reach NATS within ``--nats-connect-timeout``, or is refused, is one line and exit 1.
A service whose supervisor was killed (``lamina up`` SIGKILLed) gets SIGTERM from the
kernel, closes for at most :data:`ORPHAN_CLOSE_S` and exits without draining.

Once a service has started, everything built so far (modules, the model, the tokenizer,
the HTTP app: a few hundred thousand objects) is moved out of the garbage collector's
reach with ``gc.freeze()``: it lives as long as the process, and a full collection that
scans it pauses whatever request is in flight for tens of milliseconds
(``docs/performance.md``). Later full collections scan only what serving allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from typing import NoReturn, Protocol

from lamina.libs.bus import Bus
from lamina.libs.config import env_name, process_env
from lamina.libs.errors import CannotStart, NotAdmitted, Unreachable
from lamina.libs.lifetime import die_with_supervisor, orphaned
from lamina.libs.telemetry_setup import setup_logging, setup_tracing, shutdown_tracing
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import ServiceStarted

log = logging.getLogger("lamina.service")


RESTARTS_ENV = env_name("restarts")
"""Set by ``lamina up`` on a service it restarts: how many times it has."""


async def announce(bus: Bus, service: str, instance: str) -> None:
    """Tell the cluster (telemetry) this service has started serving, and from then on
    whenever its connection's error and reconnect counts change (``BusHealth``)."""
    bus.report_health(service, instance)
    restarts = process_env().restarts
    started = ServiceStarted(service=service, instance=instance, restarts=restarts)
    try:
        await bus.publish(subjects.EVENTS_SERVICE, started)
    except Exception:  # a count of starts is not worth failing a start for
        log.warning("could not announce the start of %s %s", service, instance, exc_info=True)


class Service(Protocol):
    async def start(self) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


class Failure:
    """What a service that finds, after it started, that it cannot serve (its background
    connection to NATS gave up) sets: the lifecycle then stops it and exits 1."""

    def __init__(self) -> None:
        self.reason: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def set(self, reason: str) -> None:
        if not self.reason.done():
            self.reason.set_result(reason)


def run(name: str, service: Service) -> int:
    """Run ``service`` until SIGTERM/SIGINT, then drain and exit 0."""
    die_with_supervisor()  # a SIGKILLed `lamina up` must not leave it running
    setup_logging(name)
    setup_tracing(name)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        runner = asyncio.run
    try:
        return runner(_serve(name, service))
    finally:
        shutdown_tracing()


async def _serve(name: str, service: Service) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(service.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # stopped while starting (waiting for NATS, loading a model)
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        log.info("%s stopped while starting", name)
        with contextlib.suppress(Exception):
            await service.close()
        return 0
    stopping.cancel()
    try:
        starting.result()
    except (NotAdmitted, Unreachable, CannotStart) as exc:  # one line, not a traceback
        log.error("%s cannot start: %s", name, exc)
        with contextlib.suppress(Exception):
            await service.close()
        return 1
    gc.collect()
    gc.freeze()  # see the module docstring
    log.info("%s started", name)
    failure: Failure | None = getattr(service, "failure", None)
    waits = {asyncio.ensure_future(stop.wait())}
    if failure is not None:
        waits.add(failure.reason)
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    failed = failure is not None and failure.reason.done()
    if failed:
        log.error("%s cannot serve: %s", name, failure.reason.result())
    elif orphaned():  # its supervisor was killed: stop now, not after a drain that waits
        log.warning("%s: its supervisor is gone; stopping without draining", name)
        await _leave(name, service)
    else:
        log.info("%s draining", name)
        with contextlib.suppress(Exception):
            await service.drain()
    await service.close()
    log.info("%s stopped", name)
    return 1 if failed else 0


ORPHAN_CLOSE_S = 5.0
"""How long an orphaned service's close may take before the process exits regardless."""


async def _leave(name: str, service: Service) -> NoReturn:
    """Close ``service`` for at most :data:`ORPHAN_CLOSE_S`, then end the process at once.
    The supervisor's ``nats-server`` dies with it, so a close that flushes the bus may meet
    a server that is going or gone: nats-py's drain then waits out its timeouts, and a
    task of its that outlives the cancellation kept the event loop's shutdown (which waits
    for every task) waiting for good. An orphan has nobody left to serve or to tell."""
    closing = asyncio.ensure_future(service.close())
    await asyncio.wait({closing}, timeout=ORPHAN_CLOSE_S)
    log.info("%s stopped%s", name, "" if closing.done() else " (its close did not finish)")
    logging.shutdown()  # flush the log before the exit skips it
    os._exit(0)
