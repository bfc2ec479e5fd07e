"""The telemetry service: listens to heartbeats and records, serves Prometheus metrics.

Never on the request path: it hears every worker heartbeat (``worker.*.stats``), every
ended request (``events.request``) and every placement (``events.placement``) without a
queue group, so each replica sees everything, and it only ever answers HTTP:

* ``GET /metrics``: Prometheus text exposition of the aggregator's own registry;
* ``GET /v1/cluster``: each worker's latest stats with ``alive`` and ``last_seen_ms``, and
  the cluster totals, as JSON;
* ``GET /health``: 200 while the process runs; ``GET /ready``: 200 once connected to NATS.

The HTTP server is uvicorn running inside the service's own event loop, with its signal
handling disabled so that :func:`lamina.libs.service.run` keeps SIGTERM and SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, get
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import option
from lamina.libs.errors import NotAdmitted, Unreachable
from lamina.libs.http_auth import ApiKeys, load_keys
from lamina.libs.http_server import HEADER_TIMEOUT_S, server_config
from lamina.libs.service import Failure
from lamina.libs.trace_context import sampled_context
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import BusHealth, PlacementRecord, RequestRecord, ServiceStarted
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.telemetry.metrics import COMPAT, Aggregator

log = logging.getLogger("lamina.telemetry")

#: How long start() waits for the HTTP server to listen, and close() for it to stop.
HTTP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TelemetryConfig:
    """Telemetry: Prometheus metrics and a cluster view from heartbeats and records."""

    nats: NatsConfig = field(default_factory=NatsConfig)
    http_host: str = option("127.0.0.1", "address to serve /metrics, /v1/cluster, /health on")
    http_port: int = option(9400, "HTTP port (0: any free port)")
    metrics_api_key: str = option(
        "", "keys for /metrics and /v1/cluster (Authorization: Bearer; none: open)"
    )
    metrics_api_key_file: str = option("", "file of keys, one per line (added to the above)")
    metrics_compat: str = option(
        "",
        "also serve another server's metric names, labels and buckets: vllm (vLLM's "
        "dashboards and alerts then work unchanged); empty: Lamina's only",
    )

    def __post_init__(self) -> None:
        if self.metrics_compat not in COMPAT:
            raise ValueError(f"--metrics-compat: one of {COMPAT}, not {self.metrics_compat!r}")


def build_app(aggregator: Aggregator, is_ready: Callable[[], bool]) -> Litestar:
    """The HTTP API over ``aggregator``; ``is_ready`` answers ``/ready``."""

    @get("/metrics", sync_to_thread=False)
    def metrics(request: Request) -> Response[bytes]:
        # OpenMetrics (with exemplars) for a scraper that asks for it, as Prometheus does
        # with exemplar storage on; else the classic text format. An explicit header:
        # Litestar would append a second charset to a text/ media type.
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            body, kind = aggregator.render(openmetrics=True), OPENMETRICS_CONTENT_TYPE
        else:
            body, kind = aggregator.render(), CONTENT_TYPE_LATEST
        return Response(body, headers={"content-type": kind})

    @get("/v1/cluster", sync_to_thread=False)
    def cluster() -> dict[str, Any]:
        return aggregator.cluster()

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready() -> Response[dict[str, bool]]:
        ok = is_ready()
        return Response({"ready": ok}, status_code=200 if ok else 503)

    return Litestar(
        route_handlers=[metrics, cluster, health, ready],
        openapi_config=None,
        logging_config=None,
    )


class EmbeddedServer(uvicorn.Server):
    """uvicorn that leaves signal handling to the service lifecycle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (raises ``OSError`` if it is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


class TelemetryService:
    def __init__(self, config: TelemetryConfig, aggregator: Aggregator | None = None) -> None:
        self.config = config
        self.aggregator = aggregator or Aggregator(compat=config.metrics_compat)
        self.bus: Bus | None = None
        self.http_port = config.http_port
        """The bound port, once started (differs from the config's when that is 0)."""
        self._server: EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._connecting: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """Connected to NATS (and so hearing heartbeats and records)."""
        return self.bus is not None and self.bus.nc.is_connected

    async def start(self) -> None:
        """Serve HTTP, then connect to NATS in the background.

        ``/health`` answers at once and ``/ready`` turns 200 once subscribed, so a NATS
        server that is not up yet delays readiness, not startup, and SIGTERM still works;
        one not reached within ``--nats-connect-timeout`` (or that refuses the credential)
        stops the service (``failure``: exit 1).
        """
        self.failure = Failure()
        await self._start_http()
        self._connecting = asyncio.create_task(self._connect())
        log.info("telemetry on http://%s:%d/metrics", self.config.http_host, self.http_port)

    async def _connect(self) -> None:
        """Connect (retrying forever), subscribe, and only then publish ``self.bus``."""
        name = f"telemetry-{socket.gethostname()}-{os.getpid()}"
        try:
            bus = await self.config.nats.connect(name)
        except (NotAdmitted, Unreachable) as exc:
            self.failure.set(str(exc))
            return
        except Exception:
            log.exception("telemetry could not connect to %s", self.config.nats.nats_url)
            self.failure.set("it could not connect to NATS")
            return
        try:
            await self._subscribe(bus)
        except asyncio.CancelledError:
            await bus.close()
            raise
        except Exception:
            log.exception("telemetry could not subscribe")
            await bus.close()
            return
        self.bus = bus
        log.info("telemetry connected to %s", self.config.nats.nats_url)
        # It may only listen (its credential publishes nothing): it counts its own start
        # and its own connection's health.
        self.aggregator.observe_start(ServiceStarted(service="telemetry", instance=name))

        async def own_health(health: BusHealth) -> None:
            self.aggregator.observe_bus(health)

        bus.report_health("telemetry", name, send=own_health)

    async def _subscribe(self, bus: Bus) -> None:
        """Hear heartbeats and records (no queue group: every replica hears everything)."""
        await bus.subscribe(subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False)
        # Records are read, not traced: a span per record would be noise in the request's
        # trace, and its cost would fall on the cores the engine is computing on.
        await bus.subscribe(subjects.EVENTS_REQUEST, RequestRecord, self._on_request, traced=False)
        await bus.subscribe(
            subjects.EVENTS_PLACEMENT, PlacementRecord, self._on_placement, traced=False
        )
        await bus.subscribe(
            subjects.EVENTS_SERVICE, ServiceStarted | BusHealth, self._on_service, traced=False
        )
        await bus.flush()  # the server has our subscriptions before we say ready

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        if stats.worker_id == subjects.sender_worker(msg.subject):  # not one posing as another
            self.aggregator.observe_stats(stats)

    async def _on_service(self, event: ServiceStarted | BusHealth, msg: Msg) -> None:
        if isinstance(event, BusHealth):
            self.aggregator.observe_bus(event)
        else:
            self.aggregator.observe_start(event)

    async def _on_request(self, record: RequestRecord, msg: Msg) -> None:
        # The record travels in its request's trace (the gateway publishes it from the
        # request's span): that trace, if it is recorded, is the exemplar of its latencies.
        context = sampled_context(msg.headers)
        trace_id = format(context.trace_id, "032x") if context is not None else None
        self.aggregator.observe_request(record, trace_id)

    async def _on_placement(self, record: PlacementRecord, msg: Msg) -> None:
        self.aggregator.observe_placement(record)

    async def _start_http(self) -> None:
        """Bind, start uvicorn in a task and wait until it accepts connections."""
        self._socket = sock = listen(self.config.http_host, self.config.http_port)
        self.http_port = sock.getsockname()[1]
        app = build_app(self.aggregator, lambda: self.ready)
        keys = load_keys(self.config.metrics_api_key, self.config.metrics_api_key_file)
        if keys:
            app = ApiKeys(app, keys, open_paths=("/health", "/ready"))
        config = server_config(
            app,
            self.config.http_host,
            self.http_port,
            HEADER_TIMEOUT_S,
            log_config=None,
            timeout_graceful_shutdown=2,
        )
        self._server = server = EmbeddedServer(config)
        self._serving = serving = asyncio.create_task(server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + HTTP_TIMEOUT_S
        while not server.started:
            if serving.done() or asyncio.get_running_loop().time() > deadline:
                await self._stop_http()
                raise RuntimeError(f"telemetry HTTP server did not start on port {self.http_port}")
            await asyncio.sleep(0.01)

    async def _stop_http(self) -> None:
        """Ask uvicorn to exit and wait (bounded) for it; idempotent."""
        server, serving, sock = self._server, self._serving, self._socket
        self._server = self._serving = self._socket = None
        if server is not None:
            server.should_exit = True
        if serving is not None:
            try:
                await asyncio.wait_for(serving, HTTP_TIMEOUT_S)
            except TimeoutError:
                log.warning("telemetry HTTP server did not stop in %.0fs", HTTP_TIMEOUT_S)
            except Exception:
                log.exception("telemetry HTTP server failed")
        if sock is not None:
            sock.close()

    async def _stop_connecting(self) -> None:
        """Give up a connection attempt still in progress."""
        connecting, self._connecting = self._connecting, None
        if connecting is None:
            return
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await connecting

    async def drain(self) -> None:
        """Stop hearing the bus (finishing in-flight handlers); HTTP stays up until close."""
        await self._stop_connecting()
        if self.bus is not None:
            await self.bus.drain()

    async def close(self) -> None:
        await self._stop_connecting()
        await self._stop_http()
        if self.bus is not None:
            await self.bus.close()
