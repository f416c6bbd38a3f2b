"""The pacer: the rate it is given, even below the rate of the events that poll it."""

from __future__ import annotations

import itertools
from typing import Any, Protocol, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.transport.pacing import Pacer

MSS = 1200


class _Paces(Protocol):
    def next_send_time(self, now: float) -> float | None: ...
    def on_packet_sent(self, size: int, now: float) -> None: ...


def _greedy(pacer: _Paces, start: float, end: float, poll_every: float | None) -> list[float]:
    """A sender that always has data: it sends whenever the pacer allows, woken at the
    pacer's next send time, or (``poll_every``) by events such as ACKs at that period."""
    sent: list[float] = []
    now = start
    while now < end:
        at = pacer.next_send_time(now)
        if at is None:
            pacer.on_packet_sent(MSS, now)
            sent.append(now)
            continue
        now = now + poll_every if poll_every is not None else at
    return sent


def test_paces_at_the_rate_after_the_initial_burst() -> None:
    pacer = Pacer(max_datagram_size=MSS)
    pacer.set_rate(1.2e6, 0.0)  # 1000 packets/s
    sent = _greedy(pacer, 0.0, 2.0, None)
    burst = pacer.burst / MSS
    assert burst == 2  # 1.2 MB/s x 2 ms = 2400 bytes
    assert len(sent) == pytest.approx(2000 + burst, abs=1)
    gaps = [b - a for a, b in itertools.pairwise(sent[3:])]
    assert min(gaps) == pytest.approx(0.001, rel=1e-6)


def test_ack_clocking_does_not_override_the_rate() -> None:
    # events every 0.1 ms (an ACK stream at 12 MB/s), pacing rate a third of that:
    # aioquic's pacer would release a packet per event; this one holds the rate
    pacer = Pacer(max_datagram_size=MSS)
    pacer.set_rate(4e6, 0.0)
    sent = _greedy(pacer, 0.0, 1.0, 0.0001)
    assert len(sent) * MSS == pytest.approx(4e6 + pacer.burst, rel=0.01)


class _AioquicBucket:
    """aioquic 1.7's QuicPacketPacer (quic/recovery.py) line for line, set to a rate."""

    def __init__(self, rate: float) -> None:
        self.packet_time = MSS / rate
        self.bucket_max = max(2 * MSS, 16 * MSS) / rate
        self.bucket_time = 0.0
        self.evaluation_time = 0.0

    def next_send_time(self, now: float) -> float | None:
        self._update_bucket(now)
        return now + self.packet_time if self.bucket_time <= 0 else None

    def on_packet_sent(self, size: int, now: float) -> None:
        self._update_bucket(now)
        if self.bucket_time < self.packet_time:
            self.bucket_time = 0.0  # the debt is forgiven
        else:
            self.bucket_time -= self.packet_time

    def _update_bucket(self, now: float) -> None:
        if now > self.evaluation_time:
            self.bucket_time = min(self.bucket_time + now - self.evaluation_time, self.bucket_max)
            self.evaluation_time = now


def test_aioquic_pacer_follows_the_ack_rate_instead() -> None:
    """Why this module exists: with events every 0.1 ms, aioquic's bucket lets one
    packet go per event, three times the rate it was set to."""
    bucket = _AioquicBucket(4e6)
    sent = _greedy(bucket, 0.0, 1.0, 0.0001)
    assert len(sent) * MSS > 2.5 * 4e6


def test_burst_after_idle_is_bounded() -> None:
    pacer = Pacer(max_datagram_size=MSS)
    pacer.set_rate(100e6 / 8, 0.0)  # 100 Mb/s: 2 ms is 25 kB, above the 16-packet cap
    assert pacer.burst == 16 * MSS
    _greedy(pacer, 0.0, 0.01, None)
    # idle for a second, then everything at once: the 16-packet burst, plus the one
    # packet any sender not in debt may send on credit, no more
    back_to_back = 0
    while pacer.next_send_time(1.0) is None:
        pacer.on_packet_sent(MSS, 1.0)
        back_to_back += 1
    assert back_to_back == 17


def test_rate_is_required_positive() -> None:
    pacer = Pacer(max_datagram_size=MSS)
    assert pacer.next_send_time(0.0) is None  # no rate yet: nothing held back
    with pytest.raises(ValueError, match="positive"):
        pacer.set_rate(0.0, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    changes=st.lists(
        st.tuples(st.floats(0.001, 0.05), st.floats(1e5, 2e7)), min_size=1, max_size=20
    ),
    poll=st.sampled_from([None, 0.0001, 0.001]),
)
def test_never_more_than_rate_times_time_plus_burst(
    changes: list[tuple[float, float]], poll: float | None
) -> None:
    """Over any run, with the rate changing as it goes, bytes sent stay within the
    integral of the rate plus one burst and one packet."""
    pacer = Pacer(max_datagram_size=MSS)
    now, allowance, sent = 0.0, 0.0, 0
    for i, (span, rate) in enumerate(changes):
        pacer.set_rate(rate, now)
        if i == 0:
            allowance = pacer.burst
        sent += len(_greedy(pacer, now, now + span, poll)) * MSS
        allowance += rate * span
        now += span
        assert sent <= allowance + 16 * MSS + MSS


def test_quic_pacer_slot_paces_at_the_controller_rate_below_the_ack_rate() -> None:
    """The pacer installed into aioquic's recovery follows the controller's rate even when
    ACK events arrive far more often than the pacing interval (aioquic's own pacer would
    release a packet at each of them)."""
    from wanswarm.transport.congestion_control import ControllerPacer

    class _Rate:
        pacing_rate = 1_000_000.0  # bytes/s: 1452-byte packets every 1.452 ms

    pacer = ControllerPacer(max_datagram_size=1452, adapter=cast(Any, _Rate()))
    now, sent = 0.0, 0
    for _ in range(10_000):  # an "ACK" (a chance to send) every 0.1 ms for one second
        pacer.update_rate(congestion_window=10**9, smoothed_rtt=0.001)  # must not matter
        if pacer.next_send_time(now) is None:
            pacer.update_after_send(now)
            sent += 1452
        now += 0.0001
    # at most rate * 1 s plus the burst allowance (16 packets) and one packet of debt
    assert sent <= 1_000_000 + 17 * 1452
    assert sent >= 0.95 * 1_000_000
