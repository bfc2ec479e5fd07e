"""The shared service lifecycle (``lamina.libs.service``), without a bus."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from lamina.libs.bus import Bus
from lamina.libs.nats_server import free_port
from lamina.libs.service import _serve


class _Probe:
    """Records the lifecycle calls; asks for SIGTERM as soon as it has started."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.frozen_at_drain = 0

    async def start(self) -> None:
        self.calls.append("start")
        self.built = [object() for _ in range(1000)]  # what a service builds while starting
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)

    async def drain(self) -> None:
        self.calls.append("drain")
        self.frozen_at_drain = gc.get_freeze_count()

    async def close(self) -> None:
        self.calls.append("close")


def test_a_started_service_is_frozen_for_the_collector_and_drains_on_sigterm():
    gc.unfreeze()
    probe = _Probe()
    try:
        assert asyncio.run(_serve("probe", probe)) == 0
    finally:
        gc.unfreeze()
    assert probe.calls == ["start", "drain", "close"]
    assert probe.frozen_at_drain >= len(probe.built)


class _Stuck(_Probe):
    """A start that never ends (NATS unreachable, a model loading): SIGTERM meanwhile."""

    async def start(self) -> None:
        self.calls.append("start")
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.calls.append("cancelled")
            raise


def test_sigterm_while_starting_stops_the_service_there():
    probe = _Stuck()
    assert asyncio.run(_serve("stuck", probe)) == 0
    assert probe.calls == ["start", "cancelled", "close"]


class _Unreachable(_Probe):
    async def start(self) -> None:
        self.calls.append("start")
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", "nobody", timeout=0.5)


def test_a_service_that_cannot_reach_nats_says_so_once_and_exits_1(caplog):
    probe = _Unreachable()
    assert asyncio.run(_serve("lonely", probe)) == 1
    assert probe.calls == ["start", "close"]
    said = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    # At most "cannot reach NATS yet" (where the bus's logger is heard) and then the one
    # reason it exits: not a line per attempt.
    assert 1 <= len(said) <= 2, said
    assert "cannot reach NATS at nats://127.0.0.1:" in said[-1] and "within 0.5s" in said[-1]


def test_a_service_knows_its_supervisor_is_gone(monkeypatch):
    import os

    from lamina.libs.lifetime import PARENT_ENV, orphaned

    monkeypatch.delenv(PARENT_ENV, raising=False)
    assert not orphaned()  # not supervised
    monkeypatch.setenv(PARENT_ENV, str(os.getppid()))
    assert not orphaned()
    monkeypatch.setenv(PARENT_ENV, str(os.getppid() + 100_000))  # another: ours is gone
    assert orphaned()
