"""Tensor parallelism at the model level: two CPU processes over gloo give the same logits
as one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.engine.loader import CheckpointTensors
from lamina.services.engine_worker.engine.model import CausalLM
from lamina.services.engine_worker.engine.parallel import TensorParallel
from lamina.services.engine_worker.engine.runner import ModelRunner
from tests.engine.helpers import make_engine, teacher_forced_logits

SEQS, PROMPTS = [list(range(5, 30)), list(range(40, 52))], [20, 7]


def logits_for(path, tp: TensorParallel) -> list[torch.Tensor]:
    """Teacher-forced logits from an engine whose model is this rank's shard."""
    engine = make_engine(path)
    model = CausalLM(
        engine.model_config, CheckpointTensors(path), torch.float32, torch.device("cpu"), tp
    )
    engine.runner = ModelRunner(
        model, engine.blocks.num_blocks, engine.config.block_size, torch.device("cpu")
    )
    return teacher_forced_logits(engine, SEQS, PROMPTS)


def _rank(rank: int, port: int, path, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        results[rank] = logits_for(path, TensorParallel(rank=rank, size=2))
    finally:
        dist.destroy_process_group()


def test_two_way_tensor_parallel_matches_one_process(make_checkpoint):
    # Qwen3 with attention biases: q/k norm, column- and row-parallel biases all shard.
    path = make_checkpoint("qwen3", attention_bias=True)
    want = logits_for(path, TensorParallel())
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), path, results), nprocs=2, join=True)
        got = [results[0], results[1]]
    for rank_logits in got:
        for g, w in zip(rank_logits, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
