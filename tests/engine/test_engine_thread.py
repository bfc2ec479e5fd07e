"""The worker's engine thread builds the engine it steps (see ``engine_thread.py`` for why),
hands a failed build to whoever waits for it, takes a request at once when idle, and,
should it die or wedge, fails what it held as retryable and says so."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from lamina.libs.block_hash import hash_blocks
from lamina.schemas.v1.generate import (
    Failed,
    Finished,
    GenerateRequest,
    RejectReason,
    Sampling,
    Sla,
    Tokens,
)
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine_thread import EngineThread
from tests.engine.helpers import make_engine


def long_request(request_id: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model="lamina-tiny",
        prompt_token_ids=[5, 6, 7, 8],
        sampling=Sampling(max_tokens=200, ignore_eos=True),
    )


class Recorder:
    """What the loop emitted and whether (and why) it said it died."""

    def __init__(self) -> None:
        self.messages: list = []
        self.deaths: list[str] = []
        self.died = threading.Event()

    def emit(self, batch) -> None:
        self.messages += [message for _, message, _ in batch]

    def on_death(self, reason: str) -> None:
        self.deaths.append(reason)
        self.died.set()

    def failed(self) -> list[Failed]:
        return [m for m in self.messages if isinstance(m, Failed)]


def test_a_dead_engine_thread_fails_what_it_held_and_says_so(tiny_model):
    """Whatever raises out of the thread's loop (here the KV event read after a step) ends
    it: the requests it held and the ones still queued fail as retryable, and
    ``on_death`` is called once with the reason."""
    seen = Recorder()
    loop = EngineThread(
        lambda: make_engine(tiny_model), "w", "kv", emit=seen.emit, on_death=seen.on_death
    )
    loop.start()
    loop.wait_ready()
    engine = loop.engine
    loop.submit(long_request("r0"), reply="inbox")
    while not engine.has_work():
        time.sleep(0.001)

    def broken() -> list:
        loop.submit(long_request("r1"), reply="inbox")  # queued behind the failure
        raise RuntimeError("corrupted KV event log")

    engine.take_kv_events = broken
    assert seen.died.wait(30)
    loop.join(timeout=5)
    assert not loop.is_alive() and loop.dead
    assert seen.deaths == ["the engine thread died: RuntimeError: corrupted KV event log"]
    assert {f.request_id for f in seen.failed()} == {"r0", "r1"}
    assert all(f.retryable for f in seen.failed())
    assert loop.num_requests == 0


def test_a_wedged_engine_thread_is_declared_so(tiny_model):
    seen = Recorder()
    loop = EngineThread(
        lambda: make_engine(tiny_model), "w", "kv", emit=seen.emit, on_death=seen.on_death
    )
    loop.start()
    loop.wait_ready()
    engine = loop.engine
    release, stuck = threading.Event(), threading.Event()
    step = engine.step

    def wedged():
        stuck.set()
        release.wait(30)
        return step()

    engine.step = wedged
    loop.submit(long_request("r0"), reply="inbox")
    assert stuck.wait(30)
    beat = loop.beat
    loop.declare_wedged("stuck for 61s")
    assert loop.beat == beat  # it really did not go round again
    assert seen.deaths == ["stuck for 61s"] and [f.request_id for f in seen.failed()] == ["r0"]
    release.set()  # it comes back: it stops, and says nothing more
    loop.join(timeout=30)
    assert not loop.is_alive() and seen.deaths == ["stuck for 61s"]


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_model):
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return make_engine(tiny_model)

    loop = EngineThread(build, "w", "kv", emit=lambda batch: None)
    loop.start()
    try:
        spec = loop.wait_ready()
        assert built_on == [loop] and loop.engine.spec is spec and loop.stats is not None
    finally:
        loop.stop()
        loop.join(timeout=5)


def test_a_failed_build_reaches_the_waiter():
    def build():
        raise FileNotFoundError("no checkpoint at /nowhere")

    loop = EngineThread(build, "w", "kv", emit=lambda batch: None)
    loop.start()
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        loop.wait_ready()
    loop.join(timeout=5)
    assert not loop.is_alive()


def test_an_idle_engine_has_a_submitted_request_when_submit_returns(tiny_model):
    """The hand-off that keeps a new request from waiting for the event loop's GIL: the
    submitting thread blocks until the idle engine thread has added the request. (This
    test thread keeps the GIL between ``submit`` and the check, so without the hand-off
    the engine thread could not have run in between.)"""
    loop = EngineThread(
        lambda: make_engine(tiny_model), "w", "kv", emit=lambda batch: None, handoff_wait=10.0
    )
    loop.start()
    try:
        loop.wait_ready()
        deadline = time.monotonic() + 10
        while not loop.idle and time.monotonic() < deadline:
            time.sleep(0.001)
        assert loop.idle
        request = long_request("r0")
        loop.submit(request, reply="inbox")
        assert loop.engine.has_work()  # read-only, from this thread: the engine has it
    finally:
        loop.stop()
        loop.join(timeout=5)


def test_a_request_past_its_deadline_is_stopped_and_its_blocks_freed(tiny_model):
    seen = Recorder()
    thread = EngineThread(lambda: make_engine(tiny_model), "w", "kv", emit=seen.emit)
    thread.start()
    try:
        thread.wait_ready()
        engine = thread.engine
        request = msgspec.structs.replace(
            long_request("r0"), sla=Sla(deadline_ms=int(time.time() * 1000) + 20)
        )
        thread.submit(request, reply="inbox")
        deadline = time.monotonic() + 10
        while not seen.failed() and time.monotonic() < deadline:
            time.sleep(0.01)
        (failed,) = seen.failed()
        assert failed.reason == RejectReason.DEADLINE_EXCEEDED and not failed.retryable
        assert not any(isinstance(m, Finished) for m in seen.messages)  # 200 tokens take longer
        done = thread.call(lambda e: None)  # the barrier: the thread has moved on
        assert done.wait(5)
        assert not engine.has_work() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        thread.stop()
        thread.join(timeout=5)


def test_a_resubmission_of_a_request_still_running_here_replaces_it(tiny_model):
    """After a bus outage the gateway moves a request whose worker it lost sight of; the
    move may come back to the worker still running it. The new attempt (its own reply
    subject, the tokens so far replayed) replaces the old run instead of failing as a
    duplicate."""
    seen: list[tuple[str, object]] = []
    thread = EngineThread(
        lambda: make_engine(tiny_model),
        "w",
        "kv",
        emit=lambda batch: seen.extend((subject, m) for subject, m, _ in batch),
    )
    thread.start()
    try:
        thread.wait_ready()
        engine = thread.engine
        thread.submit(long_request("r0"), reply="inbox.1")
        moved = msgspec.structs.replace(long_request("r0"), attempt=1)
        thread.submit(moved, reply="inbox.2")
        deadline = time.monotonic() + 20
        while not any(isinstance(m, Finished) for _, m in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        finished = [(subject, m) for subject, m in seen if isinstance(m, Finished)]
        assert [subject for subject, _ in finished] == ["inbox.2"]
        assert not [m for _, m in seen if isinstance(m, Failed)]
        assert finished[0][1].usage.completion_tokens == 200
        done = thread.call(lambda e: None)
        assert done.wait(5) and not engine.has_work()
    finally:
        thread.stop()
        thread.join(timeout=5)


def test_streams_are_kept_alive_through_a_long_step_in_seq_order(tiny_model):
    """A step that takes seconds (a long prefill, a loaded machine) does not silence the
    streams: the keep-alive timer runs while the engine steps, and every stream's events
    leave numbered 1, 2, 3... in the order they were emitted, whichever thread made them."""
    seen: list[tuple[str, object]] = []
    thread = EngineThread(
        lambda: make_engine(tiny_model),
        "w",
        "kv",
        emit=lambda batch: seen.extend((subject, m) for subject, m, _ in batch),
        keepalive_s=0.05,
    )
    thread.start()
    try:
        thread.wait_ready()
        engine = thread.engine
        step, slow = engine.step, threading.Event()

        def sometimes_slow():
            if engine.stats().num_running and not slow.is_set():  # once, mid-decode
                slow.set()
                time.sleep(1.0)
            return step()

        engine.step = sometimes_slow
        for rid in ("r0", "r1"):
            thread.submit(
                msgspec.structs.replace(
                    long_request(rid), sampling=Sampling(max_tokens=30, ignore_eos=True)
                ),
                reply=f"inbox.{rid}",
            )
        deadline = time.monotonic() + 30
        while sum(isinstance(m, Finished) for _, m in seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.is_set()
        for rid in ("r0", "r1"):
            events = [m for subject, m in seen if subject == f"inbox.{rid}"]
            assert [m.seq for m in events] == list(range(1, len(events) + 1))
            assert isinstance(events[-1], Finished)
            assert sum(len(m.token_ids) for m in events) == 30
            keepalives = [m for m in events if isinstance(m, Tokens) and not m.token_ids]
            assert len(keepalives) >= 5  # sent during the one long step
    finally:
        thread.stop()
        thread.join(timeout=5)


def test_a_prefill_leg_caches_its_prompt_streams_nothing_and_says_when_it_ended(tiny_model):
    """``prefill``: the prompt's full blocks are cached for another worker to fetch, and
    ``done`` is called once; nothing is emitted for it, and a stream submitted after it
    with a later ``seq`` (the worker's keep-alives came first) continues from there."""
    seen = Recorder()
    loop = EngineThread(lambda: make_engine(tiny_model), "w", "kv", emit=seen.emit)
    loop.start()
    spec = loop.wait_ready()
    prompt = list(range(5, 5 + 64))  # 4 blocks of 16
    ended = threading.Event()
    calls: list[None] = []
    checked = spec.request("prefill-1", prompt, SamplingParams(max_tokens=1, temperature=0))
    loop.prefill(checked, lambda: (calls.append(None), ended.set()))
    assert ended.wait(30)
    hashes = hash_blocks(prompt, 16)
    exported: list = []
    loop.call(lambda engine: exported.append(engine.export_blocks(hashes))).wait(30)
    assert exported[0].hashes == hashes
    assert not [m for m in seen.messages if getattr(m, "request_id", "") == "prefill-1"]
    assert loop.num_requests == 0 and len(calls) == 1 and loop.submitted == 1

    request = msgspec.structs.replace(long_request("r"), sampling=Sampling(max_tokens=2))
    loop.submit(request, reply="inbox", seq=4)
    deadline = time.monotonic() + 30
    while not any(isinstance(m, Finished) for m in seen.messages) and time.monotonic() < deadline:
        time.sleep(0.01)
    seqs = [m.seq for m in seen.messages if getattr(m, "request_id", "") == "r"]
    assert seqs == list(range(4, 4 + len(seqs))) and len(seqs) >= 2
    loop.stop()
