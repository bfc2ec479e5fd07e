"""The shared-memory all-reduce against its reference, gloo's ``all_reduce``: the same sums
(fp32 exactly, bf16 to its rounding), the same bits on every rank, and a rank that dies
or never arrives fails its peers' call instead of wedging them."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lamina.kernels.cpu.shm_allreduce import (
    SHM_DIR,
    ShmAllReduce,
    create_segment,
    segment_path,
)
from lamina.libs.nats_server import free_port

RANKS, CAPACITY = 3, 1 << 16
pytestmark = pytest.mark.skipif(
    not SHM_DIR.is_dir(), reason=f"no {SHM_DIR}: the segments live there (Linux)"
)


def _rank(rank: int, path, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)  # fmt: skip
    shm = ShmAllReduce(path, rank, RANKS, CAPACITY, timeout_s=30)
    try:
        out = []
        for n, (rows, dtype) in enumerate([(1, torch.float32), (7, torch.float32),
                                           (3, torch.bfloat16), (64, torch.float32)]):  # fmt: skip
            torch.manual_seed(100 * n + rank)
            mine = torch.randn(rows, 96).to(dtype)
            got, want = mine.clone(), mine.float()
            assert shm(got)  # in place
            dist.all_reduce(want)
            out.append((got, want.to(dtype)))
        too_big = torch.zeros(CAPACITY)  # four times a slot: refused alike by every rank
        assert not shm(too_big)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_it_sums_as_gloo_does_and_every_rank_gets_the_same_bits(tmp_path):
    path = segment_path("test")
    create_segment(path, RANKS, CAPACITY)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank, args=(path, free_port(), results), nprocs=RANKS, join=True)
            per_rank = [results[r] for r in range(RANKS)]
    finally:
        path.unlink()
    for call in range(len(per_rank[0])):
        got0, want = per_rank[0][call]
        if got0.dtype == torch.float32:
            torch.testing.assert_close(got0, want, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got0.float(), want.float(), atol=0.05, rtol=0.02)
        for r in range(1, RANKS):
            assert torch.equal(per_rank[r][call][0], got0)


def _late(path, ranks: int, wait_s: float, timeout_s: float, out) -> None:
    shm = ShmAllReduce(path, 1, ranks, CAPACITY, timeout_s)
    time.sleep(wait_s)  # arrives late (or, killed meanwhile, never)
    shm(torch.ones(4))
    out.put("arrived")


def _call(path, timeout_s: float) -> str:
    shm = ShmAllReduce(path, 0, 2, CAPACITY, timeout_s)
    started = time.monotonic()
    try:
        shm(torch.ones(4))
    except RuntimeError as exc:
        return f"{exc} after {time.monotonic() - started:.1f}s"
    return "summed"


def test_a_dead_or_hung_rank_fails_the_call(tmp_path):
    path = segment_path("test-dead")
    context = mp.get_context("spawn")
    try:
        create_segment(path, 2, CAPACITY)
        out = context.SimpleQueue()
        peer = context.Process(target=_late, args=(path, 2, 600, 600, out), daemon=True)
        peer.start()
        time.sleep(3)  # attached by now: its pid is in its header
        os.kill(peer.pid, signal.SIGKILL)
        # Killed and not yet reaped (a zombie): seen as ended all the same.
        assert "rank 1 has exited" in _call(path, timeout_s=60)
        peer.join()

        create_segment(path, 2, CAPACITY)  # afresh: a peer that is alive and never calls
        peer = context.Process(target=_late, args=(path, 2, 600, 600, out), daemon=True)
        peer.start()
        time.sleep(3)
        result = _call(path, timeout_s=1.0)
        assert "did not arrive within 1s" in result
        peer.kill()
        peer.join()
    finally:
        path.unlink(missing_ok=True)
