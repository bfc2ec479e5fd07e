"""A worker's streams as events: every token sent once, in ``seq`` order, with a stream
interval above 1 as with none; the first token at once, the rest every ``n``, and what
is held goes with the end, ahead of a failure, or with a keep-alive."""

from __future__ import annotations

import pytest

from lamina.schemas.v1.generate import Failed, Finished, TokenLogprob, Tokens
from lamina.services.engine_worker.engine.outputs import RequestOutput
from lamina.services.engine_worker.engine.params import FinishReason
from lamina.services.engine_worker.streams import Stream, Streams


def step(rid: str, token: int, *, finished: bool = False, logprob: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        new_token_ids=[token],
        new_logprobs=[(-0.5, [(token, -0.5)])] if logprob else None,
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=token,
        num_cached_tokens=0,
    )


def events(streams: Streams, rid: str, steps: int, **kw) -> list:
    """The messages of ``steps`` steps of one request that finishes at the last."""
    streams[rid] = Stream(f"inbox.{rid}.w", None)
    out = []
    for token in range(1, steps + 1):
        out += [m for _, m, _ in streams.outputs([step(rid, token, finished=token == steps, **kw)])]
    return out


@pytest.mark.parametrize("interval", [1, 2, 3, 7, 20])
def test_every_token_goes_once_in_order_first_at_once_then_every_n(interval):
    sent = events(Streams(interval), "r", 10)
    assert [m.seq for m in sent] == list(range(1, len(sent) + 1))
    assert [t for m in sent for t in m.token_ids] == list(range(1, 11))
    assert sent[0].token_ids == [1]  # the first token is not held back
    assert all(len(m.token_ids) == interval for m in sent[1:-1])
    assert isinstance(sent[-1], Finished) and 1 <= len(sent[-1].token_ids) <= interval
    assert len(sent) == 1 + -(-9 // interval)


def test_logprobs_are_held_with_their_tokens():
    sent = events(Streams(4), "r", 6, logprob=True)
    assert [len(m.token_ids) for m in sent] == [1, 4, 1]
    assert all(m.logprobs == [TokenLogprob(-0.5, [(t, -0.5)]) for t in m.token_ids] for m in sent)


def test_held_tokens_go_ahead_of_a_failure_and_with_a_keep_alive():
    streams = Streams(5)
    streams["r"] = Stream("inbox.r.w", None)
    for token in (1, 2, 3):
        streams.outputs([step("r", token)])
    ((_, alive, _),) = streams.keepalives(now=streams["r"].sent_at + 10, silence_s=1)
    assert alive == Tokens(request_id="r", seq=2, token_ids=[2, 3])
    streams.outputs([step("r", 4)])
    tokens, failed = (m for _, m, _ in streams.fail("r", "moved", retryable=True))
    assert tokens == Tokens(request_id="r", seq=3, token_ids=[4])
    assert isinstance(failed, Failed) and failed.seq == 4 and failed.tokens_sent
    assert "r" not in streams


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Streams(0)
