"""On CUDA a step may make the host wait exactly once: when it reads the sampled tokens.
Every upload (ids, positions, slots, block tables, sampling parameters) is asynchronous
(``kernels/transfer.py``). Checked with torch's sync debug mode, which warns at each
synchronising call; runs on a GPU only (``benchmarks/gpu_check.sh``). On CPU the same
uploads are plain host tensors, which the rest of the suite covers."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from lamina.services.engine_worker.engine.params import SamplingParams
from tests.engine.helpers import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _syncs(fn) -> list[str]:
    """The synchronising CUDA calls ``fn()`` makes: for each, the Python stack (innermost
    four frames) where torch's sync debug mode warned."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames = traceback.extract_stack()[:-2][-4:]
            found.append(" <- ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(frames)))

    # Switched on outside the recording: the first switch in a process warns by itself.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return found


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
    syncs = []
    while engine.has_work():
        syncs.append(_syncs(engine.step))
    if not syncs or any(len(step) != 1 for step in syncs):
        pytest.fail("\n".join(f"step {i + 1}: {step}" for i, step in enumerate(syncs)))
