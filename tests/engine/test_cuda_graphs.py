"""Decode graphs (``cuda_graphs.py``) without the recording: with ``cuda_graphs=True`` on
CPU the engine runs decode-only steps through the same static buffers, padding rows and
fixed-width block tables that the graphs replay, eagerly. Outputs must not change. The
recording itself runs only on CUDA (``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lamina.services.engine_worker.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tests.engine.helpers import greedy, make_engine, run_to_completion


def test_batch_size_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_batch_sizes(128)[-3:] == [112, 120, 128]


def _prompts(n: int) -> dict[str, list[int]]:
    """Prompts of different lengths, some crossing block boundaries as they decode."""
    return {f"r{i}": [(7 * i + j) % 500 + 3 for j in range(5 + 6 * i)] for i in range(n)}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_static_decode_path_matches_the_ordinary_one(tiny_model, monkeypatch, kv_cache_dtype):
    monkeypatch.setenv("LAMINA_KERNELS", "cpu")
    prompts = _prompts(7)  # padded to the bucket of 8; then 6, 5, ... as requests end
    want = run_to_completion(
        make_engine(tiny_model, kv_cache_dtype=kv_cache_dtype, cuda_graphs=False),
        prompts,
        greedy(20),
    )
    engine = make_engine(
        tiny_model, kv_cache_dtype=kv_cache_dtype, cuda_graphs=True, max_num_seqs=8
    )
    graphs = engine.runner.decode_graphs
    assert graphs is not None and not graphs.captured
    assert engine.blocks.num_blocks == 127  # the last block pads graph batches
    sizes = []
    run = graphs.run

    def counting_run(*args):
        sizes.append(len(args[0]))
        return run(*args)

    monkeypatch.setattr(graphs, "run", counting_run)
    params = {rid: greedy(20 - int(rid[1:])) for rid in prompts}  # requests end at different steps
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid])
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert got == {rid: want[rid][: 20 - int(rid[1:])] for rid in prompts}
    assert 7 in sizes and 1 in sizes  # full and shrinking batches took the graph path
    # The pad block never reaches a request, and everything is free at the end.
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_padding_rows_write_only_the_pad_block(tiny_model, monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "cpu")
    engine = make_engine(tiny_model, cuda_graphs=True, max_num_seqs=8)
    graphs: DecodeGraphs = engine.runner.decode_graphs
    bs, pad = engine.config.block_size, graphs.pad_block

    def step(blocks: list[int], context: int) -> set[tuple[int, int]]:
        """One decode of len(blocks) sequences, each on its own block; the (block, offset)
        cells whose keys changed in layer 0."""
        n = len(blocks)
        before = engine.runner.kv_caches[0][0].clone()
        table = np.asarray(blocks, dtype=np.int64)[:, None]
        slots = table[:, 0] * bs + context
        ids = np.arange(3, 3 + n, dtype=np.int64)
        graphs.run(ids, np.full(n, context), slots, np.full(n, context), table)
        changed = (engine.runner.kv_caches[0][0] != before).any(-1).any(-1).nonzero()
        return {(int(b), int(o)) for b, o in changed}

    for cache in engine.runner.kv_caches:
        cache.normal_()
    assert step(list(range(10, 18)), 5) == {(b, 5) for b in range(10, 18)}  # a full bucket
    # Three sequences in the bucket of 4: row 3 still holds the last step's sequence, and
    # must be rewritten as padding instead of writing into block 13 again.
    assert step([20, 21, 22], 7) == {(20, 7), (21, 7), (22, 7), (pad, 0)}


def test_graphs_refuse_what_they_cannot_replay(tiny_model, monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "reference")
    with pytest.raises(ValueError, match="block-table kernels"):
        make_engine(tiny_model, cuda_graphs=True)
    monkeypatch.setenv("LAMINA_KERNELS", "cpu")
    with pytest.raises(ValueError, match="int8"):
        make_engine(tiny_model, cuda_graphs=True, kv_cache_dtype="int8")


def test_default_is_eager_off_cuda(tiny_model):
    engine = make_engine(tiny_model)
    assert engine.runner.decode_graphs is None and engine.blocks.num_blocks == 128


def test_too_many_sequences_is_an_error(tiny_model, monkeypatch):
    monkeypatch.setenv("LAMINA_KERNELS", "cpu")
    engine = make_engine(tiny_model, cuda_graphs=True, max_num_seqs=2)
    graphs: DecodeGraphs = engine.runner.decode_graphs
    assert graphs.bucket(2) == 2 and graphs.bucket(3) is None
    ints = torch.zeros(3, dtype=torch.int64).numpy()
    with pytest.raises(ValueError, match="exceed"):
        graphs.run(ints, ints, ints, ints, ints[:, None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records CUDA graphs: needs a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_recorded_graphs_match_eager_on_cuda(tiny_model, monkeypatch, kv_cache_dtype):
    monkeypatch.delenv("LAMINA_KERNELS", raising=False)
    outputs = {}
    for graphs in (False, None):
        engine = make_engine(
            tiny_model, device="cuda", kv_cache_dtype=kv_cache_dtype, cuda_graphs=graphs
        )
        assert (engine.runner.decode_graphs is not None) == (graphs is None)
        outputs[graphs] = run_to_completion(engine, _prompts(7), greedy(20))
    assert engine.runner.decode_graphs.captured
    assert outputs[None] == outputs[False]
