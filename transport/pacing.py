"""Packet pacing at a given rate, without I/O: a token bucket that keeps its debts.

Why not aioquic's ``QuicPacketPacer``: it lets a packet go whenever its bucket holds any
credit at all, and zeroes the bucket after a send that it could not pay for in full.
Every event that lets time pass (each ACK) thus releases a packet, so a sender that
receives ACKs faster than its pacing interval sends at the ACK rate, whatever the
rate it was given. A rate-based controller needs the rate it asks for, below the ACK
rate too: DRAIN (a third of the bandwidth) and PROBE_BW's 0.75 phase exist to send less
than what is being delivered.

This bucket carries its deficit: a packet sent on partial credit is paid for by the
next packets' wait, so over any interval the bytes sent are at most
``rate * interval + burst``. ``burst`` lets a few packets go back to back, which an event
loop with a 1 ms timer needs to keep up above about ten packets per millisecond.
"""

from __future__ import annotations

import math

__all__ = ["Pacer"]

# Debt this small is rounding error: at the time next_send_time computed, the refill
# may leave -1e-12 bytes owing, which would reschedule the send for the same instant.
_EPSILON_BYTES = 1e-3


class Pacer:
    """Token bucket in bytes: fills at ``rate`` (bytes/s) up to ``burst`` bytes.

    A packet may go when the bucket is not in debt; it then costs its size (the
    bucket may go below zero, down to minus one packet). ``next_send_time`` says when
    the debt is paid. So after an idle period ``burst`` bytes plus one packet go back
    to back, and then one packet per ``size / rate``. With no rate set, nothing is
    held back.
    """

    def __init__(
        self, *, max_datagram_size: int, burst_time_s: float = 0.002, max_burst_packets: int = 16
    ) -> None:
        self._mss = max_datagram_size
        self._burst_time_s = burst_time_s
        self._max_burst_packets = max_burst_packets
        self._max_burst = max_burst_packets * max_datagram_size
        self._min_burst = 2 * max_datagram_size
        self._rate = math.inf
        self._burst = float(self._max_burst)
        self._tokens = float(self._max_burst)
        self._updated = 0.0

    @property
    def rate(self) -> float:
        """Pacing rate, bytes per second (inf: not pacing)."""
        return self._rate

    @property
    def burst(self) -> float:
        """Bytes that may go back to back after an idle period."""
        return self._burst

    def set_max_datagram_size(self, size: int) -> None:
        """Packets of up to ``size`` bytes from now on: the burst bounds scale with it."""
        self._mss = size
        self._max_burst = self._max_burst_packets * size
        self._min_burst = 2 * size
        self._burst = min(max(self._burst, self._min_burst), self._max_burst)

    def set_rate(self, rate: float, now: float) -> None:
        """Pace at ``rate`` bytes per second from ``now`` on (credit earned so far at
        the old rate is kept, up to the new burst)."""
        if not rate > 0.0:
            raise ValueError("pacing rate must be positive")
        self._refill(now)
        self._rate = rate
        self._burst = min(max(rate * self._burst_time_s, self._min_burst), self._max_burst)
        self._tokens = min(self._tokens, self._burst)

    def next_send_time(self, now: float) -> float | None:
        """None when a packet may go at ``now``; otherwise when one may."""
        self._refill(now)
        if self._tokens >= -_EPSILON_BYTES or math.isinf(self._rate):
            return None
        return now + -self._tokens / self._rate

    def on_packet_sent(self, size: int, now: float) -> None:
        """A packet of ``size`` bytes went out at ``now``."""
        self._refill(now)
        self._tokens = max(self._tokens - size, -float(self._mss))

    def _refill(self, now: float) -> None:
        if now > self._updated:
            if math.isfinite(self._rate):
                self._tokens = min(self._tokens + (now - self._updated) * self._rate, self._burst)
            else:
                self._tokens = self._burst
            self._updated = now
