"""A step's input as the driver sends it to its tensor-parallel ranks: packed and unpacked
it is the same step."""

from __future__ import annotations

import numpy as np

from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.block_manager import NO_MOVES
from lamina.services.engine_worker.engine.kv_tier import DEVICE, DISK, HOST
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.rank_group import (
    EXPORT,
    IMPORT,
    pack,
    pack_blocks,
    unpack,
    unpack_blocks,
)
from lamina.services.engine_worker.engine.request import Request
from lamina.services.engine_worker.engine.runner import StepInput


def _step(
    extra: list[int] | None, decodes_only: bool = False, moves: np.ndarray = NO_MOVES
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
    return StepInput.of(batch, 16, extra, moves)


def test_a_packed_step_unpacks_to_the_same_step():
    # Save device blocks 7 and 8 to the host tier, demote its slot 0, load disk slot 2.
    moves = np.array([[DEVICE, 7, HOST, 0], [DEVICE, 8, HOST, 1], [HOST, 0, DISK, 3]]).T
    moves = np.concatenate([moves, np.array([[DISK, 2, DEVICE, 7]]).T], axis=1)
    steps = (_step(None), _step([2, 4]), _step(None, decodes_only=True), _step(None, False, moves))
    for step in steps:
        got = unpack(pack(step))
        fields = ("ids", "positions", "slots", "num_new", "context", "table", "sampled")
        for field in (*fields, "moves"):
            np.testing.assert_array_equal(getattr(got, field), getattr(step, field))
        assert got.table.shape == step.table.shape
        assert got.moves.shape == step.moves.shape
        flags = ("num_decodes", "decodes_only", "all_sampled")
        assert [getattr(got, f) for f in flags] == [getattr(step, f) for f in flags]
        assert got.ids.flags.writeable  # torch takes it without a copy warning
    assert _step(None, decodes_only=True).decodes_only  # so both values of each flag went through


def test_a_blocks_message_unpacks_to_its_moves_blocks_and_share():
    moves = np.array([[DEVICE, 7, HOST, 0], [HOST, 2, DEVICE, 9]]).T
    where = np.array([[DEVICE, HOST, DISK], [3, 0, 5]])
    message = pack_blocks(EXPORT, moves, where)
    assert np.frombuffer(message, dtype=np.int64, count=1)[0] == EXPORT
    got_moves, got_blocks, share = unpack_blocks(message)
    np.testing.assert_array_equal(got_moves, moves)
    np.testing.assert_array_equal(got_blocks.reshape(2, -1), where)
    assert bytes(share) == b""
    message = pack_blocks(IMPORT, NO_MOVES, np.array([4, 1]), b"the share's bytes")
    got_moves, got_blocks, share = unpack_blocks(message)
    assert got_moves.shape == (4, 0) and got_blocks.tolist() == [4, 1]
    assert bytes(share) == b"the share's bytes"
    # A step's first int64 says it is one.
    assert np.frombuffer(pack(_step(None)), dtype=np.int64, count=1)[0] == 0
