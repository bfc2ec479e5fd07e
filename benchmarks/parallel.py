"""Parallel workers on this machine: two tensor-parallel ranks and two pipeline stages
(two processes, one thread each) against one process (two threads) on the same model and
work, in one run; the second stage also as a remote one (``PP=2 remote``: started from
the rendezvous, its steps over the TCP step channel, here on loopback); and the latency
of one all-reduce between two processes, by gloo and through shared memory (which the
ranks use on a CPU).

* decode: ``--batch`` sequences decoding together (greedy, ``ignore_eos``), after their
  prompts are prefilled; tokens/s over ``--tokens`` steps, the median of ``--runs`` runs
  (the three layouts in a rotating order), and the ratios. For two tensor-parallel ranks,
  the share of rank 0's step spent inside its all-reduces (waiting for rank 1 included:
  that is what a collective costs it); what packing a step's input for the other ranks
  costs.
* memory: each process's private resident memory (``RssAnon``: not the checkpoint's
  file pages) once the model is loaded, less that of a process that imported the same
  libraries and loaded nothing (``--memory-preset``; ``medium``,
  2.9 GB of fp32 weights, so the weights dominate), and each rank's weight and KV bytes.

Not a test: run it by hand on an otherwise idle machine.

    .venv/bin/python benchmarks/parallel.py                 # small preset, batch 1 and 32
    .venv/bin/python benchmarks/parallel.py --quick         # a smoke run
    python3 benchmarks/parallel.py --device cuda --dtype bfloat16 --no-memory  # 2+ GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.parallel import TensorParallel
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.rank_group import pack, rank_threads
from lamina.services.engine_worker.engine.remote_ranks import Rendezvous
from lamina.services.engine_worker.engine.runner import StepInput
from lamina.services.engine_worker.engine.stage_ranks import StageRanks, start_stage


@dataclass(frozen=True)
class TimedParallel(TensorParallel):
    """Rank 0's :class:`TensorParallel`, adding up the time its all-reduces take."""

    seconds: list[float] = field(default_factory=lambda: [0.0])

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = super().all_reduce(tensor)
        self.seconds[0] += time.perf_counter() - started
        return out


def decode(engine: Engine, batch: int, tokens: int, seed: int) -> tuple[float, float]:
    """``(tokens/s, share of the decode steps' time in all-reduces)`` of ``batch``
    sequences decoding ``tokens`` steps together."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for n in range(batch):
        engine.add_request(f"r{seed}-{n}", [rng.randrange(3, vocab) for _ in range(32)], params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # prefill, and each sequence's first token
    model = engine.runner.model
    own, timed = model.tp, None
    if own.size > 1:  # the same all-reduce, timed
        timed = TimedParallel(rank=0, size=own.size, group=own.group, shm=own.shm)
        model.tp = timed
    started, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += len(engine.step().outputs)
    elapsed = time.perf_counter() - started
    model.tp = own
    return produced / elapsed, (timed.seconds[0] / elapsed if timed else 0.0)


def pack_us(batch: int) -> float:
    """Microseconds to pack a decode step of ``batch`` sequences for the other ranks."""
    step = StepInput(
        ids=torch.arange(batch).numpy(),
        positions=torch.arange(batch).numpy() + 100,
        slots=torch.arange(batch).numpy(),
        num_new=torch.ones(batch, dtype=torch.int64).numpy(),
        context=torch.full((batch,), 100, dtype=torch.int64).numpy(),
        table=torch.zeros((batch, 16), dtype=torch.int64).numpy(),
        sampled=torch.arange(batch).numpy(),
        num_decodes=batch,
        decodes_only=True,
        all_sampled=True,
    )
    started = time.perf_counter()
    for _ in range(2000):
        pack(step)
    return (time.perf_counter() - started) / 2000 * 1e6


def _latency_rank(rank: int, port: int, path, out) -> None:
    import torch.distributed as dist

    from lamina.kernels.cpu.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = ShmAllReduce(path, rank, 2, 1 << 20, timeout_s=60)
    row = torch.ones(512)
    for name, reduce in (("gloo", dist.all_reduce), ("shared memory", shm)):
        for _ in range(50):
            reduce(row)
        started = time.perf_counter()
        for _ in range(500):
            reduce(row)
        if rank == 0:
            out.put((name, (time.perf_counter() - started) / 500 * 1e6))
    dist.destroy_process_group()


def all_reduce_us() -> dict[str, float]:
    """Microseconds one all-reduce of a 512-wide row takes between two processes, by gloo
    and through shared memory: the latency every tensor-parallel layer pays twice."""
    import torch.multiprocessing as mp

    from lamina.kernels.cpu.shm_allreduce import create_segment, segment_path
    from lamina.libs.nats_server import free_port

    path = segment_path("bench")
    create_segment(path, 2, 1 << 20)
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    try:
        mp.start_processes(_latency_rank, args=(free_port(), path, out), nprocs=2)
    finally:
        path.unlink()
    return dict(out.get() for _ in range(2))


def _stage(found: Rendezvous) -> StageRanks:
    """Stage 1 started as a stage host on another host would start it: from the
    rendezvous, over the step channel and the network store (here on loopback, so with
    a local stage's threads: this host's cores are shared)."""
    config = found.config
    model, threads = config.model, rank_threads(config)
    return start_stage(found, 1, model, config.device, "remote", threads)  # type: ignore[arg-type]


def throughput(args: argparse.Namespace) -> None:
    model = ensure_default_model("small")
    base = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=256,
        num_kv_blocks=1200,
        max_num_seqs=max(args.batch),
    )
    cores = os.cpu_count() or 1
    print(f"model: small preset ({model}); {platform.processor() or platform.machine()}, "
          f"{cores} cores; torch {torch.__version__}")  # fmt: skip
    print(f"one process: {cores} threads; two ranks: {max(1, cores // 2)} thread(s) each")
    latency = ", ".join(f"{name} {us:.0f} us" for name, us in all_reduce_us().items())
    print(f"all-reduce of one 512-wide row between two processes: {latency}")
    # A process drives one parallel engine at a time (torch.distributed has one default
    # group per process), so each run builds each layout in turn, in a rotating order.
    staged = dataclasses.replace(base, pipeline_parallel_size=2)
    layouts = {
        "one process": base,
        "TP=2": dataclasses.replace(base, tensor_parallel_size=2),
        "PP=2": staged,
        "PP=2 remote": dataclasses.replace(staged, remote_pipeline_stages=1),
    }
    names = list(layouts)
    rates = {(name, batch): [] for name in names for batch in args.batch}
    shares: dict[int, list[float]] = {batch: [] for batch in args.batch}
    for run in range(args.runs):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            stages: list[StageRanks] = []
            engine = Engine(layouts[name], 60.0, lambda found, s=stages: s.append(_stage(found)))
            try:
                for batch in args.batch:
                    rate, share = decode(engine, batch, args.tokens, seed=run)
                    rates[name, batch].append(rate)
                    if name == "TP=2":
                        shares[batch].append(share)
            finally:
                engine.close()
                for stage in stages:
                    stage.stop()
    for batch in args.batch:
        one = statistics.median(rates["one process", batch])
        print(f"batch {batch}: median tok/s, range over {args.runs} runs, x one process")
        for name in names:
            got = rates[name, batch]
            rate = statistics.median(got)
            print(f"  {name:12s} {rate:8.1f} ({min(got):.0f}-{max(got):.0f}) {rate / one:.2f}x")
        print(
            f"  TP=2: all-reduce {statistics.median(shares[batch]):.0%} of rank 0's decode "
            f"time; packing a step {pack_us(batch):.1f} us"
        )


_MEMORY_CHILD = """
import json, os, sys, time
import torch
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine

def rss(pid):  # private resident memory: not the checkpoint's page cache
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

if __name__ == "__main__":
    model, tp = sys.argv[1], int(sys.argv[2])
    if tp == 0:
        print(json.dumps({"ranks": [{"rss": rss(os.getpid())}]}))
        sys.exit(0)
    engine = Engine(EngineConfig(model=model, max_model_len=256, num_kv_blocks=64,
                                 tensor_parallel_size=tp))
    ranks = [{"rss": rss(r.pid), "weights": r.weight_bytes, "kv": r.kv_bytes}
             for r in engine.spec.ranks]
    engine.close()
    print(json.dumps({"ranks": ranks}))
"""


def memory(args: argparse.Namespace) -> None:
    model = ensure_default_model(args.memory_preset)

    def measure(tp: int) -> list[dict]:
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_CHILD, str(model), str(tp)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out.splitlines()[-1])["ranks"]

    (idle,) = measure(0)
    (one,) = measure(1)
    two = measure(2)
    gib = 1 << 30
    print(f"memory, {args.memory_preset} preset: a process that loaded nothing holds "
          f"{idle['rss'] / gib:.2f} GiB; above that:")  # fmt: skip
    print(f"  one process: {(one['rss'] - idle['rss']) / gib:.2f} GiB "
          f"(weights {one['weights'] / gib:.2f} GiB)")  # fmt: skip
    for rank, r in enumerate(two):
        held = r["rss"] - idle["rss"]
        print(f"  rank {rank} of 2: {held / gib:.2f} GiB "
              f"({held / (one['rss'] - idle['rss']):.2f}x one process; "
              f"weights {r['weights'] / gib:.2f} GiB)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--memory-preset", default="medium", help="model for the memory part")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory part")
    parser.add_argument("--quick", action="store_true", help="one short run of each")
    parser.add_argument("--device", default="cpu", help="rank 0's (cuda: rank r on cuda:r)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.runs, args.memory_preset = 16, 1, "small"
    throughput(args)
    if not args.no_memory:
        memory(args)


if __name__ == "__main__":
    main()
