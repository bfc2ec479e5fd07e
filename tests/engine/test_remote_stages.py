"""Pipeline stages on another host (``remote_ranks.py``), here over loopback: the worker's
engine publishes its rendezvous and waits; a stage host (``stage_ranks.start_stage``, in
this process) starts the last stage's ranks from it, which join over the step channel
and the network store as a host elsewhere would. The tokens are one process's.

The same across network namespaces, through ``lamina node``:
``tests/multihost/test_pipeline_stages.py``."""

from __future__ import annotations

import time

import pytest

from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.errors import RankGroupFailure
from lamina.services.engine_worker.engine.stage_ranks import StageRanks, start_stage
from tests.engine.helpers import greedy, make_engine, run_to_completion
from tests.engine.test_tensor_parallel import GREEDY, no_segment_left  # noqa: F401

TIMEOUT_S = 30.0


def _remote_engine(model, **config) -> tuple[Engine, list[StageRanks]]:
    """An engine of two stages, the second started by a stage host from its rendezvous."""
    stages: list[StageRanks] = []

    def publish(rendezvous):
        stages.append(start_stage(rendezvous, 1, model, "cpu", "far"))

    settings = dict(model=model, max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=32)
    settings |= dict(pipeline_parallel_size=2, remote_pipeline_stages=1) | config
    return Engine(EngineConfig(**settings), TIMEOUT_S, publish), stages


def _ended(stage: StageRanks, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while stage.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not stage.running()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stage_on_another_host_generates_what_one_process_does(stories, tp):
    want = run_to_completion(make_engine(stories, max_num_batched_tokens=32), GREEDY, greedy(12))
    engine, (stage,) = _remote_engine(stories, tensor_parallel_size=tp)
    try:
        got = run_to_completion(engine, GREEDY, greedy(12))
        ranks = engine.spec.ranks
    finally:
        engine.close()
    assert got == want
    assert [(r.stage, r.host == "far") for r in ranks] == [(0, False)] * tp + [(1, True)] * tp
    assert _ended(stage)  # the driver closed the channel: the remote ranks exit
    stage.stop()


def test_a_remote_rank_that_dies_fails_the_group_naming_it(stories):
    engine, (stage,) = _remote_engine(stories)
    try:
        stage.procs[0].kill()
        with pytest.raises(RankGroupFailure, match=r"rank 1 of 2 .*another host.*KV is lost"):
            for _ in range(100):
                engine.ranks.check()
                time.sleep(0.05)
    finally:
        engine.close()
        stage.stop()


def test_a_stage_host_refuses_a_checkpoint_that_is_not_the_workers(stories, small, tmp_path):
    from lamina.services.engine_worker.engine.rank_group import RankGroup

    seen = []
    config = EngineConfig(
        model=stories, pipeline_parallel_size=2, remote_pipeline_stages=1, num_kv_blocks=16
    )

    def publish(rendezvous):
        seen.append(rendezvous)
        with pytest.raises(ValueError, match="is not the worker's checkpoint"):
            start_stage(rendezvous, 1, small, "cpu", "far")
        with pytest.raises(ValueError, match="no pipeline stage 0 on another host"):
            start_stage(rendezvous, 0, stories, "cpu", "far")
        raise KeyboardInterrupt  # nothing will join: stop waiting

    with pytest.raises(KeyboardInterrupt):
        RankGroup(config, TIMEOUT_S, publish)
    assert len(seen) == 1


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from lamina.services.engine_worker.default_model import ensure_default_model

    return ensure_default_model("small", tmp_path_factory.mktemp("small") / "lamina-small")
