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

A LoRA adapter put in a slot (``Engine._lora_slots``) reaches the ranks the same way,
before the step that uses it: each rank is sent its share of the adapter's weights
(``lora.py``) as safetensors bytes, and writes it into its own slot.

KV blocks that leave or enter the engine (``Engine.export_blocks``, ``import_blocks``:
a transfer between workers) go through the same pipes, in order with the steps: the
driver sends each rank the blocks to read (and the tiers' pending moves), and each
answers with its share (its layers and KV heads, ``kv_shards.py``); or the driver sends
each rank its share to write. A rank answers only these; anything else it sends is its
end or its last error.

A group fails as a whole: a rank that exits or hangs, or any error inside a step (after
which the ranks' collectives are out of step), raises :class:`RankGroupFailure`, and the
group's KV is lost with it. Its owner restarts the whole group.

The last pipeline stages may run on other hosts (``remote_pipeline_stages``): their ranks
are started there (``stage_ranks.start_stage``, by a stage host) and reach the driver
over the step channel of ``remote_ranks.py`` instead of a pipe; the driver publishes the
:class:`~lamina.services.engine_worker.engine.remote_ranks.Rendezvous` they need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import secrets
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
from lamina.services.engine_worker.engine.kv_shards import Share, dump_share, load_share
from lamina.services.engine_worker.engine.lora import LoraAdapter, dump_weights, load_weights
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import PipelineStage, TensorParallel
from lamina.services.engine_worker.engine.remote_ranks import (
    Rendezvous,
    StepListener,
    checkpoint_digest,
    connect,
    use_interface_toward,
)
from lamina.services.engine_worker.engine.runner import ModelRunner, StepInput
from lamina.services.engine_worker.engine.shard import load_shard
from lamina.services.engine_worker.engine.spec import RankInfo

log = logging.getLogger("lamina.worker.ranks")

STEP, EXPORT, IMPORT, LORA = 0, 1, 2, 3
"""What a message from the driver asks of a rank (its first int64): run a step; send its
share of some KV blocks (``RankGroup.export_shares``); write its share of some; write its
share of a LoRA adapter into a slot (``RankGroup.write_lora``)."""
_HEADER = 8  # int64s: STEP, tokens, sequences, table width, sampled rows, decodes, flags, moves
MAX_SEGMENT_SLOT = 64 << 20
"""Most bytes of one all-reduce through shared memory (per rank and bank)."""
START_TIMEOUT_S = 900.0
"""Most seconds a rank may take to start, load its shard or size its pool (a large
model's shard loads for minutes; a rank that exits is seen at once)."""
FAILURE_LOOK_S = 2.0
"""Most seconds a failed step looks for the rank that exited before it reports the
error alone (``RankGroup._failure``)."""


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
            STEP,
            len(step.ids),
            len(step.num_new),
            step.table.shape[1],
            len(step.sampled),
            step.num_decodes,
            int(step.decodes_only)
            | int(step.all_sampled) << 1
            | int(bool(len(step.adapters))) << 2,
            step.moves.shape[1],
        ],
        dtype=np.int64,
    )
    parts = (step.ids, step.positions, step.slots, step.num_new, step.context, step.table)
    parts += (step.sampled, step.moves, step.adapters)
    arrays = [np.ascontiguousarray(a, dtype=np.int64).ravel() for a in parts]
    return np.concatenate([header, *arrays]).tobytes()


def unpack(buffer: bytes) -> StepInput:
    """The :class:`StepInput` :func:`pack` made ``buffer`` from."""
    flat = np.frombuffer(bytearray(buffer), dtype=np.int64)  # writable: torch reads it
    _, tokens, seqs, width, sampled, decodes, flags, moves = (int(v) for v in flat[:_HEADER])
    adapters = seqs if flags & 4 else 0
    sizes = (tokens, tokens, tokens, seqs, seqs, seqs * width, sampled, 4 * moves, adapters)
    ends = np.cumsum((_HEADER, *sizes))
    ids, positions, slots, num_new, context, table, rows, moved, lora = (
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
        moves=moved.reshape(4, moves),
        adapters=lora,
    )


def pack_blocks(kind: int, moves: np.ndarray, blocks: np.ndarray, share: bytes = b"") -> bytes:
    """A KV blocks message (:data:`EXPORT`, :data:`IMPORT`): the moves between the tiers
    to make first, the blocks (``(2, n)`` tiers and indices to read, or ``(n,)`` device
    blocks to write), then an import's share (:func:`kv_shards.dump_share`)."""
    header = np.array([kind, moves.shape[1], blocks.size], dtype=np.int64)
    arrays = [np.ascontiguousarray(a, dtype=np.int64).ravel() for a in (moves, blocks)]
    return np.concatenate([header, *arrays]).tobytes() + share


def unpack_blocks(buffer: bytes) -> tuple[np.ndarray, np.ndarray, memoryview]:
    """:func:`pack_blocks`' moves ``(4, n)``, blocks (flat) and share bytes."""
    _, moves, size = np.frombuffer(buffer, dtype=np.int64, count=3).tolist()
    flat = np.frombuffer(buffer, dtype=np.int64, count=3 + 4 * moves + size)
    return (
        flat[3 : 3 + 4 * moves].reshape(4, moves).copy(),
        flat[3 + 4 * moves :].copy(),
        memoryview(buffer)[8 * (3 + 4 * moves + size) :],
    )


class RankGroup:
    """The other ranks of a parallel engine, seen from rank 0 (the driver).

    ``RankGroup(config, timeout_s, publish)`` starts the ranks of this host's stages,
    hands the ranks of remote stages their :class:`Rendezvous` (``publish``; without it,
    it is logged) and waits for them to join, then joins them all in one
    ``torch.distributed`` group as rank 0 (:attr:`tp` and :attr:`pp` are this process's
    place in it). Each rank loads its shard and reports how many KV blocks it could hold;
    :meth:`agree_blocks` gives every rank the least of those and the driver's own, so
    that every pool has the same blocks; then :meth:`launch` steps them all.
    """

    def __init__(
        self,
        config: EngineConfig,
        timeout_s: float,
        publish: Callable[[Rendezvous], None] | None = None,
    ) -> None:
        if dist.is_initialized():
            raise EngineError(
                "this process already drives a parallel engine (torch.distributed has one "
                "default group per process): close it before building another"
            )
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.size = self.tp_size * self.pp_size
        self.local_size = (self.pp_size - config.remote_pipeline_stages) * self.tp_size
        """Ranks ``0 .. local_size - 1`` run on this host; the rest joined from others."""
        self.timeout_s = timeout_s
        self.device = rank_device(config.device, 0)
        self.last = (self.pp_size - 1) * self.tp_size
        """The rank that sends the driver the logits: the last stage's first."""
        self._pipes: list[Connection | None] = [None] * (self.size - 1)
        """Rank ``r``'s pipe, or step channel if it is remote, at ``r - 1``."""
        self._procs: list[multiprocessing.process.BaseProcess | None] = [None] * (self.size - 1)
        """Rank ``r``'s process at ``r - 1`` (None: it runs on another host)."""
        self.ranks: list[RankInfo] = []
        """Ranks 1.. as they reported themselves (with their KV once agreed)."""
        self._closed = False
        context = multiprocessing.get_context("spawn")
        address = config.distributed_address or "127.0.0.1"
        if self.local_size < self.size:
            use_interface_toward(address)  # before the local ranks start: they inherit it
        init = f"tcp://{address}:{_free_port(address)}"
        self._segments = make_segments(config, self.device)
        threads = rank_threads(config)
        self._threads = torch.get_num_threads()  # restored by close()
        if self.device.type == "cpu":
            torch.set_num_threads(threads)  # this process is a rank too
        try:
            host, parent = socket.gethostname(), os.getpid()
            for rank in range(1, self.local_size):
                ours, theirs = context.Pipe()
                proc = context.Process(
                    target=rank_main,
                    args=(theirs, config, rank, rank, init, timeout_s, threads, parent),
                    kwargs={"segments": self._segments, "host": host},
                    name=f"lamina-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._pipes[rank - 1] = ours
                self._procs[rank - 1] = proc
            if self.local_size < self.size:
                self._join_remote(config, address, init, publish)
            for rank in range(1, self.local_size):
                self._receive(rank, "joining")
            for pipe in self._pipes:
                pipe.send("join")  # type: ignore[union-attr]
            self.tp, self.pp = join(config, 0, init, timeout_s, self._segments, self.device)
        except BaseException:
            self.close()
            raise

    def _join_remote(
        self,
        config: EngineConfig,
        address: str,
        init: str,
        publish: Callable[[Rendezvous], None] | None,
    ) -> None:
        """Publish the remote stages' rendezvous and wait for each of their ranks to
        connect (a local rank that exits meanwhile fails the start at once)."""
        listener = StepListener(address, secrets.token_bytes(32))
        rendezvous = Rendezvous(
            init,
            listener.host,
            listener.port,
            listener.key,
            config,
            checkpoint_digest(config.model),  # type: ignore[arg-type]
            self.timeout_s,
        )
        if publish is not None:
            publish(rendezvous)
        first, last = self.local_size // self.tp_size, self.pp_size - 1
        log.info(
            "waiting for pipeline stage%s to join from other hosts (step channel %s:%d)",
            f" {first}" if first == last else f"s {first}-{last}",
            listener.host,
            listener.port,
        )
        remote = set(range(self.local_size, self.size))
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            joined = listener.accept(remote, deadline, self.check)
        except TimeoutError as exc:
            why = f"{exc} within {START_TIMEOUT_S:g}s"
            raise RankStartError(self.who(min(remote)), why) from None
        for rank, conn in joined.items():
            self._pipes[rank - 1] = conn

    def agree_blocks(self, num_blocks: int, tier_slots: dict[int, int] | None = None) -> int:
        """Wait for every rank to load its shard (one that cannot: :class:`RankStartError`),
        then give each the KV blocks every rank's pool will have: the least any rank (this
        one's ``num_blocks`` included) can hold, and the driver's ``tier_slots`` of each
        lower tier (one slot holds a block of the driver's stage, the first: as many
        layers as any). Each rank then builds its pool."""
        try:
            loaded = [self._receive(rank, "loaded") for rank in range(1, self.size)]
            agreed = min([num_blocks, *(capacity for _, capacity in loaded)])
            for pipe in self._pipes:
                pipe.send((agreed, tier_slots or {}))  # type: ignore[union-attr]
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

    def export_shares(self, moves: np.ndarray, where: np.ndarray) -> list[Share]:
        """Ranks 1..'s shares of the blocks ``where`` names (``(2, n)``: tier, block or
        slot), read after the tiers' pending ``moves``, in rank order. Each rank answers
        after the steps sent before (a pipeline's in flight included); one that does not
        within the collective timeout fails the group."""
        try:
            buffer = pack_blocks(EXPORT, moves, where)
            for pipe in self._pipes:
                pipe.send_bytes(buffer)  # type: ignore[union-attr]
            shares = []
            for rank, pipe in enumerate(self._pipes, start=1):
                if not pipe.poll(self.timeout_s):  # type: ignore[union-attr]
                    raise TimeoutError(f"{self.who(rank)} sent no KV blocks")
                shares.append(load_share(pipe.recv_bytes()))  # type: ignore[union-attr]
            return shares
        except Exception as exc:
            raise self._failure(exc) from exc

    def import_shares(self, moves: np.ndarray, blocks: np.ndarray, shares: list[Share]) -> None:
        """Give ranks 1.. their ``shares`` (in rank order) of blocks to write into device
        blocks ``blocks``, after the tiers' pending ``moves``, before any later step."""
        try:
            for pipe, share in zip(self._pipes, shares, strict=True):
                pipe.send_bytes(pack_blocks(IMPORT, moves, blocks, dump_share(share)))  # type: ignore[union-attr]
        except Exception as exc:
            raise self._failure(exc) from exc

    def write_lora(self, slot: int, adapter: LoraAdapter, model: ModelConfig) -> None:
        """Have ranks 1.. write their shares of ``adapter`` into LoRA slot ``slot``,
        before any later step."""
        try:
            for rank, pipe in enumerate(self._pipes, start=1):
                tp = TensorParallel(rank % self.tp_size, self.tp_size)
                pp = PipelineStage.of(rank, self.tp_size, self.pp_size)
                header = np.array([LORA, slot], dtype=np.int64).tobytes()
                pipe.send_bytes(header + dump_weights(adapter.share(model, tp, pp)))  # type: ignore[union-attr]
        except Exception as exc:
            raise self._failure(exc) from exc

    def check(self) -> None:
        """Raise :class:`RankGroupFailure` if a rank has exited (an idle engine sees no
        collective fail; this is how it learns): a local rank's process, or a remote
        rank's step channel (a rank sends nothing while it runs, so anything readable is
        its end or its last error)."""
        for rank in range(1, self.size):
            gone = self._gone(rank)
            if gone is not None:
                raise RankGroupFailure(gone)

    def _gone(self, rank: int) -> str | None:
        """Why rank ``rank`` is gone, if it is."""
        proc, pipe = self._procs[rank - 1], self._pipes[rank - 1]
        if proc is not None:
            return None if proc.exitcode is None else self._exit_text(rank, proc)
        if pipe is None or not pipe.poll():
            return None
        try:
            kind, value = pipe.recv()
            why = value if kind == "error" else f"it said {kind!r}"
        except (EOFError, OSError):
            why = "its step channel closed (its host's log says why)"
        return f"{self.who(rank)}, on another host: {why}; the group's KV is lost"

    def close(self) -> None:
        """Stop the ranks (each ends its loop on end-of-file) and leave the group."""
        if self._closed:
            return
        self._closed = True
        for pipe in self._pipes:
            if pipe is not None:
                pipe.close()
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            if proc is None:
                continue
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
        assert pipe is not None
        ready = wait([pipe] + ([proc.sentinel] if proc else []), timeout=START_TIMEOUT_S)
        if pipe in ready:
            with contextlib.suppress(EOFError, OSError):
                kind, value = pipe.recv()
                if kind == "error":
                    raise RankStartError(self.who(rank), value)
                assert kind == what, (kind, what)
                return value
        if not ready:
            raise RankStartError(self.who(rank), f"not {what} within {START_TIMEOUT_S:g}s")
        if proc is None:
            why = "its step channel closed (its host's log says why)"
            raise RankStartError(self.who(rank), why)
        proc.join(1.0)
        raise RankStartError(self.who(rank), f"its process (pid {proc.pid}) {_how(proc)}")

    def _failure(self, exc: Exception) -> RankGroupFailure:
        """What a failed step means: a rank that exited if one did, else the error. It
        looks for up to :data:`FAILURE_LOOK_S`: a rank killed mid-step may still be on its
        way out, and while the heartbeat's :meth:`check` reaps it on the loop's thread,
        this thread's ``exitcode`` reads None (its ``waitpid`` finds no child)."""
        deadline = time.monotonic() + FAILURE_LOOK_S
        while True:
            time.sleep(0.05)
            for rank in range(1, self.size):
                gone = self._gone(rank)
                if gone is not None:
                    return RankGroupFailure(gone)
            if time.monotonic() >= deadline:
                break
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
    device: torch.device,
) -> tuple[TensorParallel, PipelineStage]:
    """Join the worker's ``torch.distributed`` group as ``rank`` (on ``device``), with
    ``timeout_s`` on every collective; this rank's place in it. Every rank makes each
    stage's tensor-parallel group, in the same order (``new_group`` is collective), and
    maps its stage's shared-memory all-reduce segment, if it has one."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    size = tp_size * pp_size
    timeout = timedelta(seconds=timeout_s)
    backend = backend_for(device)
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


def make_segments(
    config: EngineConfig, device: torch.device, stages: range | None = None
) -> list[Path | None]:
    """Per pipeline stage, a shared-memory all-reduce segment for its tensor-parallel
    ranks when they run on this host's CPU (None: they use gloo or NCCL alone): for
    ``stages`` (default: those of this host, the first ones)."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    segments: list[Path | None] = [None] * pp_size
    if device.type != "cpu" or tp_size == 1:
        return segments
    if stages is None:
        stages = range(pp_size - config.remote_pipeline_stages)
    for stage in stages:
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
    """Torch threads per rank on CPU: the worker's CPUs split between its ranks (its
    ``OMP_NUM_THREADS`` where set, as ``lamina up`` sets it for each of several workers;
    else the host's)."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    budget = int(first) if first.isdigit() and int(first) > 0 else os.cpu_count() or 1
    return max(1, budget // ranks)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def rank_main(
    channel: Connection | Rendezvous,
    config: EngineConfig,
    rank: int,
    device_index: int,
    init: str,
    timeout_s: float,
    threads: int,
    parent: int,
    *,
    segments: list[Path | None],
    host: str,
) -> None:
    """A rank's process: reach the driver (its pipe, or for a remote rank the step
    channel of the rendezvous), join the group when the driver says so, load the shard,
    then run each step it is sent until the driver's end closes. ``device_index``: its
    place among this host's ranks (its CUDA device after ``config.device``'s)."""
    die_with_parent(9, parent)  # SIGKILL: a rank has nothing to flush
    torch.set_num_threads(threads)
    device = rank_device(config.device, device_index)
    pipe: Connection | None = channel if isinstance(channel, Connection) else None
    try:
        if pipe is None:  # remote: the handshake names the rank
            assert isinstance(channel, Rendezvous)
            pipe = connect(channel.host, channel.port, channel.key, rank)
        else:
            pipe.send(("joining", rank))
        if pipe.recv() != "join":
            return
        tp, pp = join(config, rank, init, timeout_s, segments, device)
        shard = load_shard(config, tp, pp, device)
        info = RankInfo(rank, host, str(device), os.getpid(), shard.weight_bytes, stage=pp.stage)
        pipe.send(("loaded", (info, shard.max_blocks)))
        num_blocks, tier_slots = pipe.recv()
        # Sent once every rank has loaded, so has mapped its stage's segment: remove it,
        # so that nothing is left in /dev/shm however the stage's ranks end.
        if segments[pp.stage] is not None and tp.rank == 0:
            segments[pp.stage].unlink(missing_ok=True)  # type: ignore[union-attr]
        runner = shard.runner(num_blocks, tier_slots)
        runner.lora_slots = shard.lora_slots()
        pipe.send(("ready", dataclasses.replace(info, kv_bytes=num_blocks * shard.block_bytes)))
        sends_logits = pp.last and not pp.first and tp.rank == 0  # to the driver
        while True:
            message = pipe.recv_bytes()
            kind = int(np.frombuffer(message, dtype=np.int64, count=1)[0])
            if kind == STEP:
                step = unpack(message)
                logits = runner.run(step)
                if sends_logits and len(step.sampled):
                    dist.send(logits.contiguous(), 0)
                continue
            if kind == LORA:
                slot = int(np.frombuffer(message, dtype=np.int64, count=2)[1])
                runner.lora_slots.write(slot, load_weights(message[16:]))  # type: ignore[union-attr]
                continue
            moves, blocks, share = unpack_blocks(message)
            runner.transfer(moves)
            if kind == EXPORT:
                pipe.send_bytes(dump_share(runner.read_blocks(blocks.reshape(2, -1))))
            else:
                runner.write_blocks(blocks, load_share(share))
    except (EOFError, OSError):
        return  # the driver closed the pipe, or is gone
    except BaseException as exc:
        if pipe is not None:
            with contextlib.suppress(Exception):
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
