"""One attempt's events, for the one task that reads them, with a wait that can time out.

A stream's every token passes through here, so it costs what a token must: a deque
append, and a future when the reader is waiting. ``asyncio.Queue`` with a timer per wait
cost more on the gateway's hottest path: the queue's ``join`` bookkeeping on every put
and get, and a timer armed and cancelled for every token, though a stream waits on the
same timeout (its liveness check) token after token. Here one timer is armed per
``timeout`` that actually passes: when it fires early (events came meanwhile, and the
reader waits again with a later deadline) it re-arms itself for that deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque

TIMER_SLACK_S = 0.002
"""How early a timer may fire and still end a wait (loops round timers to milliseconds)."""


class Mailbox:
    """Events put by the gateway's inbox, read in order by one task with :meth:`get`."""

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def put_nowait(self, item: object) -> None:
        """Add ``item``, waking the reader."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout: float) -> object | None:
        """The oldest item, waiting up to ``timeout`` seconds for one; None if none came."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._deadline, self._expire)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return self._items.popleft() if self._items else None

    def peek(self) -> object | None:
        """The oldest item, left where it is; None if there is none."""
        return self._items[0] if self._items else None

    def skip(self) -> None:
        """Drop the oldest item (one :meth:`peek` returned)."""
        self._items.popleft()

    def close(self) -> None:
        """Drop the timer (nothing waits any more)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():  # no wait to end: the next one arms its own
            return
        loop = waiter.get_loop()
        if self._deadline - loop.time() > TIMER_SLACK_S:  # armed for an earlier wait
            self._timer = loop.call_at(self._deadline, self._expire)
        else:
            waiter.set_result(None)
