"""The node's upload bandwidth limit: a token bucket in front of the UDP socket.

``transport.upload_limit_mbps`` caps what the QUIC port sends, every connection, relayed
packet and punch together (UDP payload bytes; IP and UDP headers are not counted). The
socket's ``sendto`` hands each datagram to :class:`UploadLimiter`: sent at once while the
bucket holds enough tokens and nothing waits, else queued in order and sent when the tokens
have accrued. The queue holds at most ``MAX_QUEUE_S`` of sending at the limit; a datagram
beyond it is dropped, which QUIC (and FEC) see as loss. The wait it adds shows up as RTT, so
the congestion controller (congestion.py: a standing queue lowers the rate) settles at the
limit instead of filling the queue.

:class:`TokenBucket` is the pure core (``now`` is an argument); the limiter only pumps it
with the event loop's timer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Final

# the bucket's depth: this long at the limit, and never less than a few datagrams
BURST_S: Final = 0.05
MIN_BURST_BYTES: Final = 4 * 1500
# at most this long of sending at the limit waits in the queue; later datagrams are dropped
MAX_QUEUE_S: Final = 0.2
# the shortest timer the limiter sets (a shorter one would only spin the event loop)
MIN_WAIT_S: Final = 1e-4


class TokenBucket:
    """Bytes that may be sent: ``rate`` per second, at most ``burst`` saved up."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float, now: float) -> None:
        if rate_bytes_per_s <= 0 or burst_bytes <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes
        self.tokens = burst_bytes
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
            self._at = now

    def wait(self, nbytes: int, now: float) -> float:
        """Seconds until ``nbytes`` may go (0.0: now)."""
        self._refill(now)
        short = nbytes - self.tokens
        # within a millibyte is enough: refills in float arithmetic land a hair below
        return 0.0 if short <= 1e-3 else max(MIN_WAIT_S, short / self.rate)

    def take(self, nbytes: int, now: float) -> None:
        """Spend ``nbytes`` (may go below zero by a datagram that is larger than the burst)."""
        self._refill(now)
        self.tokens -= nbytes


class UploadLimiter:
    """Paces datagrams to ``send`` at ``rate_bps`` bits per second (see the module docstring)."""

    def __init__(
        self,
        rate_bps: float,
        send: Callable[[bytes, Any], None],
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        rate = rate_bps / 8.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock = clock
        self.bucket = TokenBucket(rate, max(MIN_BURST_BYTES, rate * BURST_S), self._now())
        self.max_queue_bytes = max(MIN_BURST_BYTES, int(rate * MAX_QUEUE_S))
        self._send = send
        self._queue: deque[tuple[bytes, Any]] = deque()
        self.queued_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self.sent_bytes = 0
        self.dropped = 0
        self.delayed = 0

    @classmethod
    def from_mbps(
        cls, mbps: float | None, send: Callable[[bytes, Any], None]
    ) -> UploadLimiter | None:
        """The limiter for ``transport.upload_limit_mbps`` (None: no limit)."""
        return None if mbps is None else cls(mbps * 1e6, send)

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def sendto(self, data: bytes, addr: Any) -> None:
        """Send ``data`` now if the limit allows and nothing waits; else queue (or drop)."""
        now = self._now()
        if not self._queue and self.bucket.wait(len(data), now) == 0.0:
            self.bucket.take(len(data), now)
            self.sent_bytes += len(data)
            self._send(data, addr)
            return
        if self.queued_bytes + len(data) > self.max_queue_bytes:
            self.dropped += 1
            return
        self._queue.append((data, addr))
        self.queued_bytes += len(data)
        self.delayed += 1
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        if self._timer is not None or not self._queue:
            return
        delay = self.bucket.wait(len(self._queue[0][0]), now)
        loop = self._loop if self._loop is not None else asyncio.get_running_loop()
        self._timer = loop.call_later(delay, self._drain)

    def _drain(self) -> None:
        self._timer = None
        now = self._now()
        while self._queue and self.bucket.wait(len(self._queue[0][0]), now) == 0.0:
            data, addr = self._queue.popleft()
            self.queued_bytes -= len(data)
            self.bucket.take(len(data), now)
            self.sent_bytes += len(data)
            self._send(data, addr)
        self._schedule(now)

    def close(self) -> None:
        """Drop what waits (the socket is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()
        self.queued_bytes = 0

    def status(self) -> dict[str, float]:
        return {
            "limit_mbps": round(self.bucket.rate * 8 / 1e6, 3),
            "sent_bytes": self.sent_bytes,
            "queued_bytes": self.queued_bytes,
            "delayed": self.delayed,
            "dropped": self.dropped,
        }


__all__ = ["TokenBucket", "UploadLimiter"]
