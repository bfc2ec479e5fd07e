"""The gateway's per-attempt mailbox: order, timeouts, one timer per timeout that
passes, and a cancelled reader."""

from __future__ import annotations

import asyncio

import pytest

from lamina.services.gateway.mailbox import Mailbox


def test_items_come_in_order_whether_put_before_or_during_the_wait():
    async def main() -> list[object]:
        box = Mailbox()
        box.put_nowait(1)
        box.put_nowait(2)
        got = [await box.get(5), await box.get(5)]
        asyncio.get_running_loop().call_later(0.01, box.put_nowait, 3)
        got.append(await box.get(5))
        box.close()
        return got

    assert asyncio.run(asyncio.wait_for(main(), 10)) == [1, 2, 3]


def test_a_wait_with_nothing_put_ends_with_none_after_its_timeout():
    async def main() -> float:
        box = Mailbox()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await box.get(0.05) is None
        return loop.time() - started

    assert asyncio.run(asyncio.wait_for(main(), 10)) >= 0.05 - 0.002


def test_the_timer_armed_by_an_earlier_wait_re_arms_for_the_later_deadline():
    """Events keep coming faster than the timeout, so no wait times out; then they stop,
    and the last wait ends a whole timeout after it began, not at the first timer."""

    async def main() -> tuple[list[object], float]:
        box = Mailbox()
        loop = asyncio.get_running_loop()
        got = []
        for i in range(5):  # 5 waits of 0.1 s, each ended by an event after 0.04 s
            loop.call_later(0.04, box.put_nowait, i)
            got.append(await box.get(0.1))
        started = loop.time()
        got.append(await box.get(0.1))  # nothing comes: the first timer fired long ago
        return got, loop.time() - started

    got, waited = asyncio.run(asyncio.wait_for(main(), 10))
    assert got == [0, 1, 2, 3, 4, None]
    assert waited >= 0.1 - 0.002


def test_a_shorter_timeout_than_the_armed_timer_is_honoured():
    async def main() -> object:
        box = Mailbox()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, box.put_nowait, "x")
        assert await box.get(60) == "x"  # arms a timer a minute out
        return await asyncio.wait_for(box.get(0.05), 5)  # must end at 0.05 s, not 60

    assert asyncio.run(main()) is None


def test_a_cancelled_reader_loses_nothing_and_the_next_wait_works():
    async def main() -> list[object]:
        box = Mailbox()
        reader = asyncio.create_task(box.get(5))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        box.put_nowait("after")
        got = [await box.get(5)]
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, box.put_nowait, "later")
        got.append(await box.get(5))
        box.close()
        return got

    assert asyncio.run(asyncio.wait_for(main(), 10)) == ["after", "later"]
