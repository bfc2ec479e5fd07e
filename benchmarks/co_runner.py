"""The engine's throughput beside another process's CPU (issue 44): what the serving
processes' CPU costs the engine when they share its cores.

``vs_vllm.py``'s load (``--prompts`` requests of ``--input-len`` random tokens in and
``--output-len`` out, ``--concurrency`` in flight) on the engine in this process, in
rounds: alone, then beside a co-runner at each ``--shares`` value. The co-runner is a
process that spins for ``--burst-ms`` and sleeps the rest of a period sized to take that
share of one core (a loop over a few registers: no memory traffic to speak of). Every
run's prompts are new, so that no run is served by the prefix cache of one before it.

Printed per setting, medians over the rounds: tokens/s, the engine's CPU per token (both
threads, this process's ``getrusage``), the co-runner's measured share of a core, and
the machine's time a token costs per microsecond of co-runner CPU a token::

    cost = cores * (1 - beside / alone) / share

1.0 where the co-runner takes only the CPU it uses; 2.0 on two cores where each
microsecond it holds a core also holds the engine's other thread at the end of its
parallel region. The stack's serving processes (gateway, bus, scheduler, telemetry, the
client) run beside the worker's engine in just this way on a machine without a core to
spare for them.

Not a test: run it by hand on an otherwise idle machine::

    .venv/bin/python -u benchmarks/co_runner.py --dtype bfloat16 --runs 3
    .venv/bin/python -u benchmarks/co_runner.py --shares 0.1 0.2 0.4 --burst-ms 0.1
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from data_path import tree_cpu
from vs_vllm import engine_throughput

from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine

SPIN = """
import time
burst, period = {burst}, {period}
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < burst:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - start)))
"""


@dataclass(frozen=True, slots=True)
class Run:
    """One run of the load: its throughput, the engine's CPU (this process's, both of its
    threads) a token, and the co-runner's measured share."""

    tokens_per_s: float
    cpu_us_per_token: float
    share: float
    """The co-runner's CPU over the run's wall time, in cores (0 alone)."""


def run(engine: Engine, args: argparse.Namespace, seed: int, share: float) -> Run:
    """One run of the load, beside a co-runner taking ``share`` of a core (none at 0)."""
    co_runner = None
    if share > 0:
        burst = args.burst_ms / 1e3
        code = SPIN.format(burst=burst, period=burst / share)
        co_runner = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.2)  # it is running before the load starts
    try:
        before, co_before = resource.getrusage(resource.RUSAGE_SELF), 0.0
        if co_runner is not None:
            co_before = tree_cpu(co_runner.pid)
        started = time.perf_counter()
        rate = engine_throughput(engine, args, seed)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        measured = 0.0 if co_runner is None else (tree_cpu(co_runner.pid) - co_before) / wall
    finally:
        if co_runner is not None:
            co_runner.kill()
            co_runner.wait()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Run(rate, cpu / (rate * wall) * 1e6, measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64, help="requests per run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25],
                        help="the co-runner's share of one core, one setting each")  # fmt: skip
    parser.add_argument("--burst-ms", type=float, default=1.0, help="the co-runner's spin")
    parser.add_argument("--runs", type=int, default=3, help="rounds of every setting")
    args = parser.parse_args()
    if any(not 0 < share < 1 for share in args.shares):
        parser.error("each share is a fraction of one core, in (0, 1)")
    model = ensure_default_model(args.preset)
    engine = Engine(
        EngineConfig(
            model=model,
            max_model_len=max(2048, args.input_len + args.output_len),
            max_num_seqs=args.concurrency,
            dtype=args.dtype,
        )
    )
    engine_throughput(engine, argparse.Namespace(**{**vars(args), "prompts": 8}), 10_000)
    cores = len(os.sched_getaffinity(0))
    settings = [0.0, *args.shares]
    runs: dict[float, list[Run]] = {share: [] for share in settings}
    seed = 0
    for round_ in range(args.runs):
        for share in settings:
            seed += 1
            result = run(engine, args, seed, share)
            runs[share].append(result)
            print(
                f"round {round_ + 1} co-runner {share:4.2f}: {result.tokens_per_s:7.1f} tok/s, "
                f"engine CPU {result.cpu_us_per_token:5.0f} us/token, "
                f"co-runner {result.share:4.2f} of a core",
                flush=True,
            )
    alone = statistics.median(r.tokens_per_s for r in runs[0.0])
    print(
        f"{model.name} in {args.dtype} on {cores} cores; medians of {args.runs}: alone "
        f"{alone:.1f} tok/s, engine CPU "
        f"{statistics.median(r.cpu_us_per_token for r in runs[0.0]):.0f} us/token"
    )
    for share in args.shares:
        beside = statistics.median(r.tokens_per_s for r in runs[share])
        measured = statistics.median(r.share for r in runs[share])
        cost = f"{cores * (1 - beside / alone) / measured:.2f}" if measured > 0 else "n/a"
        print(
            f"beside {measured:.2f} of a core ({args.burst_ms:g} ms bursts): {beside:.1f} "
            f"tok/s ({beside / alone:.2f}x alone), engine CPU "
            f"{statistics.median(r.cpu_us_per_token for r in runs[share]):.0f} us/token; "
            f"cost per co-runner us: {cost}"
        )


if __name__ == "__main__":
    main()
