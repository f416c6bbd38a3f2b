"""How many micro-batches a trainer keeps in flight: an AIMD window, as TCP keeps segments.

``max_in_flight`` micro-batches hide the WAN's latency when the stages have room for them.
When they do not, a fixed number is how a swarm collapses: every server's queue is full,
hops answer ``busy``, micro-batches fail after their attempts with their forward work
wasted, and the trainers start new ones at once, as many as before. So, as TCP does:

- the window starts at 2 and each completed micro-batch adds 1 (slow start: it doubles
  every window) up to the threshold, ``max_in_flight`` at first; past the threshold a
  completed micro-batch adds ``1 / window`` (one micro-batch more per window completed);
  never beyond ``max_in_flight``. A trainer joining a busy swarm does not add
  ``max_in_flight`` micro-batches to it at once;
- a failed micro-batch halves the window (never below 1) and sets the threshold there --
  once per window: failures of micro-batches that started before the last halving belong
  to the same overload and do not halve it again (TCP's fast recovery).

A new micro-batch starts only while fewer than ``floor(window)`` are in flight.
"""

from __future__ import annotations

import asyncio
import math


class InFlightWindow:
    """The AIMD window of one trainer (event loop only)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the window's limit must be at least 1, got {limit}")
        self.limit = limit
        self.size = float(min(2, limit))
        self.threshold = float(limit)
        self.in_flight = 0
        self.halvings = 0
        self._started = 0  # micro-batches started, numbered from 0
        self._recovery = 0  # failures of micro-batches numbered below this do not halve
        self._changed = asyncio.Event()  # set by every release

    async def acquire(self) -> int:
        """Wait for room; returns the micro-batch's number, for ``release``."""
        while self.in_flight >= math.floor(self.size):
            self._changed.clear()
            await self._changed.wait()
        self.in_flight += 1
        number = self._started
        self._started += 1
        return number

    def release(self, number: int, *, ok: bool) -> None:
        """Micro-batch ``number`` completed (``ok``) or failed."""
        self.in_flight -= 1
        if ok:
            step = 1.0 if self.size < self.threshold else 1.0 / self.size
            self.size = min(float(self.limit), self.size + step)
        elif number >= self._recovery:
            self.size = self.threshold = max(1.0, self.size / 2.0)
            self._recovery = self._started
            self.halvings += 1
        self._changed.set()

    def cancel(self) -> None:
        """The slot the last ``acquire`` took was not used (nothing started)."""
        self.in_flight -= 1
        self._started -= 1
        self._changed.set()

    def status(self) -> dict[str, float | int]:
        return {"size": round(self.size, 2), "limit": self.limit, "halvings": self.halvings}
