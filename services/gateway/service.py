"""The gateway service: OpenAI HTTP on uvicorn and the NATS request API, one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import option
from lamina.libs.default_tokenizer import ensure_default_tokenizer
from lamina.libs.errors import BusError
from lamina.libs.http_auth import ApiKeys, load_keys, load_policies
from lamina.libs.http_server import (
    server_config,
    shared_socket,
)
from lamina.libs.nats_auth import api_subject
from lamina.libs.rate_limit import RateLimitHeaders, quotas
from lamina.libs.service import announce
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest, GatewayAlive
from lamina.services.gateway.config import GatewayOptions
from lamina.services.gateway.inbox import Inbox
from lamina.services.gateway.intake import Caller, Intake, IntakeLimits, precisions
from lamina.services.gateway.lora_admin import LoraAdmin
from lamina.services.gateway.nats_api import ANY_CLIENT, NatsApi
from lamina.services.gateway.openai_http import OpenAIApi
from lamina.services.gateway.remote_request import RetryPolicy
from lamina.services.gateway.tokenize_pool import TokenizePool
from lamina.services.gateway.tokenizer import ModelTokenizer
from lamina.services.gateway.worker_watch import WorkerWatch

log = logging.getLogger("lamina.gateway")

GATEWAY_HEARTBEAT_S = 2.0
"""How often the gateway tells workers it still reads its inbox."""


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway: OpenAI-compatible HTTP API and NATS request API."""

    nats: NatsConfig = field(default_factory=NatsConfig)
    model: str = option("", "checkpoint directory for the tokenizer (default: default model)")
    model_name: str = option("", "served model name (default: the directory name)")
    http_host: str = option("127.0.0.1", "HTTP listen address")
    http_port: int = option(8000, "HTTP port")
    api_key: str = option(
        "", "API keys clients must send as Authorization: Bearer (comma-separated; none: open)"
    )
    api_key_file: str = option("", "file of API keys, one per line (added to --api-key)")
    api_client_file: str = option(
        "",
        "NATS API clients' policies, one 'api.<name> [best_priority] [rpm=N] [tpm=N] "
        f"[concurrent=N]' per line ('{ANY_CLIENT}': every client without a line of its own)",
    )
    options: GatewayOptions = field(default_factory=GatewayOptions)


def _callers(path: str) -> dict[str, Caller]:
    """Each NATS API identity's policy, from ``--api-client-file``."""
    policies = load_policies(path, "api.<name>") if path else {}
    for name in policies.keys() - {ANY_CLIENT}:
        api_subject(name)  # a BadIdentity (a ValueError) for a name that is not api.<name>
    limits = quotas({name: policy.limits for name, policy in policies.items()})
    return {name: Caller(p.best_priority, limits.get(name)) for name, p in policies.items()}


class _Server(uvicorn.Server):
    """uvicorn inside our own loop: signals belong to the service lifecycle, not uvicorn."""

    def capture_signals(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class GatewayService:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.bus: Bus | None = None
        self.cluster_ready = False
        self._tasks: list[asyncio.Task] = []
        self._server: _Server | None = None
        self._nats_api: NatsApi | None = None
        self._intake: Intake | None = None
        self._tokenize: TokenizePool | None = None
        self.gateway_id = f"{socket.gethostname()}-{os.getpid()}"

    async def start(self) -> None:
        cfg = self.config
        model_dir = Path(cfg.model) if cfg.model else ensure_default_tokenizer()
        tokenizer = await asyncio.to_thread(ModelTokenizer, model_dir)
        self.bus = bus = await cfg.nats.connect("gateway")
        inbox, workers = Inbox(bus), WorkerWatch(bus)
        await inbox.start()
        await workers.start()
        retry = RetryPolicy(
            accept_timeout=cfg.options.accept_timeout,
            stall_timeout=cfg.options.stall_timeout,
            max_attempts=cfg.options.max_attempts,
        )
        limits = IntakeLimits(
            cfg.options.max_open_requests,
            cfg.options.max_open_prompt_tokens,
            cfg.options.max_sequences_per_request,
        )
        name = cfg.model_name or model_dir.name
        self._tokenize = pool = TokenizePool(tokenizer, model_dir, cfg.options.tokenizer_workers)
        await pool.start()
        intake = Intake(bus, inbox, workers, tokenizer, name, retry, limits, pool)
        self._intake = intake
        self._nats_api = NatsApi(bus, intake, _callers(cfg.api_client_file))
        await self._nats_api.start()
        await bus.flush()  # its inbox and the API's subscriptions are in place at the server
        app = OpenAIApi(
            intake,
            ready=lambda: self.cluster_ready,
            tool_call_parser=cfg.options.tool_call_parser,
            trust_request_chat_template=cfg.options.trust_request_chat_template,
            lora_admin=(
                LoraAdmin(bus, intake, self._read_cluster)
                if cfg.options.allow_runtime_lora_updating
                else None
            ),
        ).app()
        keys = load_keys(cfg.api_key, cfg.api_key_file)
        if keys:  # /health and /ready stay open: orchestrators probe them without a key
            app = RateLimitHeaders(app, quotas({k: policy.limits for k, policy in keys.items()}))
            app = ApiKeys(app, keys, open_paths=("/health", "/ready", "/ping"))
        self._server = _Server(
            server_config(
                app,
                cfg.http_host,
                cfg.http_port,
                cfg.options.http_header_timeout,
                cfg.options.http_max_connections,
                cfg.options.http_min_body_rate,
                log_level="warning",
                timeout_graceful_shutdown=int(cfg.options.graceful_shutdown),
            )
        )
        shared = cfg.options.http_reuse_port
        sockets = [shared_socket(cfg.http_host, cfg.http_port)] if shared else None
        self._tasks = [
            asyncio.create_task(self._server.serve(sockets)),
            asyncio.create_task(self._watch_cluster()),
            asyncio.create_task(self._heartbeat(inbox.prefix)),
        ]
        while not self._server.started:
            if self._tasks[0].done():  # e.g. the port is taken
                self._tasks[0].result()
                raise RuntimeError(f"HTTP server on {cfg.http_host}:{cfg.http_port} stopped")
            await asyncio.sleep(0.02)
        await announce(bus, "gateway", self.gateway_id)
        log.info(
            "gateway serving model %s on http://%s:%d",
            intake.model_name,
            cfg.http_host,
            cfg.http_port,
        )

    async def _watch_cluster(self) -> None:
        """Ready means a scheduler answers and knows a live, ready worker."""
        while True:
            with contextlib.suppress(BusError):
                await self._read_cluster()
            await asyncio.sleep(0.5)

    async def _read_cluster(self) -> None:
        """The scheduler's view, once: readiness, and what the model's workers serve."""
        try:
            status = await self.bus.request(
                subjects.SCHED_STATUS, ClusterStatusRequest(), ClusterStatus, timeout=1.0
            )
        except BusError:
            self.cluster_ready = False
            raise
        self.cluster_ready = any(w.alive and w.stats.state == "ready" for w in status.workers)
        model = self._intake.model_name
        ours = [w.stats for w in status.workers if w.alive and w.stats.model == model]
        self._intake.max_context = max((s.max_model_len for s in ours), default=0)
        self._intake.adapters = sorted({a for s in ours for a in s.lora_adapters})
        self._intake.lora_workers = [s.worker_id for s in ours if s.max_loras]
        self._intake.precisions = precisions(ours)

    async def _heartbeat(self, inbox_prefix: str) -> None:
        """Tell workers this gateway still reads its inbox (``GatewayAlive``)."""
        gateway_id = self.gateway_id
        alive = GatewayAlive(
            gateway_id=gateway_id,
            inbox_prefix=inbox_prefix,
            interval_s=GATEWAY_HEARTBEAT_S,
            stream_batches=True,  # the inbox reads them (Inbox._route)
        )
        while True:  # never ends early: workers would stop this gateway's requests
            try:
                await self.bus.publish(subjects.gateway_alive(gateway_id), alive)
            except Exception:  # disconnected for now: the next beat may go through
                log.warning("gateway heartbeat not sent", exc_info=True)
            await asyncio.sleep(GATEWAY_HEARTBEAT_S)

    async def drain(self) -> None:
        """Stop accepting connections and let open requests finish."""
        if self._server is not None:
            self._server.should_exit = True
            await self._tasks[0]
        if self._nats_api is not None:
            await self._nats_api.drain()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tokenize is not None:
            self._tokenize.close()
        if self.bus is not None:
            await self.bus.drain()
