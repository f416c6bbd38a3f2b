"""Token buckets: how fast a peer may ask for something, or a relay channel may carry bytes.

Pure: every call takes ``now`` (seconds on any monotonic clock), so tests drive time by hand.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["KeyedBuckets", "TokenBucket"]


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` held; starts full."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self._tokens

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` tokens if the bucket holds them; False (nothing taken) if not."""
        self._refill(now)
        if amount > self._tokens:
            return False
        self._tokens -= amount
        return True

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now


class KeyedBuckets:
    """One :class:`TokenBucket` per key (a peer id), at most ``max_keys`` of them: the
    least recently used is forgotten first, so a flood of new keys costs bounded memory
    (a forgotten key starts again with a full bucket)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 1024) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str, now: float, amount: float = 1.0) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(amount, now)

    def __len__(self) -> int:
        return len(self._buckets)
