"""Bounded waits on conditions that no event announces, with a failure message naming them.

Prefer an event (``threading.Event``, ``asyncio.Event``, a future, a socket with a timeout):
these helpers are for state that can only be observed — another process's status over its
control socket, a library's view of its peers — and they fail with what was awaited instead
of hanging or running on past it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2,
             explain: Callable[[], str] = lambda: "") -> T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes
    (AssertionError naming ``what``, followed by ``explain()``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{explain()}")
        time.sleep(interval)



async def async_wait_for(predicate: Callable[[], T | None], timeout: float, what: str,
                         interval: float = 0.02) -> T:
    """:func:`wait_for` for coroutines: polls on the running loop without blocking it."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
