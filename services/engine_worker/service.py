"""The engine-worker service: the engine on its thread, NATS on asyncio.

Subscribes to its own ``generate``, ``cancel`` and ``control`` subjects; streams
``Accepted`` then token events to each request's reply inbox; publishes ``WorkerStats``
every ``stats_interval`` seconds, at once on a state change, and sooner (at most every
``stats_min_interval``) when requests came or went while the schedulers count it half
full (``_prompt_heartbeats``), and KV events as they happen. SIGTERM drains: new requests
are rejected as retryable, accepted ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import context as otel_context

from lamina.libs import spans
from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.cluster import FORGET_AFTER_S, MISSED_HEARTBEATS
from lamina.libs.config import option
from lamina.libs.errors import (
    BadReply,
    CannotStart,
    NoResponders,
    PayloadTooLarge,
    RequestTimeout,
)
from lamina.libs.health import HealthServer
from lamina.libs.service import Failure, announce
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import (
    Cancel,
    ControlAck,
    ControlCommand,
    Cordon,
    Drain,
    Ping,
    ResetPrefixCache,
    Resume,
    Uncordon,
)
from lamina.schemas.v1.generate import (
    Accepted,
    GenerateRequest,
    Rejected,
    RejectReason,
    StreamBatch,
    Tokens,
)
from lamina.schemas.v1.kv import KvSnapshot, KvSyncRequest
from lamina.schemas.v1.kv_transfer import KvGrant
from lamina.schemas.v1.lora import LoadLora, LoraAck, LoraCommand, LoraError
from lamina.schemas.v1.ranks import RankRendezvous, RanksRequest
from lamina.schemas.v1.stats import GatewayAlive, WorkerRole, WorkerState, WorkerStats
from lamina.services.engine_worker import stream_batches, wire
from lamina.services.engine_worker.default_model import with_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.errors import EngineError, InvalidRequestError
from lamina.services.engine_worker.engine.grammar import GrammarCompiler
from lamina.services.engine_worker.engine.lora import (
    LoraAdapter,
    LoraAdapterError,
    LoraDisabledError,
    LoraExistsError,
    LoraInUseError,
    UnknownLoraError,
)
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.outputs import EngineStats
from lamina.services.engine_worker.engine.remote_ranks import Rendezvous
from lamina.services.engine_worker.engine.request import EngineRequest
from lamina.services.engine_worker.engine.spec import EngineSpec
from lamina.services.engine_worker.engine_thread import (
    STREAM_KEEPALIVE_S,
    EngineThread,
    Outgoing,
)
from lamina.services.engine_worker.kv_moves import KvMoves
from lamina.services.engine_worker.lifecycle import Event, IllegalTransition, Lifecycle

log = logging.getLogger("lamina.worker")
tracer = spans.Tracer("lamina.worker")

TRACE_HEARTBEAT_EVERY_S = 10.0
"""Trace a heartbeat at most this often (and every change of state)."""

SNAPSHOT_PART = 40_000
"""Block hashes per ``KvSnapshot`` message: ~20 bytes each in JSON, under 1 MiB."""

MAX_PLACERS_REPORTED = 16
"""Placers (scheduler processes) a heartbeat reports the last placement of: the most
recent ones (replicas are a few; restarted ones fall out)."""

ENGINE_CLOSE_S = 10.0
"""Most seconds closing waits for the engine thread to close its engine (a rank group
takes up to 5 s to join its processes, then kills them)."""

#: States in which a worker refuses requests with a reason of the same name.
_REFUSING = (WorkerState.DRAINING, WorkerState.DEGRADED, WorkerState.FAILED)


@dataclass(frozen=True)
class WorkerConfig:
    """Engine worker: owns one device, its model and KV pool. Every engine setting is a
    flag and a ``LAMINA_*`` variable of its own (``EngineConfig``'s fields)."""

    nats: NatsConfig = field(default_factory=NatsConfig)
    worker_id: str = option("", "unique worker id (default: <host>-<pid>)")
    model_name: str = option("", "served model name (default: the model directory's name)")
    stats_interval: float = option(0.5, "seconds between WorkerStats heartbeats")
    stats_min_interval: float = option(
        0.05,
        "the soonest a heartbeat follows the last when requests came or went and the "
        "schedulers' count of this worker's waiting requests (its last heartbeat's, plus "
        "every one placed since) has reached half of max_num_seqs",
    )
    engine_stall_timeout: float = option(
        60.0,
        "seconds the engine thread may go without a loop iteration before it is failed; "
        "a collective between the worker's ranks that waits half of this fails the group",
    )
    drain_timeout: float = option(300.0, "most seconds SIGTERM waits for in-flight work")
    drain_moves: bool = option(
        False,
        "a drain (SIGTERM, lamina ctl drain) hands running requests to other workers, which "
        "fetch their KV from this one, instead of finishing them here",
    )
    max_waiting_seqs: int = option(
        0,
        "requests that may wait in the engine beyond max_num_seqs running ones before new "
        "ones are refused with a 429 (overloaded); schedulers queue well before that "
        "(0: max_num_seqs)",
    )
    stream_keepalive: float = option(
        STREAM_KEEPALIVE_S,
        "most seconds a request's stream goes without an event while it waits in the engine "
        "(an empty Tokens): keep it under every gateway's --stall-timeout",
    )
    stream_interval: int = option(
        1,
        "tokens a decoding stream sends at once (vLLM's --stream-interval): its first go at "
        "once, the rest every this many (and with its end); above 1, fewer bus messages, "
        "gateway wake-ups and SSE chunks per token, in coarser steps",
    )
    kv_fetch_timeout: float = option(
        10.0,
        "most seconds a request waits for its prefix's KV blocks from another worker (the "
        "scheduler's choice) before it computes them here",
    )
    kv_host: str = option(
        "",
        "address the KV transfer listener binds and advertises to other workers; auto: "
        "the address this host's name resolves to (a container's own); empty: "
        "--distributed-address, else the loopback (workers on this host only)",
    )
    kv_prefill_timeout: float = option(
        30.0,
        "most seconds a request waits for a prefill worker to compute and send its prompt's "
        "KV (disaggregated serving) before it computes the prompt here",
    )
    role: WorkerRole = option(
        WorkerRole.MIXED,
        "what schedulers place here: mixed (whole requests), prefill (prompts' KV for "
        "decode workers) or decode (requests whose prompts a prefill worker computes)",
    )
    health_host: str = option("0.0.0.0", "address /health and /ready are served on")
    health_port: int = option(0, "port for /health and /ready (ready: taking requests; 0: off)")
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        role = WorkerRole(self.role)
        if role == WorkerRole.UNKNOWN:
            raise ValueError(f"--role must be mixed, prefill or decode, not {self.role!r}")
        object.__setattr__(self, "role", role)
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval is at least 1, not {self.stream_interval}")


def transfer_host(kv_host: str, distributed_address: str) -> str:
    """Where a worker's KV transfer listener listens, which its heartbeat advertises:
    ``--kv-host`` (``auto``: what this host's name resolves to, a container's own
    address), else where other hosts reach this one (a node's ``--address``), else the
    loopback (every worker on this host)."""
    if kv_host == "auto":
        return socket.gethostbyname(socket.gethostname())
    return kv_host or distributed_address or "127.0.0.1"


class WorkerIdInUse(RuntimeError):
    """Another running worker serves this worker id."""

    def __init__(self, worker_id: str, evidence: str) -> None:
        super().__init__(
            f"worker id {worker_id!r} is already in use ({evidence}); give each worker its "
            "own --worker-id (the default, <host>-<pid>, is unique)"
        )
        self.worker_id = worker_id


class WorkerService:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:48]  # a.b.c: one token
        self.worker_id = subjects.check_token(
            "worker id", config.worker_id or f"{host}-{os.getpid()}"
        )
        self.lifecycle = Lifecycle()
        self._gateways: dict[str, tuple[float, float]] = {}
        """Gateway inbox prefix -> (when last heard, its heartbeat interval)."""
        self._batching: set[str] = set()
        """The inbox prefixes of gateways that read a ``StreamBatch``."""
        self.cordoned = False
        """Set by ``Cordon``: schedulers place nothing new here (see ``WorkerStats``)."""
        self._beat_state: WorkerState | None = None
        self._traced_beat_at = -TRACE_HEARTBEAT_EVERY_S
        self._outbox_moved = asyncio.Event()
        """Set whenever the outbox is drained: the engine has stepped."""
        self._beat_counts = (0, 0, 0)
        """As of the last heartbeat: requests submitted so far, requests held, and the
        waiting ones it reported."""
        self.incarnation = uuid.uuid4().hex[:16]
        """This run of the worker: a restart under the same id is a new incarnation."""
        self.numerics = ""
        """``WorkerStats.numerics`` once the model is loaded, as each ``Accepted`` says."""
        self.bus: Bus | None = None
        self.engine_thread: EngineThread | None = None
        self.rendezvous: Rendezvous | None = None
        """What the worker's pipeline stages on other hosts join it by, while its engine
        waits for them (``remote_ranks.py``)."""
        self.spec: EngineSpec | None = None
        """What the engine is, once built (the event loop never reads the live engine)."""
        self.grammars: GrammarCompiler | None = None
        """Compiles requests' constraints for the model, off the loop (thread-safe)."""
        self._outbox: asyncio.Queue[list[Outgoing]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.health: HealthServer | None = None
        seqs = config.engine.max_num_seqs
        self.max_held = seqs + (config.max_waiting_seqs or seqs)
        """Requests the engine may hold, running and waiting, before new ones are refused."""
        self.kv: KvMoves | None = None
        """Its KV transfers to and from other workers, once the engine is built."""
        self._fetching: dict[str, bool] = {}
        """Requests accepted that wait for their prefix's blocks -> cancelled meanwhile."""
        self._fetches: set[asyncio.Task] = set()
        self._placements_seen: BoundedDict[str, int] = BoundedDict(MAX_PLACERS_REPORTED)
        """Placer -> the last placement number it sent here that was handled: held since
        (running, waiting or fetching), or refused (the heartbeat's report)."""

    def ready(self) -> bool:
        """Taking requests: loaded, ``ready`` and on the bus (the readiness probe)."""
        connected = self.bus is not None and self.bus.nc.is_connected
        return connected and self.lifecycle.taking_requests

    async def start(self) -> None:
        cfg = self.config
        self.failure = Failure()
        """Set when this worker must stop and be restarted (``libs.service.run``)."""
        if cfg.health_port:  # first: a model that loads for minutes is alive meanwhile
            self.health = await HealthServer(cfg.health_host, cfg.health_port, self.ready).start()
        self.bus = bus = await cfg.nats.connect(f"worker-{self.worker_id}")
        await self._check_id_is_free()  # before loading a model, which can take minutes
        engine_config = with_default_model(cfg.engine)
        self.model_name = cfg.model_name or engine_config.model.name
        # Heartbeat from now on: "starting" while the model loads (minutes for a big one),
        # so the scheduler and telemetry see the worker coming rather than nothing.
        self._tasks = [asyncio.create_task(self._heartbeat())]
        await self._publish_stats()
        aio = asyncio.get_running_loop()
        if engine_config.remote_pipeline_stages:  # its stage hosts ask while it starts
            await bus.subscribe(subjects.worker_ranks(self.worker_id), RanksRequest, self._on_ranks)

        def publish(found: Rendezvous) -> None:  # on the engine thread, while it builds
            aio.call_soon_threadsafe(setattr, self, "rendezvous", found)

        self.engine_thread = EngineThread(
            # Built on the thread that steps it. A hung rank fails its collective well
            # inside the stall timeout, so the failure names the rank, not a stuck thread.
            lambda: Engine(
                engine_config,
                collective_timeout_s=cfg.engine_stall_timeout / 2,
                publish_rendezvous=publish,
            ),
            self.worker_id,
            subjects.worker_kv(self.worker_id),
            emit=lambda batch: aio.call_soon_threadsafe(self._outbox.put_nowait, batch),
            keepalive_s=cfg.stream_keepalive,
            stream_interval=cfg.stream_interval,
            on_step_failure=lambda reason: aio.call_soon_threadsafe(self._degrade, reason),
            on_death=lambda reason: aio.call_soon_threadsafe(self._fail, reason),
            incarnation=self.incarnation,
        )
        self.engine_thread.start()
        # Polled, not waited for on an executor thread: a SIGTERM while a big model loads
        # stops the worker there, and the (daemon) engine thread does not keep it alive.
        while not self.engine_thread.built:
            await asyncio.sleep(0.05)
        try:
            self.spec = spec = self.engine_thread.wait_ready()
        except EngineError as exc:  # a checkpoint it cannot load, a rank that cannot start
            raise CannotStart(str(exc)) from exc
        finally:
            self.rendezvous = None  # its listener is closed: the group is formed, or failed
        self.grammars = spec.grammar_compiler()
        host = transfer_host(cfg.kv_host, engine_config.distributed_address)
        self.kv = KvMoves(self.engine_thread, host, cfg.kv_fetch_timeout, cfg.kv_prefill_timeout)
        await self.kv.start()
        wid = self.worker_id
        await bus.subscribe(subjects.worker_kv_send(wid), KvGrant, self._on_kv_grant)
        await bus.subscribe(subjects.worker_generate(wid), GenerateRequest, self._on_generate)
        await bus.subscribe(subjects.worker_cancel(wid), Cancel, self._on_cancel)
        await bus.subscribe(subjects.worker_control(wid), ControlCommand, self._on_control)
        await bus.subscribe(subjects.worker_lora(wid), LoraCommand, self._on_lora)
        await bus.subscribe(subjects.worker_kv_sync(wid), KvSyncRequest, self._on_kv_sync)
        await bus.subscribe(
            subjects.GATEWAY_ALIVE_ALL, GatewayAlive, self._on_gateway_alive, traced=False
        )
        self._tasks.append(asyncio.create_task(self._publish_outbox()))
        self._tasks.append(asyncio.create_task(self._prompt_heartbeats()))
        self.numerics = self.worker_stats().numerics()
        await bus.flush()  # the server has the subscriptions before a heartbeat says ready
        self.lifecycle.move(Event.LOADED)
        await self._publish_stats()
        log.info(
            "worker %s ready: model %s on %s; KV pool %d blocks of %d tokens (%s cache)",
            wid,
            self.model_name,
            engine_config.device,
            spec.num_kv_blocks,
            spec.block_size,
            engine_config.kv_cache_dtype,
        )
        await announce(bus, "worker", wid)

    async def _on_ranks(self, request: RanksRequest, msg: Msg) -> None:
        """A stage host asks how to join this worker's group: the rendezvous while the
        engine waits for its remote ranks; otherwise not ready, and why."""
        if self.rendezvous is not None:
            answer = wire.rendezvous(self.rendezvous, self.worker_id, self.incarnation)
        else:
            why = (
                "its group is formed (a new rendezvous comes when it restarts)"
                if self.spec is not None
                else "it is starting: its rendezvous comes once its own ranks have started"
            )
            answer = RankRendezvous(
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                ready=False,
                message=f"worker {self.worker_id}: {why}",
            )
        await self.bus.reply(msg, answer)

    async def _check_id_is_free(self) -> None:
        """Refuse to start under an id a running worker already serves: both would take
        every request sent to it, and the gateway would see each accepted twice."""
        subject = subjects.worker_control(self.worker_id)
        try:
            ack = await self.bus.request(subject, Ping(), ControlAck, timeout=2.0)
        except NoResponders:
            return
        except (RequestTimeout, BadReply) as exc:  # a stuck or older worker holds the id
            raise WorkerIdInUse(self.worker_id, str(exc)) from exc
        raise WorkerIdInUse(self.worker_id, f"a worker in state {ack.state!r} answered")

    # ---------------------------------------------------------------------------- handlers
    async def _on_generate(self, request: GenerateRequest, msg: Msg) -> None:
        try:
            await self._take(request, msg)
        finally:  # held now, or refused: the next heartbeat's counts show it
            if request.placed_by:
                seen = self._placements_seen.get(request.placed_by, 0)
                self._placements_seen[request.placed_by] = max(seen, request.placement_seq)

    async def _take(self, request: GenerateRequest, msg: Msg) -> None:
        """Hand a placed request to the engine, or refuse it."""
        if not msg.reply:
            log.warning("generate request %s has no reply subject; dropped", request.request_id)
            return
        if self._gone(msg.reply, time.monotonic()):  # e.g. it waited in a scheduler's queue
            log.warning("request %s dropped: its gateway is gone", request.request_id)
            return
        rid = request.request_id
        if not self.lifecycle.taking_requests:
            state = self.lifecycle.state
            reason = RejectReason(state) if state in _REFUSING else RejectReason.NO_WORKER
            message = f"worker {self.worker_id} is {state}"
            await self._refuse(msg.reply, rid, reason, message, retryable=True)
            return
        if (held := self.engine_thread.num_requests + len(self._fetching)) >= self.max_held:
            # Placed on a stale view (schedulers queue well before this): refused up front
            # rather than left to wait behind a queue this long.
            message = f"worker {self.worker_id} holds {held} requests, its most"
            await self._refuse(
                msg.reply, rid, RejectReason.OVERLOADED, message, retryable=True, retry_after_s=1.0
            )
            return
        try:
            if request.sampling.structured is None:
                checked = wire.engine_request(request, self.spec, lora=self._adapter(request))
            else:  # compiled here, not on the engine's thread, and not on this loop
                checked = await asyncio.to_thread(self._constrained, request)
        except InvalidRequestError as exc:
            reason = RejectReason.INVALID_REQUEST
            await self._refuse(msg.reply, rid, reason, exc.message, param=exc.param)
            return
        # Accept at once, through the outbox (so it precedes the request's tokens, which
        # the engine thread queues there too) and after the engine has the request (so its
        # step does not wait on the publish): the client learns where to cancel before the
        # engine's first step ends.
        context = otel_context.get_current()
        accepted = Accepted(
            request_id=request.request_id, worker_id=self.worker_id, numerics=self.numerics
        )
        self._outbox.put_nowait([(msg.reply, accepted, context)])
        if request.kv_source is None or self.kv is None:
            self.engine_thread.submit(request, msg.reply, context, checked)
            return
        self._fetching[rid] = False
        task = asyncio.create_task(self._fetch_then_submit(request, msg.reply, context, checked))
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)

    async def _fetch_then_submit(
        self, request: GenerateRequest, reply: str, context: Any, checked: EngineRequest
    ) -> None:
        """Fetch the request's leading blocks from the worker the scheduler named, then
        hand the request to the engine, which finds them cached (or, when the fetch
        failed, computes them). The stream is kept alive meanwhile (a prefill leg takes
        as long as the prompt's prefill on the other worker)."""
        rid = request.request_id
        assert self.kv is not None and request.kv_source is not None
        fetching = asyncio.create_task(self.kv.fetch(rid, request.kv_source, context))
        seq = 1  # 0 was Accepted
        try:
            while not fetching.done():
                await asyncio.wait({fetching}, timeout=self.config.stream_keepalive)
                if not fetching.done() and not self._fetching.get(rid, True):
                    alive = Tokens(request_id=rid, seq=seq, token_ids=[])
                    self._outbox.put_nowait([(reply, alive, context)])
                    seq += 1
        finally:
            fetching.cancel()
            cancelled = self._fetching.pop(rid, True)
        if not cancelled:
            self.engine_thread.submit(request, reply, context, checked, seq)

    def _constrained(self, request: GenerateRequest) -> EngineRequest:
        """A request with a structured output constraint, compiled and checked."""
        grammar = wire.constraint(self.grammars, request.sampling.structured)
        return wire.engine_request(request, self.spec, grammar, self._adapter(request))

    def _adapter(self, request: GenerateRequest) -> str | None:
        """The LoRA adapter ``request`` names as its ``model`` (None: the base model; a
        worker without LoRA runs every request on its model, as it always did)."""
        engine = self.config.engine
        if not engine.enable_lora or request.model == self.model_name:
            return None
        return request.model

    async def _refuse(
        self, reply: str, request_id: str, reason: RejectReason, message: str, **fields: object
    ) -> None:
        rejected = Rejected(
            request_id=request_id,
            reason=reason,
            message=message,
            worker_id=self.worker_id,
            **fields,
        )
        await self.bus.publish(reply, rejected)

    @property
    def state(self) -> WorkerState:
        return self.lifecycle.state

    def _degrade(self, reason: str) -> None:
        """An engine step failed: take no new work until an operator sends ``Resume``
        (the scheduler places only on ready workers; the heartbeat says why not here)."""
        if self.lifecycle.move(Event.STEP_FAILED, reason):
            log.error(
                "worker %s is degraded: %s; send Resume to take work again", self.worker_id, reason
            )
            self._tasks.append(asyncio.create_task(self._publish_stats()))

    def _fail(self, reason: str) -> None:
        """The engine thread is gone (it died, or it is wedged): what it held was failed
        as retryable, so gateways move it elsewhere; this worker takes nothing again. A
        worker of several ranks then exits, for its supervisor to restart the whole group
        (one rank cannot rejoin a group whose collectives broke)."""
        if self.lifecycle.move(Event.ENGINE_DEAD, reason):
            log.critical("worker %s has failed: %s; restart it", self.worker_id, reason)
            self._tasks.append(asyncio.create_task(self._publish_stats()))
            if self.spec is not None and len(self.spec.ranks) > 1:
                self._tasks.append(asyncio.create_task(self._exit_failed(reason)))

    async def _exit_failed(self, reason: str) -> None:
        """Stop the worker (exit status 1) once what its streams were told is sent."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), 5.0)
        await self._publish_stats()
        self.failure.set(reason)

    def _check_engine(self) -> None:
        """Turn a wedged engine thread into a failed worker (a dead one reports itself)."""
        thread = self.engine_thread
        if thread is None or thread.spec is None or thread.dead:
            return
        stalled = time.monotonic() - thread.beat
        if stalled > self.config.engine_stall_timeout:
            thread.declare_wedged(
                f"the engine thread has been stuck for {stalled:.0f}s "
                f"(engine_stall_timeout {self.config.engine_stall_timeout:g}s)"
            )

    async def _on_kv_sync(self, _: KvSyncRequest, msg: Msg) -> None:
        """Answer a scheduler that lost track of this worker's cache with all of it."""
        if not msg.reply:
            return
        taken: list[tuple[list[int], dict[str, list[int]], int]] = []
        done = self.engine_thread.call(lambda engine: taken.append(engine.blocks.snapshot()))
        if not await asyncio.to_thread(done.wait, 5.0) or not taken:
            log.warning("no KV snapshot within 5 s; the scheduler will ask again")
            return
        device, tiers, next_event_id = taken[0]
        host, disk = tiers.get("host", []), tiers.get("disk", [])
        count = max(1, -(-max(len(device), len(host), len(disk)) // SNAPSHOT_PART))
        for n in range(count):
            part = slice(n * SNAPSHOT_PART, (n + 1) * SNAPSHOT_PART)
            snapshot = KvSnapshot(
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                block_size=self.spec.block_size,
                next_event_id=next_event_id,
                block_hashes=device[part],
                host_block_hashes=host[part],
                disk_block_hashes=disk[part],
                part=n,
                last=n == count - 1,
            )
            await self.bus.publish(msg.reply, snapshot)

    async def _on_gateway_alive(self, alive: GatewayAlive, msg: Msg) -> None:
        self._gateways[alive.inbox_prefix] = (time.monotonic(), alive.interval_s)
        if alive.stream_batches:
            self._batching.add(alive.inbox_prefix)

    def _stop_orphans(self) -> None:
        """Cancel the requests of a gateway that stopped heartbeating: nobody reads their
        tokens. A reply subject of a requester never heard from is left alone."""
        now = time.monotonic()
        for prefix, (seen, interval) in list(self._gateways.items()):
            if now - seen > FORGET_AFTER_S + MISSED_HEARTBEATS * interval:  # long gone
                del self._gateways[prefix]
                self._batching.discard(prefix)
        orphaned = [rid for rid, reply in self.engine_thread.replies() if self._gone(reply, now)]
        for request_id in orphaned:
            self.engine_thread.cancel(request_id)
        if orphaned:
            log.warning("stopped %d requests whose gateway is gone", len(orphaned))

    def _gone(self, reply: str, now: float) -> bool:
        """Whether the gateway that reads ``reply`` has stopped heartbeating."""
        seen = self._gateways.get(subjects.stream_inbox(reply))
        return seen is not None and now - seen[0] > MISSED_HEARTBEATS * seen[1]

    async def _on_cancel(self, cancel: Cancel, msg: Msg) -> None:
        if cancel.request_id in self._fetching:
            self._fetching[cancel.request_id] = True
        self.engine_thread.cancel(cancel.request_id)

    async def _on_kv_grant(self, grant: KvGrant, msg: Msg) -> None:
        assert self.kv is not None
        await self.kv.grant(grant, otel_context.get_current())

    async def _on_lora(self, command: LoraCommand, msg: Msg) -> None:
        """Load or unload an adapter at run time (the gateway's ``/v1/load_lora_adapter``):
        read off the engine's thread, installed on it; a heartbeat says so at once."""
        if not msg.reply:
            return
        try:
            await self._apply_lora(command)
        except InvalidRequestError as exc:
            ack = LoraAck(
                worker_id=self.worker_id, ok=False, error=_lora_error(exc), message=exc.message
            )
        else:
            ack = LoraAck(worker_id=self.worker_id, ok=True)
            await self._publish_stats()
        log.info("worker %s: %s %s: %s", self.worker_id, type(command).__name__, command.name, ack)
        await self.bus.publish(msg.reply, ack)

    async def _apply_lora(self, command: LoraCommand) -> None:
        """Raises the engine's ``InvalidRequestError`` (a LoRA error) when it cannot."""
        spec, thread = self.spec, self.engine_thread
        if spec is None or thread is None or not spec.config.enable_lora:
            raise LoraDisabledError()
        if command.name == self.model_name:
            raise LoraExistsError(command.name)
        if isinstance(command, LoadLora):
            model = ModelConfig.from_dir(spec.config.model)
            rank = spec.config.max_lora_rank
            try:
                adapter = await asyncio.to_thread(
                    LoraAdapter.load, command.name, command.path, model, rank
                )
            except LoraAdapterError as exc:
                raise InvalidRequestError(str(exc), "lora_path") from exc
            change = functools.partial(Engine.add_adapter, adapter=adapter)
        else:
            change = functools.partial(Engine.remove_adapter, name=command.name)
        failed: list[InvalidRequestError] = []

        def apply(engine: Engine) -> None:
            try:
                change(engine)
            except InvalidRequestError as exc:
                failed.append(exc)

        await asyncio.to_thread(thread.call(apply).wait)
        if failed:
            raise failed[0]

    async def _on_control(self, command: ControlCommand, msg: Msg) -> None:
        ok, message = True, ""
        try:
            match command:
                case Drain(move=move):
                    self.lifecycle.move(Event.DRAIN, "drained by an operator")
                    if move or self.config.drain_moves:
                        await self._hand_off("drained by an operator")
                case ResetPrefixCache():
                    done = self.engine_thread.call(lambda engine: engine.reset_prefix_cache())
                    await asyncio.to_thread(done.wait, 5.0)
                case Resume():
                    self.lifecycle.move(Event.RESUME)
                case Cordon() | Uncordon():
                    self.cordoned = isinstance(command, Cordon)
                    log.info(
                        "worker %s %s",
                        self.worker_id,
                        "cordoned" if self.cordoned else "uncordoned",
                    )
        except IllegalTransition as exc:
            ok, message = False, str(exc)
        if not isinstance(command, Ping):  # a ping is only answered
            await self._publish_stats()
        ack = ControlAck(
            worker_id=self.worker_id,
            ok=ok,
            state=self.state,
            message=message,
            cordoned=self.cordoned,
        )
        await self.bus.reply(msg, ack)

    # ------------------------------------------------------------------------- publishing
    async def _publish_outbox(self) -> None:
        """One task publishes everything in order: the ``seq`` contract (``StreamEvent``);
        what has piled up meanwhile goes together, a batch per gateway that reads them."""
        while True:
            taken = [await self._outbox.get()]
            while not self._outbox.empty():
                taken.append(self._outbox.get_nowait())
            self._outbox_moved.set()
            outgoing = (item for batch in taken for item in batch)
            for subject, message, context in stream_batches.coalesce(
                outgoing, self._batching, self.worker_id
            ):
                await self._publish_event(subject, message, context)
            for _ in taken:
                self._outbox.task_done()

    async def _publish_event(self, subject: str, message: Any, context: Any) -> None:
        try:
            # Its own span each (a token event per step) would be noise: the request's
            # span here covers them, and they carry its context.
            await self.bus.publish(subject, message, context=context, traced=False)
        except PayloadTooLarge:
            if not isinstance(message, StreamBatch) or len(message.events) < 2:
                log.exception("publish to %s failed", subject)
                return
            for half in stream_batches.split(message):
                await self._publish_event(subject, half, context)
        except Exception:
            log.exception("publish to %s failed", subject)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval)
            self._check_engine()
            if self.spec is not None:
                self._stop_orphans()
            with contextlib.suppress(Exception):
                await self._publish_stats()

    async def _prompt_heartbeats(self) -> None:
        """A heartbeat before the schedulers think this worker full when it is not. A
        scheduler counts every request placed here that no heartbeat showed yet as waiting
        (``Placer.saturated``: full once those and the heartbeat's waiting ones reach
        ``max_num_seqs``), so between ``stats_interval`` heartbeats short requests that had
        long finished kept it full in their eyes, and new ones waited in the queue for
        room that was free. Once that count reaches half of ``max_num_seqs`` and requests
        came or went, a heartbeat goes (at most one per ``stats_min_interval``); below
        it, nothing extra is sent. Woken by the outbox (the engine stepped): an idle worker
        is not woken at all."""
        thread, spec = self.engine_thread, self.spec
        assert thread is not None and spec is not None
        while True:
            await self._outbox_moved.wait()
            self._outbox_moved.clear()
            submitted, held, waiting = self._beat_counts
            placed = thread.submitted - submitted
            moved = placed or thread.num_requests != held
            if moved and 2 * (waiting + placed) >= spec.config.max_num_seqs:
                with contextlib.suppress(Exception):
                    await self._publish_stats()
            await asyncio.sleep(self.config.stats_min_interval)

    def worker_stats(self) -> WorkerStats:
        """The heartbeat: identity, state and limits, plus the engine's counters once it
        exists (zeros while the model loads)."""
        spec = self.spec
        config = spec.config if spec is not None else self.config.engine
        counters = (
            self.engine_thread.stats if self.engine_thread is not None else None
        ) or EngineStats()
        if self.engine_thread is not None:
            # The engine's counts are as of its last stats (every 0.1 s) and leave out what
            # was handed over since: a scheduler that trusted them would over-place here.
            held = self.engine_thread.num_requests + len(self._fetching)
            waiting = max(held - counters.num_running, counters.num_waiting)
            counters = dataclasses.replace(counters, num_waiting=waiting)
        return WorkerStats(
            worker_id=self.worker_id,
            model=self.model_name,
            device=config.device,
            state=self.state,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=spec.max_model_len if spec is not None else config.max_model_len or 0,
            timestamp_ms=int(time.time() * 1000),
            heartbeat_interval_s=self.config.stats_interval,
            state_reason=self.lifecycle.reason,
            incarnation=self.incarnation,
            cordoned=self.cordoned,
            kv_cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=config.enable_prefix_caching,
            dtype=spec.dtype if spec is not None else "",
            weight_dtype=spec.weight_dtype if spec is not None else "",
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            ranks=[wire.rank(info) for info in spec.ranks] if spec is not None else [],
            prefix_cache_hit_ratio=counters.prefix_cache_hit_ratio,
            **dataclasses.asdict(counters),
            **(self.kv.stats() if self.kv is not None else {}),
            role=self.config.role,
            max_loras=config.max_loras if config.enable_lora else 0,
            placements_seen=dict(self._placements_seen),
        )

    async def _publish_stats(self) -> None:
        """A heartbeat. One every ``TRACE_HEARTBEAT_EVERY_S`` is traced, as its own small
        trace, and so is any that reports a new state: a placement links to the last
        traced heartbeat of each worker it weighed, and the trace store gets a few spans a
        minute per worker, not one for each heartbeat."""
        stats, subject = self.worker_stats(), subjects.worker_stats(self.worker_id)
        if (thread := self.engine_thread) is not None:
            self._beat_counts = (thread.submitted, thread.num_requests, stats.num_waiting)
        now = time.monotonic()
        sampled = (
            now - self._traced_beat_at >= TRACE_HEARTBEAT_EVERY_S or stats.state != self._beat_state
        )
        self._beat_state = stats.state
        if not sampled:
            await self.bus.publish(subject, stats)
            return
        self._traced_beat_at = now
        attributes = {"lamina.worker_id": self.worker_id, "lamina.state": str(stats.state)}
        with spans.Current(
            spans.start(tracer, f"heartbeat {self.worker_id}", attributes=attributes)
        ):
            await self.bus.publish(subject, stats)

    # -------------------------------------------------------------------------- lifecycle
    async def drain(self) -> None:
        """Stop taking requests, let accepted ones finish, flush what they produced."""
        with contextlib.suppress(IllegalTransition):  # a failed worker has nothing to drain
            self.lifecycle.move(Event.SHUTDOWN, "shutting down (SIGTERM)")
        await self._publish_stats()
        thread = self.engine_thread
        if thread is None or self.spec is None:  # stopped while starting
            return
        if self.config.drain_moves:
            await self._hand_off("shutting down (SIGTERM)")
        deadline = time.monotonic() + self.config.drain_timeout
        while time.monotonic() < deadline and (
            (not thread.dead and (thread.num_requests or self._fetching))
            or (self.kv is not None and self.kv.pending)  # its blocks' receivers may come
        ):
            await asyncio.sleep(0.05)
        await self._outbox.join()

    async def _hand_off(self, why: str) -> None:
        """Move every request this worker holds elsewhere: the engine fails them as
        retryable, so their gateways resubmit them, and the scheduler has their new
        workers fetch the blocks they computed here (this worker stays up, within its
        drain timeout, until those grants are spent or lapse)."""
        assert self.engine_thread is not None
        for request_id in self._fetching:  # they would start here after their fetch
            self._fetching[request_id] = True
        held = self.engine_thread.num_requests
        done = self.engine_thread.hand_off(f"worker {self.worker_id} moved it: {why}")
        await asyncio.to_thread(done.wait, 30.0)
        log.info("handed %d requests to other workers (%s)", held, why)

    async def close(self) -> None:
        if self.health is not None:
            await self.health.stop()
        if self.engine_thread is not None:
            self.engine_thread.stop()
        if self.kv is not None:
            await self.kv.close()
        if self.engine_thread is not None and self.engine_thread.is_alive():
            # The thread closes the engine as it ends: a parallel engine's rank group (its
            # processes, torch.distributed's threads) must be gone before the interpreter
            # finalises, or a C++ thread still running aborts the process. A thread
            # stuck in a step is left behind (it is a daemon).
            await asyncio.to_thread(self.engine_thread.join, ENGINE_CLOSE_S)
        for task in self._tasks:
            task.cancel()
        if self.bus is not None:
            await self.bus.drain()


def _lora_error(exc: InvalidRequestError) -> LoraError:
    """The wire's reason for an engine's LoRA refusal."""
    kinds = {
        LoraDisabledError: LoraError.DISABLED,
        LoraExistsError: LoraError.EXISTS,
        UnknownLoraError: LoraError.NOT_FOUND,
        LoraInUseError: LoraError.IN_USE,
    }
    return kinds.get(type(exc), LoraError.INVALID)
