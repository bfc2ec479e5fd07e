"""Tensor parallelism: each rank's share of every supported architecture, and engines of
two ranks (two processes over gloo) against one process on the same weights.

Tolerance: logits of one step agree within 1e-4 (absolute and relative) in fp32. Two
ranks sum each row-parallel product in two halves where one process sums it whole, so
they differ in rounding only (~1e-6 here); greedy tokens are equal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lamina.kernels.cpu.shm_allreduce import SHM_DIR
from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.errors import ModelLoadError, RankGroupFailure
from lamina.services.engine_worker.engine.loader import CheckpointTensors
from lamina.services.engine_worker.engine.model import CausalLM
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.parallel import GatheredInput, TensorParallel
from lamina.services.engine_worker.engine.runner import ModelRunner
from tests.engine.helpers import greedy, make_engine, run_to_completion, teacher_forced_logits
from tests.engine.test_quantized_weights import int4_checkpoint

SEQS, PROMPTS = [list(range(5, 30)), list(range(40, 52))], [20, 7]


@pytest.fixture(autouse=True)
def no_segment_left():
    """Whatever a test does to a group, its shared-memory all-reduce segments go with it
    (the spawned script's included: it runs with its own ``/dev/shm`` names)."""
    before = set(SHM_DIR.glob("lamina-allreduce-*"))
    yield
    assert set(SHM_DIR.glob("lamina-allreduce-*")) <= before


GREEDY = {"a": list(range(40, 61)), "b": [7, 8, 9], "c": list(range(100, 140))}


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


@pytest.mark.parametrize(
    "family, overrides",
    [
        # Qwen3 with attention biases: q/k norm, column- and row-parallel biases all shard.
        ("qwen3", {"attention_bias": True}),
        # One KV head for two ranks: each holds it (replicated).
        ("mistral", {}),
    ],
)
def test_two_way_tensor_parallel_matches_one_process(make_checkpoint, family, overrides):
    path = make_checkpoint(family, **overrides)
    want = logits_for(path, TensorParallel())
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), path, results), nprocs=2, join=True)
        got = [results[0], results[1]]
    for rank_logits in got:
        for g, w in zip(rank_logits, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------- shard shapes
def _models(path, size: int) -> tuple[ModelConfig, CausalLM, list[CausalLM]]:
    """The checkpoint's config, its model whole, and each of ``size`` ranks' share."""
    config = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    whole = CausalLM(config, CheckpointTensors(path), torch.float32, cpu)
    shares = [
        CausalLM(config, CheckpointTensors(path), torch.float32, cpu, TensorParallel(rank, size))
        for rank in range(size)
    ]
    return config, whole, shares


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_each_rank_holds_its_share_of_every_architecture(make_checkpoint, monkeypatch, family):
    monkeypatch.setenv("LAMINA_CPU_LINEAR", "torch")  # linears that keep their weight
    path = make_checkpoint(family)
    size = 2
    config, whole, shares = _models(path, size)
    d, kv = config.head_dim, config.num_kv_heads
    local_kv = max(1, kv // size)  # mistral's one KV head is on both ranks
    for rank, share in enumerate(shares):
        c = share.local
        assert (c.num_heads, c.num_kv_heads) == (config.num_heads // size, local_kv)
        assert c.intermediate_size == config.intermediate_size // size
        layer, full = share.layers[0], whole.layers[0]
        q_rows = c.num_heads * d
        assert layer.qkv.weight.shape[0] == q_rows + 2 * local_kv * d
        assert layer.o.weight.shape == (config.hidden_size, q_rows)
        assert layer.down.weight.shape == (config.hidden_size, c.intermediate_size)
        assert layer.gate_up.linear.weight.shape == (2 * c.intermediate_size, config.hidden_size)
        # The rank's K rows are its KV heads' rows of the whole K projection.
        first = rank * kv // size
        k_whole = full.qkv.weight[config.num_heads * d :][: kv * d]
        torch.testing.assert_close(
            layer.qkv.weight[q_rows : q_rows + local_kv * d],
            k_whole[first * d : (first + local_kv) * d],
        )
        assert share.weight_bytes < whole.weight_bytes


def test_kv_heads_that_neither_divide_nor_replicate_are_refused(make_checkpoint):
    # 6 query heads and 3 KV heads over 2 ranks: 3 KV heads split neither way.
    path = make_checkpoint(
        "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192
    )
    config = ModelConfig.from_dir(path)
    with pytest.raises(ModelLoadError, match="neither divide across nor replicate"):
        TensorParallel(0, 2).local_config(config)
    assert TensorParallel(0, 3).local_config(config).num_kv_heads == 1  # 3 ranks: one each


# ----------------------------------------------------------------------- engines of ranks
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The ``small`` preset (512 wide, 10 layers, 2 KV heads) made locally."""
    return ensure_default_model("small", tmp_path_factory.mktemp("small") / "lamina-small")


def _compare(path, **config) -> None:
    """An engine of two ranks against one: the same greedy tokens, and logits within the
    tolerance above."""
    one = make_engine(path, max_num_batched_tokens=32, **config)
    want = run_to_completion(one, GREEDY, greedy(12))
    want_logits = teacher_forced_logits(one, SEQS, PROMPTS)
    two = make_engine(path, max_num_batched_tokens=32, tensor_parallel_size=2, **config)
    try:
        assert [info.rank for info in two.spec.ranks] == [0, 1]
        assert len({info.pid for info in two.spec.ranks}) == 2
        assert two.spec.num_kv_blocks == one.spec.num_kv_blocks
        got = run_to_completion(two, GREEDY, greedy(12))
        got_logits = teacher_forced_logits(two, SEQS, PROMPTS)
    finally:
        two.close()
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_two_ranks_generate_what_one_process_does_on_a_trained_model(stories):
    _compare(stories)


def test_two_ranks_generate_what_one_process_does_on_the_small_preset(small):
    _compare(small, max_model_len=128)


def test_two_ranks_of_int8_weights_quantize_as_one_process(stories):
    # Each row-parallel weight is quantized whole, then split: the same scales.
    _compare(stories, quantization="int8")


@pytest.mark.parametrize("linear", ["native", "torch"])
def test_two_ranks_of_an_act_order_gptq_checkpoint_generate_what_one_process_does(
    make_checkpoint, tmp_path, monkeypatch, linear
):
    """``desc_act``: a row-parallel weight's rank holds whole groups of its stored order
    and gathers the layer's inputs to pick its own; on the native matmul and on the
    dequantizing reference (``torch``)."""
    monkeypatch.setenv("LAMINA_CPU_LINEAR", linear)  # the spawned ranks inherit it
    torch.manual_seed(5)
    path = int4_checkpoint(make_checkpoint("qwen2"), tmp_path / "gptq", "gptq", 32, True)
    _compare(path)


def test_an_act_order_row_parallel_share_is_whole_groups_of_the_stored_order(
    make_checkpoint, tmp_path
):
    torch.manual_seed(5)
    path = int4_checkpoint(make_checkpoint("llama"), tmp_path / "gptq", "gptq", 32, True)
    config, whole, shares = _models(path, 2)
    full = whole.layers[0].down
    assert not isinstance(full, GatheredInput)
    halves = []
    for layer in (share.layers[0] for share in shares):
        assert isinstance(layer.down, GatheredInput) and isinstance(layer.o, GatheredInput)
        down = layer.down.linear
        assert (down.in_features, down.group) == (config.intermediate_size // 2, 32)
        halves.append(down.input_order)
    # The ranks' inputs are the stored order's two halves: every input once.
    assert torch.equal(torch.cat(halves), full.input_order)


def test_a_rank_holds_about_half_the_weights_and_half_the_kv(small):
    one = make_engine(small, max_model_len=128, kv_cache_memory_bytes=8 << 20, num_kv_blocks=None)
    two = make_engine(
        small,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        num_kv_blocks=None,
        tensor_parallel_size=2,
    )
    try:
        (whole,), ranks = one.spec.ranks, two.spec.ranks
        for rank in ranks:
            # Embeddings and the LM head are replicated: a little over half.
            assert 0.45 * whole.weight_bytes < rank.weight_bytes < 0.65 * whole.weight_bytes
            # The budget is per rank; each rank holds half the KV heads: twice the blocks.
            assert rank.kv_bytes == ranks[0].kv_bytes
        assert two.spec.num_kv_blocks == 2 * one.spec.num_kv_blocks
    finally:
        two.close()


# ------------------------------------------------------------------------------ failures
def _rank_pid(engine) -> int:
    return engine.spec.ranks[1].pid


def test_a_rank_that_dies_while_idle_fails_the_group_naming_it(stories):
    engine = make_engine(stories, tensor_parallel_size=2)
    try:
        os.kill(_rank_pid(engine), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                engine.check()
            except RankGroupFailure as exc:
                assert "rank 1 of 2" in str(exc) and "signal 9" in str(exc)
                break
            assert time.monotonic() < deadline, "the dead rank was never noticed"
            time.sleep(0.05)
    finally:
        engine.close()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_rank_that_dies_mid_stream_fails_the_step(stories, layout):
    engine = make_engine(stories, **layout)
    try:
        engine.add_request("r", list(range(5, 20)), greedy(50))
        engine.step()
        os.kill(_rank_pid(engine), signal.SIGKILL)
        with pytest.raises(RankGroupFailure, match="rank 1 of 2"):
            for _ in range(50):
                engine.step()
    finally:
        engine.close()


def test_a_rank_that_hangs_fails_the_step_by_the_collective_timeout(stories):
    from lamina.services.engine_worker.engine.config import EngineConfig
    from lamina.services.engine_worker.engine.engine import Engine

    config = EngineConfig(
        model=stories, max_model_len=256, num_kv_blocks=128, tensor_parallel_size=2
    )
    engine = Engine(config, collective_timeout_s=2.0)
    pid = _rank_pid(engine)
    try:
        engine.add_request("r", list(range(5, 20)), greedy(50))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RankGroupFailure, match="out of step"):
            engine.step()
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.close()


def test_a_rank_that_cannot_start_fails_start_up_in_one_line_naming_it(stories, tmp_path):
    # A script without a main guard: its spawned rank re-runs it and exits at once.
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from lamina.services.engine_worker.engine.config import EngineConfig
            from lamina.services.engine_worker.engine.engine import Engine
            from lamina.services.engine_worker.engine.errors import RankStartError
            try:
                Engine(EngineConfig(model={str(stories)!r}, num_kv_blocks=64,
                                    tensor_parallel_size=2))
            except RankStartError as exc:
                print("REFUSED", exc)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    ).stdout
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert (
        refused == [refused[0]]
        and "tensor-parallel rank 1 of 2 cannot start: its process" in refused[0]
    ), out
