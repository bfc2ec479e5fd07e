"""The worker's engine thread builds the engine it steps (see ``engine_loop.py`` for why)
and hands a failed build to whoever waits for it."""

from __future__ import annotations

import threading

import pytest

from lamina.services.engine_worker.engine_loop import EngineLoop
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
