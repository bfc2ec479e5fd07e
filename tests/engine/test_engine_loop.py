"""The worker's engine thread builds the engine it steps (see ``engine_loop.py`` for why),
hands a failed build to whoever waits for it, and takes a request at once when idle."""

from __future__ import annotations

import threading
import time

import pytest

from lamina.schemas.v1.generate import GenerateRequest, Sampling
from lamina.services.engine_worker.engine_loop import EngineLoop, to_sampling_params
from tests.engine.helpers import make_engine


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_model):
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return make_engine(tiny_model)

    loop = EngineLoop(build, "w", "kv", emit=lambda batch: None)
    loop.start()
    try:
        engine = loop.wait_ready()
        assert built_on == [loop] and loop.engine is engine and loop.stats is not None
    finally:
        loop.stop()
        loop.join(timeout=5)


def test_a_failed_build_reaches_the_waiter():
    def build():
        raise FileNotFoundError("no checkpoint at /nowhere")

    loop = EngineLoop(build, "w", "kv", emit=lambda batch: None)
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
    loop = EngineLoop(
        lambda: make_engine(tiny_model), "w", "kv", emit=lambda batch: None, handoff_wait=10.0
    )
    loop.start()
    try:
        loop.wait_ready()
        deadline = time.monotonic() + 10
        while not loop.idle and time.monotonic() < deadline:
            time.sleep(0.001)
        assert loop.idle
        request = GenerateRequest(
            request_id="r0",
            model="lamina-tiny",
            prompt_token_ids=[5, 6, 7, 8],
            sampling=Sampling(max_tokens=64, ignore_eos=True),
        )
        loop.submit(request, to_sampling_params(request), reply="inbox")
        assert loop.engine.has_work()  # read-only, from this thread: the engine has it
    finally:
        loop.stop()
        loop.join(timeout=5)
