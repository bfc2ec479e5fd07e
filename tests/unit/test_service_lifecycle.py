"""The shared service lifecycle (``lamina.libs.service``), without a bus."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

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
