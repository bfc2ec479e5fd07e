"""On CUDA a step may make the host wait exactly once: when it reads the sampled tokens.
Every upload (ids, positions, slots, block tables, sampling parameters) is asynchronous
(``kernels/transfer.py``). Checked with torch's sync debug mode, which warns at each
synchronising call; runs on a GPU only (``benchmarks/gpu_check.sh``). On CPU the same
uploads are plain host tensors, which the rest of the suite covers."""

from __future__ import annotations

import warnings

import pytest
import torch

from lamina.services.engine_worker.request import SamplingParams
from tests.engine.helpers import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _syncs(fn) -> int:
    """How many synchronising CUDA calls ``fn()`` makes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("cuda_graphs", [False, None])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_step_synchronises_once(tiny_model, monkeypatch, cuda_graphs, sampled):
    monkeypatch.delenv("LAMINA_KERNELS", raising=False)
    engine = make_engine(tiny_model, device="cuda", cuda_graphs=cuda_graphs)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    if sampled:  # every vectorised path of the sampler: penalties, filters, seeds, min_tokens
        params = SamplingParams(
            max_tokens=6,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            min_tokens=3,
            seed=7,
        )
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5 + i, 40 + 3 * i)), params)
    engine.step()  # first launches and allocations out of the way
    counts = []
    while engine.has_work():
        counts.append(_syncs(engine.step))
    assert counts and all(n == 1 for n in counts), counts
