"""A parallel engine's other ranks: one process each, driven by the engine.

The engine's process is rank 0, the driver: it owns the batch scheduler, the block
manager and the sampler, and holds the first shard of the model (of the first pipeline
stage) and its share of those layers' KV heads. The other ranks of its ``T`` × ``P``
(``parallel.py`` numbers them) are processes it starts (``spawn``), each holding its
shard and KV heads and nothing else. Every step the driver sends each rank the step's
:class:`StepInput` (flat arrays: no request, no block manager); within a stage every
rank runs the same layers on its shard, joined by the row-parallel layers' all-reduces;
each stage but the last sends its hidden states on to the next (``torch.distributed``:
gloo on CPU, NCCL on CUDA); the last stage's first rank sends the logits back, and only
the driver samples.

How a step reaches the ranks. vLLM's ``MultiprocExecutor`` writes each step once into a
shared-memory ring buffer that its workers spin on; SGLang broadcasts over a gloo group.
Here each rank has a duplex pipe from the driver (a ``multiprocessing`` connection), and
a step is one ``send_bytes`` of its packed arrays per rank. It costs a few microseconds
per rank at the sizes a step has, it blocks (no spinning core per rank: this runs on
two-core machines too), a rank waits on it indefinitely while the engine is idle (a
collective would time out), and its end-of-file tells a rank its driver is gone. The
collectives inside the step carry the group's timeout, derived by the worker from its
stall timeout, so a hung rank fails the step instead of blocking it for torch's default
of 30 minutes. On the CPU a stage's all-reduces go through shared memory
(``kernels/cpu/shm_allreduce``: microseconds where gloo's take a millisecond), with the
same timeout and a dead rank seen at once.

A group fails as a whole: a rank that exits or hangs, or any error inside a step (after
which the ranks' collectives are out of step), raises :class:`RankGroupFailure`, and the
group's KV is lost with it. Its owner restarts the whole group. Every rank runs on this
host: stages on other hosts are not built yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lamina.kernels.cpu.build import BuildError
from lamina.kernels.cpu.shm_allreduce import ShmAllReduce, create_segment, segment_path
from lamina.libs.lifetime import die_with_parent
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.errors import (
    EngineError,
    RankGroupFailure,
    RankStartError,
)
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import PipelineStage, TensorParallel
from lamina.services.engine_worker.engine.runner import ModelRunner, StepInput
from lamina.services.engine_worker.engine.shard import load_shard
from lamina.services.engine_worker.engine.spec import RankInfo

log = logging.getLogger("lamina.worker.ranks")

_HEADER = 6  # int64s: tokens, sequences, table width, sampled rows, decodes, flags
MAX_SEGMENT_SLOT = 64 << 20
"""Most bytes of one all-reduce through shared memory (per rank and bank)."""
START_TIMEOUT_S = 900.0
"""Most seconds a rank may take to start, load its shard or size its pool (a large
model's shard loads for minutes; a rank that exits is seen at once)."""


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the next CUDA device per rank from the configured one
    (``cuda:1`` for rank 1 of ``cuda``), or the same CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def pack(step: StepInput) -> bytes:
    """``step`` as one buffer of int64s: a header, then its arrays in field order."""
    header = np.array(
        [
            len(step.ids),
            len(step.num_new),
            step.table.shape[1],
            len(step.sampled),
            step.num_decodes,
            int(step.decodes_only) | int(step.all_sampled) << 1,
        ],
        dtype=np.int64,
    )
    parts = (step.ids, step.positions, step.slots, step.num_new, step.context, step.table)
    arrays = [np.ascontiguousarray(a, dtype=np.int64).ravel() for a in (*parts, step.sampled)]
    return np.concatenate([header, *arrays]).tobytes()


def unpack(buffer: bytes) -> StepInput:
    """The :class:`StepInput` :func:`pack` made ``buffer`` from."""
    flat = np.frombuffer(bytearray(buffer), dtype=np.int64)  # writable: torch reads it
    tokens, seqs, width, sampled, decodes, flags = (int(v) for v in flat[:_HEADER])
    sizes = (tokens, tokens, tokens, seqs, seqs, seqs * width, sampled)
    ends = np.cumsum((_HEADER, *sizes))
    ids, positions, slots, num_new, context, table, rows = (
        flat[start:end] for start, end in itertools.pairwise(ends)
    )
    return StepInput(
        ids=ids,
        positions=positions,
        slots=slots,
        num_new=num_new,
        context=context,
        table=table.reshape(seqs, width),
        sampled=rows,
        num_decodes=decodes,
        decodes_only=bool(flags & 1),
        all_sampled=bool(flags & 2),
    )


class RankGroup:
    """The other ranks of a parallel engine, seen from rank 0 (the driver).

    ``RankGroup(config, timeout_s)`` starts the ranks and joins them in one
    ``torch.distributed`` group as rank 0 (:attr:`tp` and :attr:`pp` are this process's
    place in it). Each rank loads its shard and reports how many KV blocks it could hold;
    :meth:`agree_blocks` gives every rank the least of those and the driver's own, so
    that every pool has the same blocks; then :meth:`launch` steps them all.
    """

    def __init__(self, config: EngineConfig, timeout_s: float) -> None:
        if dist.is_initialized():
            raise EngineError(
                "this process already drives a parallel engine (torch.distributed has one "
                "default group per process): close it before building another"
            )
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.size = self.tp_size * self.pp_size
        self.timeout_s = timeout_s
        self.device = rank_device(config.device, 0)
        self.last = (self.pp_size - 1) * self.tp_size
        """The rank that sends the driver the logits: the last stage's first."""
        self._pipes: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self.ranks: list[RankInfo] = []
        """Ranks 1.. as they reported themselves (with their KV once agreed)."""
        self._closed = False
        context = multiprocessing.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        self._segments = _make_segments(config, self.device)
        threads = rank_threads(config)
        self._threads = torch.get_num_threads()  # restored by close()
        if self.device.type == "cpu":
            torch.set_num_threads(threads)  # this process is a rank too
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                proc = context.Process(
                    target=_rank_main,
                    args=(
                        theirs,
                        config,
                        rank,
                        init,
                        timeout_s,
                        threads,
                        os.getpid(),
                        self._segments,
                    ),
                    name=f"lamina-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._pipes.append(ours)
                self._procs.append(proc)
            for rank in range(1, self.size):
                self._receive(rank, "joining")
            self.tp, self.pp = join(config, 0, init, timeout_s, self._segments)
        except BaseException:
            self.close()
            raise

    def agree_blocks(self, num_blocks: int) -> int:
        """Wait for every rank to load its shard (one that cannot: :class:`RankStartError`),
        then give each the KV blocks every rank's pool will have: the least any rank (this
        one's ``num_blocks`` included) can hold. Each rank then builds its pool."""
        try:
            loaded = [self._receive(rank, "loaded") for rank in range(1, self.size)]
            agreed = min([num_blocks, *(capacity for _, capacity in loaded)])
            for pipe in self._pipes:
                pipe.send(agreed)
            self.ranks = [self._receive(rank, "ready") for rank in range(1, self.size)]
        except BaseException:
            self.close()
            raise
        self._unlink_segments()  # every rank has them mapped: nothing can leak them now
        return agreed

    def launch(self, step: StepInput, local: ModelRunner) -> Callable[[], torch.Tensor]:
        """Send ``step`` to every rank and run rank 0's share (``local``: its
        ``ModelRunner``); what it returns waits for the logits, from the last stage when
        that is another rank's. Between the two, with pipeline stages, this process may
        launch the next step's first stage while the later stages run this one. Any
        failure fails the group."""
        try:
            buffer = pack(step)
            for pipe in self._pipes:
                pipe.send_bytes(buffer)
            logits = local.run(step)
            if logits is not None:
                return lambda: logits
            # An earlier stage: the last one sends them; posted now, so that its send
            # never waits on this process's next one.
            vocab = local.model.config.vocab_size
            logits = torch.empty((len(step.sampled), vocab), device=self.device)
            work = dist.irecv(logits, self.last) if len(step.sampled) else None
        except Exception as exc:
            raise self._failure(exc) from exc

        def wait() -> torch.Tensor:
            try:
                if work is not None:
                    work.wait()
            except Exception as exc:
                raise self._failure(exc) from exc
            return logits

        return wait

    def check(self) -> None:
        """Raise :class:`RankGroupFailure` if a rank has exited (an idle engine sees no
        collective fail; this is how it learns)."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.exitcode is not None:
                raise RankGroupFailure(self._exit_text(rank, proc))

    def close(self) -> None:
        """Stop the ranks (each ends its loop on end-of-file) and leave the group."""
        if self._closed:
            return
        self._closed = True
        for pipe in self._pipes:
            pipe.close()
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._unlink_segments()
        torch.set_num_threads(self._threads)

    def _unlink_segments(self) -> None:
        for path in self._segments:
            if path is not None:
                path.unlink(missing_ok=True)

    # ---------------------------------------------------------------------------- helpers
    def who(self, rank: int) -> str:
        """Rank ``rank`` as messages name it."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {rank} of {self.size}"
        where = f"pipeline stage {rank // self.tp_size} of {self.pp_size}"
        if self.tp_size > 1:
            where += f", tensor-parallel rank {rank % self.tp_size}"
        return f"rank {rank} of {self.size} ({where})"

    def _receive(self, rank: int, what: str) -> Any:
        """What rank ``rank`` says once it is ``what`` (``joining``: nothing; ``loaded``:
        its :class:`RankInfo` and the KV blocks it could hold; ``ready``: its
        :class:`RankInfo` with its pool); a rank that reports an error instead, exits, or
        says nothing within :data:`START_TIMEOUT_S` fails start-up, named."""
        pipe, proc = self._pipes[rank - 1], self._procs[rank - 1]
        ready = wait([pipe, proc.sentinel], timeout=START_TIMEOUT_S)
        if pipe in ready:
            with contextlib.suppress(EOFError):
                kind, value = pipe.recv()
                if kind == "error":
                    raise RankStartError(self.who(rank), value)
                assert kind == what, (kind, what)
                return value
        if not ready:
            raise RankStartError(self.who(rank), f"not {what} within {START_TIMEOUT_S:g}s")
        proc.join(1.0)
        raise RankStartError(self.who(rank), f"its process (pid {proc.pid}) {_how(proc)}")

    def _failure(self, exc: Exception) -> RankGroupFailure:
        """What a failed step means: a rank that exited if one did, else the error."""
        time.sleep(0.05)  # a rank killed mid-step may still be on its way out
        for rank, proc in enumerate(self._procs, start=1):
            if proc.exitcode is not None:
                return RankGroupFailure(self._exit_text(rank, proc))
        return RankGroupFailure(
            f"a parallel step failed ({type(exc).__name__}: {exc}); the ranks' "
            "collectives are out of step and the group's KV is lost"
        )

    def _exit_text(self, rank: int, proc: multiprocessing.process.BaseProcess) -> str:
        return f"{self.who(rank)} (pid {proc.pid}) {_how(proc)}; the group's KV is lost"


def _how(proc: multiprocessing.process.BaseProcess) -> str:
    """How an exited process ended."""
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with {code}"


def join(
    config: EngineConfig,
    rank: int,
    init: str,
    timeout_s: float,
    segments: list[Path | None],
) -> tuple[TensorParallel, PipelineStage]:
    """Join the worker's ``torch.distributed`` group as ``rank``, with ``timeout_s`` on
    every collective; this rank's place in it. Every rank makes each stage's
    tensor-parallel group, in the same order (``new_group`` is collective), and maps its
    stage's shared-memory all-reduce segment, if it has one."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    size = tp_size * pp_size
    timeout = timedelta(seconds=timeout_s)
    backend = backend_for(rank_device(config.device, rank))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size, timeout=timeout)
    group = None  # the whole world, when it is one stage
    if pp_size > 1 and tp_size > 1:
        groups = [
            dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), timeout=timeout)
            for stage in range(pp_size)
        ]
        group = groups[rank // tp_size]
    stage = rank // tp_size
    shm = None
    if segments[stage] is not None:
        capacity = _segment_capacity(config)
        shm = ShmAllReduce(segments[stage], rank % tp_size, tp_size, capacity, timeout_s)
    tp = TensorParallel(rank=rank % tp_size, size=tp_size, group=group, shm=shm)
    return tp, PipelineStage.of(rank, tp_size, pp_size)


def _segment_capacity(config: EngineConfig) -> int:
    """Bytes of one rank's slot: a step's largest all-reduce (every batched token's hidden
    state in fp32), at most :data:`MAX_SEGMENT_SLOT` (larger ones go to gloo)."""
    hidden = ModelConfig.from_dir(config.model).hidden_size
    return min(config.max_num_batched_tokens * hidden * 4, MAX_SEGMENT_SLOT)


def _make_segments(config: EngineConfig, device: torch.device) -> list[Path | None]:
    """Per pipeline stage, a shared-memory all-reduce segment for its tensor-parallel
    ranks when they run on this host's CPU (None: they use gloo or NCCL alone)."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    segments: list[Path | None] = [None] * pp_size
    if device.type != "cpu" or tp_size == 1:
        return segments
    for stage in range(pp_size):
        path = segment_path(f"stage{stage}")
        if path is not None:
            try:
                create_segment(path, tp_size, _segment_capacity(config))
            except BuildError as exc:  # no compiler: the collectives stay gloo's
                log.warning("no shared-memory all-reduce: %s", exc)
                for made in segments:
                    if made is not None:
                        made.unlink(missing_ok=True)
                return [None] * pp_size
        segments[stage] = path
    return segments


def rank_threads(config: EngineConfig) -> int:
    """Torch threads per rank on CPU: the cores split between the ranks."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    return max(1, (os.cpu_count() or 1) // ranks)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    pipe: Connection,
    config: EngineConfig,
    rank: int,
    init: str,
    timeout_s: float,
    threads: int,
    parent: int,
    segments: list[Path | None],
) -> None:
    """A rank's process: join the group, load the shard, then run each step it is sent
    until the driver's pipe closes."""
    die_with_parent(9, parent)  # SIGKILL: a rank has nothing to flush
    torch.set_num_threads(threads)
    device = rank_device(config.device, rank)
    try:
        pipe.send(("joining", None))
        tp, pp = join(config, rank, init, timeout_s, segments)
        shard = load_shard(config, tp, pp, device)
        host, pid = socket.gethostname(), os.getpid()
        info = RankInfo(rank, host, str(device), pid, shard.weight_bytes, stage=pp.stage)
        pipe.send(("loaded", (info, shard.max_blocks)))
        num_blocks = pipe.recv()
        runner = shard.runner(num_blocks)
        pipe.send(("ready", dataclasses.replace(info, kv_bytes=num_blocks * shard.block_bytes)))
        sends_logits = pp.last and not pp.first and tp.rank == 0  # to the driver
        while True:
            step = unpack(pipe.recv_bytes())
            logits = runner.run(step)
            if sends_logits and len(step.sampled):
                dist.send(logits.contiguous(), 0)
    except (EOFError, OSError):
        return  # the driver closed the pipe, or is gone
    except BaseException as exc:
        with contextlib.suppress(Exception):
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
