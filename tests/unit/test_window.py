"""The trainer's in-flight window: slow start, AIMD, one halving per window of failures."""

from __future__ import annotations

import asyncio

import pytest
from wanswarm.node.training.window import InFlightWindow


def test_slow_start_then_failures_halve_once_per_window_then_linear_growth() -> None:
    async def main() -> None:
        window = InFlightWindow(8)
        assert window.size == 2.0  # slow start: not max_in_flight at once
        first = [await window.acquire() for _ in range(2)]
        blocked = asyncio.create_task(window.acquire())
        await asyncio.sleep(0)
        assert not blocked.done()  # 2 in flight: no room
        for n in first:
            window.release(n, ok=True)  # +1 each below the threshold
        assert window.size == 4.0
        async with asyncio.timeout(5):
            numbers = [await blocked] + [await window.acquire() for _ in range(3)]
        for n in numbers:
            window.release(n, ok=True)
        assert window.size == 8.0  # doubled per window, up to max_in_flight
        numbers = [await window.acquire() for _ in range(8)]
        assert numbers == list(range(6, 14)) and window.in_flight == 8
        blocked = asyncio.create_task(window.acquire())
        await asyncio.sleep(0)
        assert not blocked.done()
        window.release(6, ok=False)  # an overload: halve, and the threshold with it
        assert window.size == 4.0 and window.threshold == 4.0 and window.halvings == 1
        for n in range(7, 11):  # failures of micro-batches started before it: the same overload
            window.release(n, ok=False)
        assert window.size == 4.0 and window.halvings == 1 and window.in_flight == 3
        async with asyncio.timeout(5):
            assert await blocked == 14  # room under floor(4)
        window.release(14, ok=False)  # started after the halving: a new overload
        assert window.size == 2.0 and window.halvings == 2
        for n in (11, 12, 13):
            window.release(n, ok=True)  # at the threshold: +1/size each
        assert window.size == pytest.approx(2 + 1 / 2 + 1 / 2.5 + 1 / 2.9)
        assert window.in_flight == 0
        for _ in range(200):
            window.release(await window.acquire(), ok=True)
        assert window.size == 8.0  # never above the limit

    asyncio.run(main())


def test_the_window_never_closes_and_an_unused_slot_is_given_back() -> None:
    async def main() -> None:
        window = InFlightWindow(2)
        for _ in range(5):
            window.release(await window.acquire(), ok=False)
        assert window.size == 1.0  # one micro-batch at a time, never none
        number = await window.acquire()
        window.cancel()
        assert window.in_flight == 0
        async with asyncio.timeout(5):
            assert await window.acquire() == number

    asyncio.run(main())


def test_the_limit_is_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        InFlightWindow(0)
