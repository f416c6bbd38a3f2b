"""The node's memory budget for inbound transfers (pure accounting, no I/O).

A peer commits our memory by announcing payloads: a message header names every tensor's
size, and receiving it means holding that many bytes (an FEC receiver allocates its
buffer up front). Every announced payload is therefore reserved here when its header
arrives, before anything is allocated, and released when its exchange ends (complete,
refused, reset or timed out). Three bounds apply, checked in this order:

- per request kind: a kind declares the most payload bytes its requests may carry
  (``Endpoint.register(max_bytes=...)``); kinds that take no tensors carry none;
- per connection: ``limits.max_inflight_bytes``;
- per node: ``limits.max_inbound_bytes``, shared by every connection.

A message beyond the kind's limit is refused as ``too_large``; one that does not fit the
connection's or the node's budget is answered ``busy`` (the sender may retry later or
elsewhere). Either way the rest of the stream is refused (STOP_SENDING), so nothing
beyond the header is read.
"""

from __future__ import annotations

from collections import Counter

from .errors import FramingError

__all__ = ["InboundBudget"]


class InboundBudget:
    """Bytes reserved against a fixed limit; ``reserve`` refuses what does not fit."""

    def __init__(self, limit: int, what: str = "max_inbound_bytes") -> None:
        if limit < 0:
            raise ValueError(f"a budget must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.what = what
        self.used = 0
        self.peak = 0
        self.counts: Counter[str] = Counter()

    @property
    def free(self) -> int:
        return self.limit - self.used

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` against the budget; FramingError with code ``busy`` (nothing
        reserved) if they do not fit."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if self.used + nbytes > self.limit:
            self.counts["refused"] += 1
            raise FramingError(
                f"{self.used} inbound payload bytes already reserved, {nbytes} more exceed "
                f"{self.what}={self.limit}",
                code="busy",
            )
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.counts["reserved"] += 1

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` took (never below zero)."""
        self.used = max(0, self.used - nbytes)
