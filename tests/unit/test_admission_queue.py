"""The scheduler's admission queue: order, bounds, removal and expiry."""

from __future__ import annotations

from lamina.schemas.v1.generate import GenerateRequest, Sla
from lamina.services.scheduler.admission_queue import AdmissionQueue

NOW_MS = 1_000_000


def request(rid: str, tokens: int = 10, **sla: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[1] * tokens, sla=Sla(**sla))


def drain(queue: AdmissionQueue) -> list[str]:
    order = []
    while queue.peek() is not None:
        order.append(queue.pop().request.request_id)
    return order


def test_priority_then_due_time_then_arrival():
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    for r in [
        request("plain"),
        request("late", deadline_ms=NOW_MS + 9000),
        request("urgent-target", ttft_target_ms=100),  # due at NOW + 100
        request("soon", deadline_ms=NOW_MS + 500),
        request("important", priority=-1),
        request("plain-2"),
    ]:
        assert queue.push(r, "reply", now=0.0, now_ms=NOW_MS)
    assert queue.position("soon") == 2
    assert drain(queue) == ["important", "urgent-target", "soon", "late", "plain", "plain-2"]
    assert len(queue) == 0 and queue.tokens == 0


def test_bounds_in_requests_and_tokens_refuse_without_queueing():
    queue = AdmissionQueue(max_requests=2, max_tokens=25)
    assert queue.push(request("a", tokens=10), "r", 0.0, NOW_MS)
    assert not queue.push(request("too-long", tokens=20), "r", 0.0, NOW_MS)
    assert queue.push(request("b", tokens=15), "r", 0.0, NOW_MS)
    assert not queue.push(request("c", tokens=1), "r", 0.0, NOW_MS)
    assert (len(queue), queue.tokens) == (2, 25)


def test_removed_and_expired_requests_leave():
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    queue.push(request("gone"), "r", 0.0, NOW_MS)
    queue.push(request("due", deadline_ms=NOW_MS + 100), "r", 0.0, NOW_MS)
    queue.push(request("old"), "r", 0.0, NOW_MS)
    queue.push(request("young"), "r", 5.0, NOW_MS)
    assert queue.remove("gone").request.request_id == "gone"
    assert queue.remove("gone") is None and "gone" not in queue
    expired = queue.expired(now_ms=NOW_MS + 100, now=8.0, max_wait_s=5.0)
    assert sorted(w.request.request_id for w in expired) == ["due", "old"]
    assert drain(queue) == ["young"]
