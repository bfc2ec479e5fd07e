"""A stream reader that fell behind takes the token events queued for it as one event
(``remote_request.with_queued_tokens``): in order, with their logprobs, never across a
gap in ``seq`` or a change in whether logprobs come, keep-alives dropped."""

from __future__ import annotations

from lamina.schemas.v1.generate import Finished, FinishReason, TokenLogprob, Tokens, Usage
from lamina.services.gateway.mailbox import Mailbox
from lamina.services.gateway.remote_request import with_queued_tokens


def tokens(seq: int, *ids: int, logprobs: bool = False) -> Tokens:
    scored = [TokenLogprob(logprob=-i / 100, top=[]) for i in ids] if logprobs else None
    return Tokens(request_id="r", seq=seq, token_ids=list(ids), logprobs=scored)


def queued(*events: object) -> Mailbox:
    box = Mailbox()
    for event in events:
        box.put_nowait(event)
    return box


def rest(box: Mailbox) -> list[object]:
    out = []
    while (event := box.peek()) is not None:
        box.skip()
        out.append(event)
    return out


def test_tokens_queued_behind_an_event_come_with_it_and_a_keep_alive_is_dropped():
    box = queued(tokens(2, 41), tokens(3), tokens(4, 42, 43), tokens(6, 44))
    event, expected = with_queued_tokens(tokens(1, 40), 2, box)
    assert (event.seq, event.token_ids, event.logprobs) == (4, [40, 41, 42, 43], None)
    assert expected == 5
    assert rest(box) == [tokens(6, 44)]  # after a gap: the reader's to find


def test_nothing_queued_leaves_the_event_as_it_came():
    first = tokens(1, 40)
    event, expected = with_queued_tokens(first, 2, queued())
    assert event is first and expected == 2


def test_logprobs_merge_with_their_tokens_and_a_change_in_them_ends_the_merge():
    box = queued(tokens(2, 41, logprobs=True), tokens(3), tokens(4, 42))
    event, expected = with_queued_tokens(tokens(1, 40, logprobs=True), 2, box)
    assert event.token_ids == [40, 41]
    assert [lp.logprob for lp in event.logprobs] == [-0.4, -0.41]
    assert expected == 4  # the keep-alive (3) went with them
    assert rest(box) == [tokens(4, 42)]


def test_the_end_of_the_stream_is_not_merged_into_a_tokens_event():
    end = Finished(
        request_id="r",
        seq=3,
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=3, completion_tokens=3),
        token_ids=[42],
    )
    box = queued(tokens(2, 41), end)
    event, expected = with_queued_tokens(tokens(1, 40), 2, box)
    assert (event.token_ids, expected) == ([40, 41], 3)
    assert rest(box) == [end]
