"""The lifecycle every service shares: uvloop, signals, graceful drain.

A service is an object with ``async start()`` (connect, subscribe, begin serving),
``async drain()`` (stop taking work, finish in-flight work) and ``async close()``.
:func:`run` starts it, waits for SIGTERM or SIGINT, drains, closes and returns 0.

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
from typing import Protocol

from lamina.libs.bus import Bus
from lamina.libs.errors import NotAdmitted
from lamina.libs.telemetry_setup import setup_logging, setup_tracing, shutdown_tracing
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import ServiceStarted

log = logging.getLogger("lamina.service")


RESTARTS_ENV = "LAMINA_RESTARTS"
"""Set by ``lamina up`` on a service it restarts: how many times it has."""


async def announce(bus: Bus, service: str, instance: str) -> None:
    """Tell the cluster (telemetry) this service has started serving, and from then on
    whenever its connection's error and reconnect counts change (``BusHealth``)."""
    bus.report_health(service, instance)
    restarts = int(os.environ.get(RESTARTS_ENV, "0") or 0)
    started = ServiceStarted(service=service, instance=instance, restarts=restarts)
    try:
        await bus.publish(subjects.EVENTS_SERVICE, started)
    except Exception:  # a count of starts is not worth failing a start for
        log.warning("could not announce the start of %s %s", service, instance, exc_info=True)


class Service(Protocol):
    async def start(self) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


def run(name: str, service: Service) -> int:
    """Run ``service`` until SIGTERM/SIGINT, then drain and exit 0."""
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
    try:
        await service.start()
    except NotAdmitted as exc:  # a configuration problem: one line, not a traceback
        log.error("%s cannot start: %s", name, exc)
        return 1
    gc.collect()
    gc.freeze()  # see the module docstring
    log.info("%s started", name)
    await stop.wait()
    log.info("%s draining", name)
    with contextlib.suppress(Exception):
        await service.drain()
    await service.close()
    log.info("%s stopped", name)
    return 0
