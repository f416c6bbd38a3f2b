"""Round-trip-time estimation for one peer: smoothed RTT, variation, windowed minimum.

Pure: every method takes ``now`` (seconds, any monotonic clock) and nothing here sleeps or
reads a clock. The smoothed RTT and its variation follow RFC 6298 §2 (alpha = 1/8,
beta = 1/4, RTO = SRTT + max(G, 4·RTTVAR), first RTO 1 s); the minimum over a sliding window
is the propagation-delay estimate and uses Kathleen Nichols' three-sample windowed filter as
in Linux's lib/win_minmax.c (constant memory, so QUIC may feed it every ACK's sample).

Sources of samples: the prober's periodic pings today; the QUIC endpoint's own estimator
(aioquic's ``rtt_smoothed``/``rtt_min`` per connection) when the transport lands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALPHA = 1 / 8  # RFC 6298 §2.3
BETA = 1 / 4
K = 4
INITIAL_RTO = 1.0  # RFC 6298 §2.1


@dataclass(frozen=True)
class _Sample:
    t: float
    v: float


@dataclass
class WindowedMin:
    """Minimum of the samples of the last ``window`` seconds, approximated with three samples.

    Linux lib/win_minmax.c (Nichols): ``s[0]`` is the best (smallest) sample in the window,
    ``s[1]`` and ``s[2]`` the best of later sub-windows, ready to take over when ``s[0]`` ages
    out. Exact whenever the minimum of the window is the newest sample or still ``s[0]``.
    """

    window: float
    _s: list[_Sample] = field(default_factory=list)

    def update(self, value: float, now: float) -> float:
        """Add a sample taken at ``now``; returns the current windowed minimum."""
        sample = _Sample(now, value)
        s = self._s
        if not s or value <= s[0].v or now - s[2].t > self.window:
            self._s = [sample, sample, sample]  # new minimum, or nothing left in the window
            return value
        if value <= s[1].v:
            s[1] = s[2] = sample
        elif value <= s[2].v:
            s[2] = sample
        return self._subwindow_update(sample)

    def _subwindow_update(self, sample: _Sample) -> float:
        s = self._s
        dt = sample.t - s[0].t
        if dt > self.window:
            # the best sample aged out: promote the sub-window choices (maybe twice)
            s[0], s[1], s[2] = s[1], s[2], sample
            if sample.t - s[0].t > self.window:
                s[0], s[1], s[2] = s[1], s[2], sample
        elif s[1].t == s[0].t and dt > self.window / 4:
            # a quarter window without a new minimum: take a second choice from it
            s[1] = s[2] = sample
        elif s[2].t == s[1].t and dt > self.window / 2:
            s[2] = sample
        return s[0].v

    def get(self, now: float) -> float | None:
        """The minimum of the samples still inside the window at ``now``; None if none is."""
        for sample in self._s:
            if now - sample.t <= self.window:
                return sample.v
        return None


@dataclass
class RttEstimator:
    """RFC 6298 smoothed RTT and variation, windowed minimum, and a failure count."""

    min_window: float = 120.0
    srtt: float | None = None
    rttvar: float | None = None
    latest: float | None = None
    samples: int = 0
    consecutive_failures: int = 0
    last_sample_at: float | None = None
    _min: WindowedMin = field(init=False)

    def __post_init__(self) -> None:
        if not self.min_window > 0:
            raise ValueError(f"min_window must be positive (got {self.min_window})")
        self._min = WindowedMin(self.min_window)

    def on_sample(self, rtt: float, now: float) -> None:
        """Fold in one measured round trip of ``rtt`` seconds, taken at ``now``."""
        if not (math.isfinite(rtt) and rtt >= 0):
            raise ValueError(f"an RTT sample must be a finite non-negative number (got {rtt})")
        if self.srtt is None or self.rttvar is None:
            self.srtt, self.rttvar = rtt, rtt / 2  # RFC 6298 (2.2)
        else:
            self.rttvar = (1 - BETA) * self.rttvar + BETA * abs(self.srtt - rtt)  # (2.3)
            self.srtt = (1 - ALPHA) * self.srtt + ALPHA * rtt
        self.latest = rtt
        self.samples += 1
        self.consecutive_failures = 0
        self.last_sample_at = now
        self._min.update(rtt, now)

    def on_failure(self) -> None:
        """A probe that got no answer in time."""
        self.consecutive_failures += 1

    def min_rtt(self, now: float) -> float | None:
        """The smallest sample of the last ``min_window`` seconds (propagation estimate)."""
        return self._min.get(now)

    def rto(self, granularity: float = 0.001, lower: float = 0.2, upper: float = 60.0) -> float:
        """Retransmission-style timeout, RFC 6298 (2.1)-(2.5), clamped to [lower, upper]."""
        if self.srtt is None or self.rttvar is None:
            return max(lower, min(upper, INITIAL_RTO))
        return max(lower, min(upper, self.srtt + max(granularity, K * self.rttvar)))
