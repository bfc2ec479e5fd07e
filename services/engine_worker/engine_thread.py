"""The engine on its own thread, fed by a command queue, reporting through a callback.

The engine is synchronous and not thread-safe, so only this thread touches it; other
threads read its :class:`EngineSpec` (immutable) and its last :class:`EngineStats`. The
asyncio side submits commands (add, cancel, call) through a thread-safe queue; the thread
steps the engine whenever it has work and hands each step's events, made by ``Streams``
(and traced by ``StepTracer``), grouped in one list, to ``emit`` (which must be
thread-safe: the service wraps ``loop.call_soon_threadsafe``).

The thread also builds the engine. Torch's OpenMP runtime keeps a pool of worker threads
for every thread that ever ran a parallel op, and once pools and their owners outnumber
the cores it stops spinning between parallel regions and sleeps instead (libgomp's
throttled spin): with the engine built on an executor thread and stepped on this one,
each parallel op ran slower (``docs/performance.md``, "Stack overhead").

Keep-alives come from a timer thread of their own, not from the loop between steps: one
step can take seconds (a long prefill, a loaded CPU), and a stream's keep-alive must not
wait for it. The streams are this thread's except while it steps the engine or waits for
commands: it holds ``_turn`` otherwise, and emits under it, so events leave in ``seq``
order whichever thread numbered them. A step that never returns is the worker's to find
(``engine_stall_timeout``), not the gateway's.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from lamina.schemas.v1.generate import Failed, GenerateRequest, RejectReason
from lamina.schemas.v1.kv import KvEventBatch
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.deadlines import Deadlines
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.errors import InvalidRequestError, RankGroupFailure
from lamina.services.engine_worker.engine.outputs import EngineStats
from lamina.services.engine_worker.engine.request import EngineRequest
from lamina.services.engine_worker.engine.spec import EngineSpec
from lamina.services.engine_worker.step_tracing import StepTracer, request_span
from lamina.services.engine_worker.streams import Outgoing, Stream, Streams

log = logging.getLogger("lamina.worker.engine")

_STATS_PERIOD_S = 0.1
STREAM_KEEPALIVE_S = 5.0
"""Most seconds a stream goes without an event. A request waiting in the engine (behind
``max_num_seqs`` running ones, or in a long prefill) is sent an empty ``Tokens`` this
often, so that its gateway knows it waits and is not lost: the gateway's stall timeout
counts silence from a worker that still heartbeats."""
_KEEPALIVE_CHECK_S = 1.0
_WEDGED_TURN_WAIT_S = 1.0
HANDOFF_WAIT_S = 0.002
"""Most seconds :meth:`EngineThread.submit` blocks the event loop handing a request to an
idle engine thread (it normally takes tens of microseconds)."""


@dataclass
class _Add:
    request: GenerateRequest  # as it came (what its span tells)
    checked: EngineRequest  # as the engine takes it
    reply: str
    context: Any
    taken: threading.Event | None = None  # set once the engine has the request
    seq: int = 1  # its stream's next event's (0 was Accepted; the worker may have sent more)


@dataclass
class _Prefill:
    checked: EngineRequest
    done: Callable[[], None]


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], None]
    done: threading.Event = field(default_factory=threading.Event)


class EngineThread(threading.Thread):
    """Owns the engine; see the module docstring."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        worker_id: str,
        kv_subject: str,
        emit: Callable[[list[Outgoing]], None],
        handoff_wait: float = HANDOFF_WAIT_S,
        keepalive_s: float = STREAM_KEEPALIVE_S,
        stream_interval: int = 1,
        on_step_failure: Callable[[str], None] = lambda reason: None,
        on_death: Callable[[str], None] = lambda reason: None,
        incarnation: str = "",
    ) -> None:
        super().__init__(name="engine", daemon=True)
        self._make_engine = make_engine
        self.engine: Engine | None = None
        """Set by the thread once built (see :meth:`wait_ready`); only this thread uses it."""
        self.spec: EngineSpec | None = None
        """What the engine is, once built: what other threads read."""
        self.worker_id = worker_id
        self.kv_subject = kv_subject
        self.incarnation = incarnation
        """Put on every ``KvEventBatch`` (see ``WorkerStats.incarnation``)."""
        self.emit = emit
        self.stats: EngineStats | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = Streams(stream_interval)
        self._prefills: dict[str, Callable[[], None]] = {}
        """Prefill legs in the engine (streamless) -> what to call when they end."""
        self._tracer = StepTracer(worker_id)
        self._deadlines = Deadlines()
        self._stopping = threading.Event()
        self._stats_at = 0.0
        self._lock = threading.Lock()
        self._turn = threading.Lock()
        """Who may touch the streams: the engine thread but while it steps or waits for
        commands, when the keep-alive timer may."""
        self._pending_adds = 0
        self._idle = False  # the thread is (about to be) blocked on an empty queue
        self._handoff_wait = handoff_wait
        self.keepalive_s = keepalive_s
        """Most seconds a stream goes without an event (:data:`STREAM_KEEPALIVE_S`)."""
        self.on_step_failure = on_step_failure
        """Called (on this thread) with the reason after a step raised and every request
        in the engine was failed."""
        self.on_death = on_death
        """Called once with the reason when the thread can no longer serve: it raised out
        of its loop, or :meth:`declare_wedged` found it stuck. What it held was failed."""
        self.submitted = 0
        """Requests submitted so far (counted on the asyncio side): with
        :attr:`num_requests`, it tells whether any came or went since it was last read."""
        self.beat = time.monotonic()
        """When the thread last went round its loop (at least every ``_STATS_PERIOD_S``
        while it is idle, once per step while it is busy)."""
        self._dead = False

    # ---------------------------------------------------------------- called from asyncio
    def submit(
        self,
        request: GenerateRequest,
        reply: str,
        context: Any = None,
        checked: EngineRequest | None = None,
        seq: int = 1,
    ) -> None:
        """Queue ``request``; ``checked``: it as ``wire.engine_request`` made it (made here
        if None, raising the engine's ``InvalidRequestError`` before anything is queued);
        ``seq``: its stream's next event's (the worker sent keep-alives while it waited).

        When the engine thread is idle, wait (at most ``handoff_wait`` s) until it has
        added the request. Woken by the queue, it still needs the GIL, which this thread
        would otherwise keep through the rest of its loop iteration (publishing
        ``Accepted``, flushing the socket). Blocked here, it lends the engine the GIL at
        once, which shortens the time from receipt to ``Engine.add`` and so to the first
        token. A busy engine takes the request at its next step; nothing waits then.
        """
        assert self.spec is not None, "submit after the engine is built"
        checked = checked or wire.engine_request(request, self.spec)
        self.submitted += 1
        with self._lock:
            self._pending_adds += 1
        taken = threading.Event() if self._idle else None
        self._commands.put(_Add(request, checked, reply, context, taken, seq))
        if taken is not None:
            taken.wait(self._handoff_wait)

    def prefill(self, checked: EngineRequest, done: Callable[[], None]) -> None:
        """Compute ``checked``'s prompt into the prefix cache, streaming nothing (a prefill
        leg: another worker fetches the blocks); ``done()`` is called on this thread once
        the request ended, computed or failed. A leg counts as a request here (the
        scheduler placed it, and it takes a sequence in the engine)."""
        self.submitted += 1
        with self._lock:
            self._pending_adds += 1
        self._commands.put(_Prefill(checked, done))

    def cancel(self, request_id: str) -> None:
        self._commands.put(_Cancel(request_id))

    def replies(self) -> list[tuple[str, str]]:
        """``(request id, reply subject)`` of every request the thread streams, as of now
        (a copy, safe to take from another thread)."""
        return [(rid, stream.reply) for rid, stream in list(self._streams.items())]

    def call(self, fn: Callable[[Engine], None]) -> threading.Event:
        """Run ``fn(engine)`` on the engine thread; the returned event is set after."""
        command = _Call(fn)
        self._commands.put(command)
        return command.done

    @property
    def built(self) -> bool:
        """Whether the thread has finished building the engine (or failed to)."""
        return self._ready.is_set()

    def wait_ready(self) -> EngineSpec:
        """Block until the thread has built the engine; re-raise what stopped it if not."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        assert self.spec is not None
        return self.spec

    @property
    def idle(self) -> bool:
        """Whether the thread is waiting for commands (no work in the engine)."""
        return self._idle

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished, prefill legs and queued commands
        included."""
        with self._lock:
            return self._pending_adds + self._in_engine()

    def _in_engine(self) -> int:
        """Streams and prefill legs the engine holds."""
        return len(self._streams) + len(self._prefills)

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)

    def hand_off(self, reason: str) -> threading.Event:
        """Fail every request the engine holds as retryable (``draining``), so that their
        gateways move them; set once done. Their computed blocks stay cached here, for
        the workers they move to to fetch."""
        return self.call(lambda engine: self._fail_all(reason, RejectReason.DRAINING))

    def declare_wedged(self, reason: str) -> None:
        """The thread is stuck (no loop iteration for too long): fail what it held, as
        the dead thread would have, and stop it should it ever come back."""
        self._stopping.set()
        # Stuck in a step, it has lent out the streams; stuck elsewhere, it holds them
        # and never gives them back, so the wait is short and the failing goes on anyway.
        turn = self._turn.acquire(timeout=_WEDGED_TURN_WAIT_S)
        try:
            self._die(reason)
        finally:
            if turn:
                self._turn.release()

    @property
    def dead(self) -> bool:
        """Whether the thread has stopped serving for good (see ``on_death``)."""
        return self._dead

    # ------------------------------------------------------------------ the engine thread
    def run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.stats = self.engine.stats()
            self.spec = self.engine.spec
        except BaseException as exc:  # handed to wait_ready's caller
            self._startup_error = exc
            return
        finally:
            self._ready.set()
        threading.Thread(target=self._keep_alive, name="keep-alive", daemon=True).start()
        try:
            with self._turn:
                try:
                    self._serve()
                except RankGroupFailure as exc:  # a rank exited or hung: the group is lost
                    log.critical("%s", exc)
                    self._die(str(exc))
                except BaseException as exc:  # whatever ends the thread ends the service
                    log.exception("the engine thread died")
                    self._die(f"the engine thread died: {type(exc).__name__}: {exc}")
        finally:
            self.engine.close()

    def _serve(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self.beat = time.monotonic()
            held = self._in_engine()
            self._drain_commands(block=not engine.has_work())
            if engine.has_work():
                started = self._tracer.start()
                try:
                    with self._lend_streams():
                        result = engine.step()
                except RankGroupFailure:
                    raise  # not this step's failure: the engine's (see run)
                except Exception:  # a bug in a step must not leave clients hanging
                    log.exception("engine step failed")
                    self._fail_all("engine step failed", RejectReason.DEGRADED)
                    self.on_step_failure("engine step failed")
                    continue
                self._end_prefills(result.outputs)
                traced = self._tracer.requests(result.batch, self._streams, started)
                batch = self._streams.outputs(result.outputs)
                if self._in_engine() != held:  # requests came or went: fresh counts
                    self._refresh_stats(now=True)  # before their events wake the loop
                if traced is not None:  # its tokens go first: they do not wait for spans
                    if batch:
                        self.emit(batch)
                    batch = self._kv_events(self._tracer.step(traced, result.kv_usage))
                else:
                    batch += self._kv_events()
                if batch:
                    self.emit(batch)
                self._stop_expired()
            self._refresh_stats()

    @contextlib.contextmanager
    def _lend_streams(self) -> Iterator[None]:
        """Let the keep-alive timer at the streams while this thread waits."""
        self._turn.release()
        try:
            yield
        finally:
            self._turn.acquire()

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
        self._fail_all(reason, RejectReason.FAILED)
        self._fail_queued(reason)
        self.on_death(reason)

    def _fail_queued(self, reason: str) -> None:
        """Answer the commands nobody will run: queued requests fail as retryable."""
        batch: list[Outgoing] = []
        with contextlib.suppress(queue.Empty):
            while True:
                match self._commands.get_nowait():
                    case _Add(request=request, reply=reply, context=context, taken=taken, seq=seq):
                        failed = Failed(
                            request_id=request.request_id,
                            seq=seq,
                            message=reason,
                            retryable=True,
                            tokens_sent=False,
                            reason=RejectReason.FAILED,
                        )
                        batch.append((reply, failed, context))
                        if taken is not None:
                            taken.set()
                    case _Call(done=done):
                        done.set()
                    case _Prefill(done=ended):
                        ended()
        with self._lock:
            self._pending_adds = 0
        if batch:
            self.emit(batch)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = None
            if block:
                self._idle = True
                try:
                    with self._lend_streams():
                        command = self._commands.get(timeout=_STATS_PERIOD_S)
                finally:
                    self._idle = False
            while True:
                if command is not None:
                    self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: Any) -> None:
        match command:
            case _Add(request, checked, reply, context, taken, seq):
                try:
                    with self._lock:
                        self._add(request, checked, reply, context, seq)
                        self._pending_adds -= 1
                finally:
                    if taken is not None:
                        taken.set()
            case _Prefill(checked, done):
                with self._lock:
                    self._pending_adds -= 1
                    try:
                        self.engine.add(checked)
                    except Exception:  # a duplicate id: the leg ends at once, computing nothing
                        log.exception("prefill leg %s refused", checked.request_id)
                    else:
                        self._prefills[checked.request_id] = done
                        return
                done()
            case _Cancel(request_id):
                if self.engine.abort(request_id):
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.end("cancelled")
            case _Call(fn, done):
                try:
                    fn(self.engine)
                    if kv := self._kv_events():  # e.g. a reset: tell the scheduler now,
                        self.emit(kv)  # not after the next request's step
                finally:
                    done.set()

    def _add(
        self, request: GenerateRequest, checked: EngineRequest, reply: str, context: Any, seq: int
    ) -> None:
        """Queue a checked request, already answered ``Accepted``. If the engine refuses
        it after all (its id is running here), that request fails alone."""
        rid = request.request_id
        old = self._streams.get(rid)
        if old is not None and request.attempt > 0:
            # A resubmission of a request still running here: its gateway lost sight of
            # this worker (a bus outage) and moved it, and the move came back here. The
            # gateway reads only the new attempt's subject: the old run is dropped.
            self.engine.abort(rid)
            del self._streams[rid]
            old.end("superseded")
        try:
            self.engine.add(checked)
        except Exception as exc:  # a duplicate id, or a bug: the request's own failure
            if not isinstance(exc, InvalidRequestError):
                log.exception("adding request %s failed", rid)
            message = exc.message if isinstance(exc, InvalidRequestError) else repr(exc)
            failed = Failed(
                request_id=rid, seq=seq, message=message, retryable=False, tokens_sent=False
            )
            self.emit([(reply, failed, context)])
            return
        span = request_span(request, self.worker_id, context)
        if span is not None:
            context = trace.set_span_in_context(span, context)
            self._tracer.traced.add(rid)
        self._streams[rid] = Stream(reply, context, seq=seq, span=span)
        self._deadlines.add(rid, checked.deadline_ms)

    def _stop_expired(self) -> None:
        """Stop every request whose deadline has passed: its blocks are freed at once and
        its client told why (``Failed``, ``deadline_exceeded``)."""
        batch: list[Outgoing] = []
        for rid in self._deadlines.expired(self._streams, time.time() * 1000):
            self.engine.abort(rid)
            batch += self._streams.fail(
                rid,
                "the request's deadline passed while it ran",
                retryable=False,
                reason=RejectReason.DEADLINE_EXCEEDED,
                status="deadline_exceeded",
            )
        if batch:
            self.emit(batch)

    def _keep_alive(self) -> None:
        """The keep-alive timer (its own thread): keep-alives to the streams silent for
        ``keepalive_s``, looked for once a second, or each keep-alive period if shorter."""
        period = min(_KEEPALIVE_CHECK_S, self.keepalive_s)
        while not self._stopping.wait(period):
            with self._turn:
                if self._dead:
                    return
                if batch := self._streams.keepalives(time.monotonic(), self.keepalive_s):
                    self.emit(batch)  # under the turn: before the thread's next events

    def _kv_events(self, step: Any = None) -> list[Outgoing]:
        """The prefix cache's events since the last call, as one message (or none);
        traced under ``step`` (a traced step's context) if given."""
        events = self.engine.take_kv_events()
        if not events:
            return []
        batch = KvEventBatch(
            worker_id=self.worker_id,
            block_size=self.engine.config.block_size,
            events=[wire.kv_event(event) for event in events],
            incarnation=self.incarnation,
        )
        context = None
        if step is not None:
            context = self._tracer.kv_events(step, len(events), events[0].event_id)
        return [(self.kv_subject, batch, context)]

    def _fail_all(self, reason: str, kind: RejectReason) -> None:
        """Fail every request the engine holds, as retryable: another worker may run it
        (``kind``: ``degraded`` after a failed step, ``failed`` when the engine is gone,
        ``draining`` when it hands them off)."""
        batch: list[Outgoing] = []
        for rid in list(self._streams):
            with contextlib.suppress(Exception):  # a dead engine may not abort cleanly
                self.engine.abort(rid)
            batch += self._streams.fail(rid, reason, retryable=True, reason=kind)
        self.emit(batch)
        for rid, done in list(self._prefills.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            del self._prefills[rid]
            done()

    def _end_prefills(self, outputs: list) -> None:
        """Tell the prefill legs that ended in this step (their blocks are cached)."""
        if not self._prefills:  # the usual step: nothing to look for
            return
        for out in outputs:
            if out.finished and (done := self._prefills.pop(out.request_id, None)):
                done()

    def _refresh_stats(self, now: bool = False) -> None:
        """New stats every ``_STATS_PERIOD_S``, when the engine is also checked (a rank
        of a parallel engine that exited while it was idle ends the thread); ``now``: new
        stats at once (a few microseconds), without the check."""
        at = time.monotonic()
        if at - self._stats_at >= _STATS_PERIOD_S:
            self.engine.check()
            self._stats_at = at
        elif not now:
            return
        self.stats = self.engine.stats()  # one reference swap: safe to read elsewhere
