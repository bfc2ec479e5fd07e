"""A worker whose second pipeline stage runs on another host (network namespaces,
``tests/multihost/netns.py``):

- host a: gateway, scheduler, telemetry, worker ``a-worker-0`` (``--pipeline-parallel-size
  2 --remote-pipeline-stages 1``): the first stage, and the driver;
- host b: nothing but a stage host for ``a-worker-0:1`` (``lamina node --services ''
  --pipeline-stage a-worker-0:1``), which learns over the bus how to join.

The text served equals one process's. Then host b's stage host is killed: the group
fails, host a restarts the worker and host b the stage host, they meet on the worker's
new rendezvous, and the text is the same again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.test_faults import undisturbed
from tests.e2e.test_parallel_workers import BODY
from tests.multihost import netns, nodes

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ROLES = {"a": "gateway,scheduler,telemetry,worker", "b": ""}
ARGS = ["--max-model-len", "512"]
STAGED = [*ARGS, "--pipeline-parallel-size", "2", "--remote-pipeline-stages", "1"]
WORKER = "a-worker-0"


def _worker(c: nodes.Cluster) -> dict | None:
    url = f"http://{c.hosts['a'].address}:9400/v1/cluster"
    with_id = [w for w in httpx.get(url, timeout=10).json()["workers"] if w["worker_id"] == WORKER]
    return with_id[0] if with_id else None


def _ready(c: nodes.Cluster, timeout: float, not_incarnation: str = "") -> dict:
    """The worker's heartbeat once it is ready (in another incarnation than the one given)."""
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            seen = _worker(c)
        except httpx.HTTPError:  # telemetry still starting
            seen = None
        if seen and seen["state"] == "ready" and seen["incarnation"] != not_incarnation:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"{WORKER} was not ready within {timeout:g}s: {seen}")


def _stage_host_pids(host: netns.Host) -> list[int]:
    pids = []
    for pid in host.pids():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"stage_host" in command:
            pids.append(pid)
    return pids


def test_a_stage_on_another_host_serves_one_processs_text_and_rejoins_after_its_loss(
    stories, tmp_path
):
    with make_stack(stories, tmp_path / "one", worker_args=ARGS) as single:
        expected = undisturbed(single, BODY)
    extra = {"b": ["--pipeline-stage", f"{WORKER}:1"]}
    with nodes.running(ROLES, stories, STAGED, tmp_path, extra=extra) as c:
        gateway = SimpleNamespace(base_url=c.gateway("a"))
        first = _ready(c, 240)
        assert [(r["stage"], r["host"]) for r in first["ranks"]][1] == (1, "b")
        assert first["pipeline_parallel_size"] == 2
        assert undisturbed(gateway, BODY) == expected

        (stage_host,) = _stage_host_pids(c.hosts["b"])
        os.kill(stage_host, signal.SIGKILL)  # its ranks die with it
        again = _ready(c, 240, not_incarnation=first["incarnation"])
        assert again["ranks"][1]["host"] == "b"
        assert again["ranks"][1]["pid"] != first["ranks"][1]["pid"]
        assert undisturbed(gateway, BODY) == expected
