"""A step's input as the driver sends it to its tensor-parallel ranks: packed and unpacked
it is the same step."""

from __future__ import annotations

import numpy as np

from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.block_manager import NO_TRANSFERS, Transfers
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.rank_group import pack, unpack
from lamina.services.engine_worker.engine.request import Request
from lamina.services.engine_worker.engine.runner import StepInput


def _step(
    extra: list[int] | None, decodes_only: bool = False, transfers: Transfers = NO_TRANSFERS
) -> StepInput:
    decode = Request("d", [1, 2, 3, 4, 5], SamplingParams(), max_tokens=8)
    decode.num_computed_tokens = 4
    prefill = Request("p", list(range(10, 40)), SamplingParams(), max_tokens=8)
    prefill.num_computed_tokens = 16
    batch = ScheduledBatch(
        requests=[decode, prefill],
        num_new_tokens=[1, 8],  # the prefill's chunk does not finish its prompt
        block_tables=[[3], [5, 6, 9]],
        num_decodes=1,
    )
    if decodes_only:
        batch = ScheduledBatch(
            requests=[decode], num_new_tokens=[1], block_tables=[[3]], num_decodes=1
        )
    return StepInput.of(batch, 16, extra, transfers)


def test_a_packed_step_unpacks_to_the_same_step():
    moves = Transfers(np.array([[7, 8], [0, 1]]), np.array([[2], [7]]))  # save 7, 8; load 2
    steps = (_step(None), _step([2, 4]), _step(None, decodes_only=True), _step(None, False, moves))
    for step in steps:
        got = unpack(pack(step))
        fields = ("ids", "positions", "slots", "num_new", "context", "table", "sampled")
        for field in (*fields, "saves", "loads"):
            np.testing.assert_array_equal(getattr(got, field), getattr(step, field))
        assert got.table.shape == step.table.shape
        assert got.saves.shape == step.saves.shape and got.loads.shape == step.loads.shape
        flags = ("num_decodes", "decodes_only", "all_sampled")
        assert [getattr(got, f) for f in flags] == [getattr(step, f) for f in flags]
        assert got.ids.flags.writeable  # torch takes it without a copy warning
    assert _step(None, decodes_only=True).decodes_only  # so both values of each flag went through
