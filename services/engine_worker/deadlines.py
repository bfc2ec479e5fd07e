"""Requests' deadlines on the worker: a request still running when its ``Sla.deadline_ms``
passes is stopped, its blocks freed at once (its result would be useless)."""

from __future__ import annotations

from collections.abc import Container


class Deadlines:
    """The deadlines (Unix ms) of the requests that have one."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}

    def add(self, request_id: str, deadline_ms: int | None) -> None:
        if deadline_ms is not None:
            self._at[request_id] = deadline_ms

    def expired(self, live: Container[str], now_ms: float) -> list[str]:
        """The live requests whose deadline has passed; they, and every request no
        longer live, are forgotten."""
        if not self._at:  # the common case: nothing to look at each step
            return []
        expired = []
        for rid, deadline_ms in list(self._at.items()):
            if rid not in live or deadline_ms < now_ms:
                del self._at[rid]
                if rid in live:
                    expired.append(rid)
        return expired
