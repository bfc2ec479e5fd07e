"""``lamina ctl`` against a real stack of two workers: status, cordon and drain change
where the scheduler places, resume and uncordon undo them, and mistakes get clear
errors (an unknown worker, no scheduler)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from lamina.libs.bus import Bus
from lamina.libs.nats_server import NatsServer
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord
from lamina.services import ctl
from tests.e2e.conftest import make_stack


def lamina_ctl(capsys: pytest.CaptureFixture[str], nats_url: str, *args: str) -> tuple[int, str]:
    code = ctl.main(["--nats-url", nats_url, *args])
    out, err = capsys.readouterr()
    return code, out + err


def wait_for_status(capsys, nats_url: str, worker: str, state: str) -> str:
    deadline = time.monotonic() + 10
    while True:
        code, out = lamina_ctl(capsys, nats_url, "status")
        line = next((row for row in out.splitlines() if row.startswith(worker + " ")), "")
        if code == 0 and f" {state} " in line:
            return out
        assert time.monotonic() < deadline, f"{worker} never showed {state}: {out}"
        time.sleep(0.1)


def placements(base_url: str, nats_url: str, count: int) -> list[str]:
    """Where ``count`` requests sent at once were placed."""

    async def main() -> list[str]:
        placed: list[str] = []
        bus = await Bus.connect(nats_url, "test-ctl")

        async def on_record(record: PlacementRecord, _msg) -> None:
            if record.worker_id is not None:
                placed.append(record.worker_id)

        await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
        await bus.flush()
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 4}
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(count))
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        await bus.drain()
        return placed

    return asyncio.run(main())


def test_ctl_changes_where_the_scheduler_places(tiny_model, tmp_path, capsys):
    with make_stack(tiny_model, tmp_path, workers=2) as stack:
        url = stack.nats_url
        wait_for_status(capsys, url, "worker-1", "ready")
        out = wait_for_status(capsys, url, "worker-0", "ready")  # they start in either order
        assert "worker-1" in out and "kv used" in out and "queued" in out

        code, out = lamina_ctl(capsys, url, "cordon", "worker-0")
        assert code == 0 and "worker-0: ok (now cordoned)" in out  # as status says it
        wait_for_status(capsys, url, "worker-0", "cordoned")
        assert set(placements(stack.base_url, url, 4)) == {"worker-1"}

        code = ctl.main(["uncordon", "worker-0", "--nats-url", url])  # options after it too
        assert code == 0 and "worker-0: ok (now ready)" in capsys.readouterr().out
        code, out = lamina_ctl(capsys, url, "drain", "worker-1")
        assert code == 0 and "now draining" in out
        wait_for_status(capsys, url, "worker-0", "ready")
        wait_for_status(capsys, url, "worker-1", "draining")
        assert set(placements(stack.base_url, url, 4)) == {"worker-0"}

        code, out = lamina_ctl(capsys, url, "resume", "--all")
        assert code == 0 and out.count("now ready") == 2
        code, out = lamina_ctl(capsys, url, "reset-prefix-cache", "--all")
        assert code == 0 and out.count(": ok") == 2

        code, out = lamina_ctl(capsys, url, "drain", "worker-9")
        assert code == 1
        assert "unknown worker(s) worker-9; known: worker-0, worker-1" in out


def test_ctl_without_a_scheduler_says_so(capsys):
    with NatsServer() as server:
        code, out = lamina_ctl(capsys, server.url, "--timeout", "1", "status")
    assert code == 1 and "no scheduler answered on lamina.v1.sched.status" in out
