"""Act-order GPTQ under tensor parallelism: what gathering a row-parallel linear's input
costs. The ``small`` preset written as a 4-bit GPTQ checkpoint twice (groups of 128),
its inputs in order and act-order (``desc_act``, shuffled), decoded by one process and by
two tensor-parallel ranks; each act-order rate against the in-order one of the same
layout, which is the peer. An act-order row-parallel linear gathers every rank's input
(``TensorParallel.gather``: one more all-reduce each, two per layer); at one rank, the
act-order cost is the input's reordering alone.

Not a test: run it by hand on an otherwise idle machine.

    .venv/bin/python benchmarks/parallel_gptq.py          # batch 1 and 32, three runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' checkpoint writer

from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from tests.engine.test_quantized_weights import int4_checkpoint


def decode_rate(path: Path, tp: int, batch: int, steps: int) -> float:
    """Tokens/s of ``batch`` greedy sequences over ``steps`` decode steps."""
    engine = Engine(
        EngineConfig(model=str(path), tensor_parallel_size=tp, max_model_len=256, max_num_seqs=64)
    )
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", list(range(10 + i, 40 + i)), params)
        for _ in range(4):  # the prompts, and a first decode
            engine.step()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return batch * steps / (time.perf_counter() - started)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        small = ensure_default_model("small", root / "small")
        torch.manual_seed(0)
        paths = {
            act: int4_checkpoint(small, root / f"gptq-{act}", "gptq", 128, act)
            for act in (False, True)
        }
        print("batch  ranks  in-order tok/s  act-order tok/s  act-order x in-order")
        for batch in args.batch:
            for tp in (1, 2):
                rates = {}
                for act in (False, True):
                    runs = [
                        decode_rate(paths[act], tp, batch, args.tokens) for _ in range(args.runs)
                    ]
                    rates[act] = statistics.median(runs)
                ratio = rates[True] / rates[False]
                print(
                    f"{batch:5}  {tp:5}  {rates[False]:14.1f}  {rates[True]:15.1f}  {ratio:20.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
