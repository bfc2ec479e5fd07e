"""The same workload on one host and on three test hosts (network namespaces, root only):
what spreading the stack over hosts costs, and the hops that explain it.

Three topologies, all up at once, each warmed up, then measured in turn in each of
``--runs`` runs (the table pools every run's requests; throughput is the median run's):

* ``one host``: ``lamina up``'s stack with three workers, on loopback;
* ``three hosts``: a ``lamina node`` per host (``tests/multihost/nodes.py``) with a NATS
  node each, in one cluster: host a runs the gateway, scheduler and a worker, b and c a
  worker each (c also telemetry);
* ``three hosts +D ms``: the same with every NATS route delayed D ms each way by a TCP
  proxy (``benchmarks/delay_proxy.py``: this kernel has no ``netem``).

Workload: the tiny default model, one worker taking requests at a time (the others
cordoned: three busy workers on a two-core machine measure its oversubscription, not the
hosts). TTFT: ``--requests`` sequential streaming requests (distinct random prompts,
after 0.3 s idle) on each placement in turn: ``local``, the gateway's host's worker
(``worker-0`` on one host, ``a-worker-0`` on three), where no message crosses hosts, and
``remote``, ``b-worker-0``, where the forward to the worker and the first token back each
cross one route, so the TTFT added is predicted to be 2 × D. Throughput: ``--burst``
requests, ``--concurrency`` at a time, on each placement.

    sudo .venv/bin/python benchmarks/multi_host.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' host helpers

from timing import stream_completion

from lamina.libs.bus import NatsConfig
from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.launcher import Stack
from tests.multihost import nodes

ROLES = {"a": "gateway,scheduler,worker", "b": "worker", "c": "telemetry,worker"}
ENGINE = ["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]
HOPS = 2
"""Route crossings on the TTFT path of a request on another host's worker: the forward
to it, the first token back."""


@dataclass
class Topology:
    name: str
    base_url: str
    operator: NatsConfig
    workers: set[str]
    placements: dict[str, set[str]]
    """``local`` (the gateway's host) or ``remote`` -> the one worker taking requests."""
    delay_ms: float
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    throughput: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(48)]


async def measure(t: Topology, args: argparse.Namespace, rng: random.Random) -> None:
    """One run: ``--requests`` sequential requests per placement, interleaved (the
    machine's drift falls on each alike), then a burst per placement."""
    async with httpx.AsyncClient(base_url=t.base_url, timeout=60) as client:
        for _ in range(args.requests):
            for where, serving in t.placements.items():
                # Cordoning waits 0.3 s: each request finds an idle cluster.
                await nodes.cordon(t.operator, t.workers, serving)
                ttft, _, _ = await stream_completion(client, prompt(rng), 8)
                t.ttft[where].append(ttft * 1000)
        for where, serving in t.placements.items():
            await nodes.cordon(t.operator, t.workers, serving)
            started, gate = time.perf_counter(), asyncio.Semaphore(args.concurrency)

            async def one(gate: asyncio.Semaphore = gate) -> int:
                async with gate:
                    return (await stream_completion(client, prompt(rng), 64))[2]

            tokens = sum(await asyncio.gather(*(one() for _ in range(args.burst))))
            t.throughput[where].append(tokens / (time.perf_counter() - started))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def report(topologies: list[Topology]) -> None:
    base = topologies[0]
    base_p50 = statistics.median(base.ttft["local"])
    base_rate = statistics.median(base.throughput["local"])
    print(f"\n{'topology':<20} {'worker':<7} {'n':>4} {'TTFT p50':>9} {'p99':>8} "
          f"{'added p50':>10} {'predicted':>10} {'tok/s':>7} {'ratio':>6}")  # fmt: skip
    for t in topologies:
        for where, values in t.ttft.items():
            p50, p99 = statistics.median(values), pct(values, 99)
            predicted = HOPS * t.delay_ms if where == "remote" else 0.0
            rate = statistics.median(t.throughput[where])
            print(f"{t.name:<20} {where:<7} {len(values):>4} {p50:>8.2f}ms {p99:>6.2f}ms "
                  f"{p50 - base_p50:>+8.2f}ms {predicted:>+8.2f}ms {rate:>7.0f} "
                  f"{rate / base_rate:>6.2f}")  # fmt: skip


@contextlib.contextmanager
def one_host(model: Path, tmp: Path):
    stack = Stack(
        model=model,
        workers=3,
        http_port=free_port(),
        metrics_port=free_port(),
        log_dir=tmp / "logs",
        credentials=tmp / "creds",
        worker_args=ENGINE,
    )
    with stack:
        workers = {stack.worker_id(i) for i in range(stack.workers)}
        placements = {"local": {stack.worker_id(0)}}
        yield Topology("one host", stack.base_url, stack.nats_config("operator"), workers,
                       placements, 0.0)  # fmt: skip


@contextlib.contextmanager
def three_hosts(model: Path, tmp: Path, delay: float, network: int):
    with nodes.running(ROLES, model, ENGINE, tmp, delay, network) as c:
        asyncio.run(nodes.converge(c, ("a",), nodes.workers_of(ROLES), timeout=240))
        name = "three hosts" + (f" +{delay:g} ms" if delay else "")
        placements = {"local": {"a-worker-0"}, "remote": {"b-worker-0"}}
        yield Topology(name, c.gateway("a"), c.bus("operator", "a"), nodes.workers_of(ROLES),
                       placements, delay)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40, help="sequential, per run")
    parser.add_argument("--burst", type=int, default=24, help="throughput requests per run")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--delay-ms", type=float, default=2.0, help="each way, per route")
    args = parser.parse_args()
    model = ensure_default_model("tiny")
    # All three up at once, measured in turn each run, so the machine's drift over the
    # minutes of a run falls on each alike; the idle workers of the others only heartbeat.
    with contextlib.ExitStack() as up:
        tmp = up.enter_context(tempfile.TemporaryDirectory(prefix="lamina-multi-host-"))
        topologies = [up.enter_context(one_host(model, Path(tmp) / "one"))]
        for network, delay in enumerate((0.0, args.delay_ms)):
            where = Path(tmp) / f"three-{network}"
            topologies.append(up.enter_context(three_hosts(model, where, delay, network)))
        rng = random.Random(0)
        for t in topologies:  # warm-up: kernels compile on first use
            asyncio.run(measure(t, args, rng))
            t.ttft.clear()
            t.throughput.clear()
        for run in range(args.runs):
            for t in topologies:
                asyncio.run(measure(t, args, rng))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    report(topologies)


if __name__ == "__main__":
    main()
