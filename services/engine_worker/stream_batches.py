"""Several streams' events to one gateway as one message (``StreamBatch``).

Whatever the outbox holds when its publisher gets to it (one engine step's events, or
several steps' when the publisher fell behind) leaves as one ``StreamBatch`` per gateway
that reads batches, instead of one message per stream (at 32 streams, 32 messages a step
for the server to route and the gateway to decode one by one). Each stream's events stay in
their order within the batch, and a stream's events all go the same way within one
call, so the ``seq`` contract (``StreamEvent``) holds.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import StreamBatch, StreamedEvent
from lamina.services.engine_worker.streams import Outgoing


def coalesce(
    outgoing: Iterable[Outgoing], batching: Container[str], worker_id: str
) -> list[Outgoing]:
    """``outgoing`` as the messages to publish: each event on this worker's stream subject
    (``<inbox>.<attempt>.<worker_id>``) of a gateway inbox in ``batching`` goes into that
    gateway's batch (sent after the single messages, without a trace context: the
    gateway reads a stream's events untraced); everything else as it was, in order."""
    singles: list[Outgoing] = []
    batches: dict[str, list[StreamedEvent]] = {}
    for item in outgoing:
        subject = item[0]
        inbox, attempt, sender = _split(subject)
        if sender == worker_id and inbox in batching:
            batches.setdefault(inbox, []).append(StreamedEvent(attempt, item[1]))
        else:
            singles.append(item)
    for inbox, events in batches.items():
        singles.append((subjects.stream_batch(inbox, worker_id), StreamBatch(events=events), None))
    return singles


def split(batch: StreamBatch) -> tuple[StreamBatch, StreamBatch]:
    """``batch`` in two halves (for a batch over the bus's ``max_payload``): each
    stream's events stay in order, the first half's before the second's."""
    half = len(batch.events) // 2
    return StreamBatch(events=batch.events[:half]), StreamBatch(events=batch.events[half:])


def _split(subject: str) -> tuple[str, str, str]:
    """``<inbox>.<attempt>.<worker>`` -> its three parts (empty ones for a shorter one)."""
    parts = subject.rsplit(".", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", "", "")
