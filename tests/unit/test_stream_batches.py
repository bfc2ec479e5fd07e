"""A worker's outbox as the messages it publishes: one ``StreamBatch`` per gateway that
reads them, each stream's events in order; everything else as it was."""

from __future__ import annotations

from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import Accepted, StreamBatch, StreamedEvent, Tokens
from lamina.services.engine_worker.stream_batches import coalesce, split


def tokens(rid: str, seq: int) -> Tokens:
    return Tokens(request_id=rid, seq=seq, token_ids=[seq])


def test_events_for_batching_gateways_go_one_batch_per_gateway_in_order():
    g1, g2, old = "_INBOX.gateway.g1", "_INBOX.gateway.g2", "_INBOX.gateway.old"
    on = {g: {a: subjects.worker_stream(f"{g}.{a}", "w") for a in ("x", "y")} for g in (g1, g2)}
    legacy = subjects.worker_stream(f"{old}.z", "w")
    other_worker = subjects.worker_stream(f"{g1}.q", "w2")  # not this worker's subject
    outgoing = [
        (on[g1]["x"], Accepted(request_id="x", worker_id="w"), "cx"),
        (legacy, tokens("z", 1), "cz"),
        (on[g2]["x"], tokens("x2", 1), "c"),
        (on[g1]["y"], tokens("y", 1), "c"),
        (on[g1]["x"], tokens("x", 1), "cx"),
        (other_worker, tokens("q", 1), "cq"),
        (legacy, tokens("z", 2), "cz"),
        (on[g1]["x"], tokens("x", 2), "cx"),
        ("reply.of.a.client", tokens("c", 1), None),
    ]
    out = coalesce(outgoing, {g1, g2}, "w")
    assert out == [
        (legacy, tokens("z", 1), "cz"),
        (other_worker, tokens("q", 1), "cq"),
        (legacy, tokens("z", 2), "cz"),
        ("reply.of.a.client", tokens("c", 1), None),
        (
            subjects.stream_batch(g1, "w"),
            StreamBatch(
                events=[
                    StreamedEvent("x", Accepted(request_id="x", worker_id="w")),
                    StreamedEvent("y", tokens("y", 1)),
                    StreamedEvent("x", tokens("x", 1)),
                    StreamedEvent("x", tokens("x", 2)),
                ]
            ),
            None,
        ),
        (
            subjects.stream_batch(g2, "w"),
            StreamBatch(events=[StreamedEvent("x", tokens("x2", 1))]),
            None,
        ),
    ]
    assert coalesce(outgoing, set(), "w") == outgoing


def test_a_batch_splits_in_order():
    events = [StreamedEvent("x", tokens("x", seq)) for seq in range(1, 6)]
    first, second = split(StreamBatch(events=events))
    assert first.events + second.events == events and len(first.events) == 2
