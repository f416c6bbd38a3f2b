"""aioquic's congestion-control callbacks, mapped onto our controller and metered.

aioquic's loss recovery drives a congestion controller through a small callback
interface (``aioquic.quic.congestion.base.QuicCongestionControl``): packets sent, acked,
lost or expired, RTT samples, persistent congestion, and it reads ``congestion_window``
and ``bytes_in_flight``. The classes here implement that interface structurally, so this
module does not import aioquic (congestion_control.py registers them with it):

- :class:`ControllerAdapter` drives the sans-I/O :class:`~.congestion.CongestionController`,
  naming each packet ``(epoch, packet_number)``; the controller's ``pacing_rate`` is
  what congestion_control.py's pacer follows;
- :class:`Meter` wraps whichever controller runs (any entry of congestion_control.py's
  registry) and counts packets sent and lost and the delivery rate, for PathStats.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any, Protocol

from .config import CongestionConfig
from .congestion import CongestionController


class SentPacket(Protocol):
    """The fields of aioquic's ``QuicSentPacket`` that congestion control reads."""

    @property
    def epoch(self) -> Any: ...
    @property
    def packet_number(self) -> int: ...
    @property
    def sent_bytes(self) -> int: ...
    @property
    def sent_time(self) -> float | None: ...


class CongestionControl(Protocol):
    """aioquic's congestion-control interface, as its loss recovery uses it."""

    @property
    def congestion_window(self) -> int: ...
    @property
    def bytes_in_flight(self) -> int: ...

    def on_packet_acked(self, *, now: float, packet: Any) -> None: ...
    def on_packet_sent(self, *, packet: Any) -> None: ...
    def on_packets_expired(self, *, packets: Iterable[Any]) -> None: ...
    def on_packets_lost(self, *, now: float, packets: Iterable[Any]) -> None: ...
    def on_persistent_congestion(self) -> None: ...
    def on_rtt_measurement(self, *, now: float, rtt: float) -> None: ...
    def get_log_data(self) -> dict[str, Any]: ...


class ControllerAdapter:
    """:class:`CongestionController` behind aioquic's callbacks."""

    ssthresh: int | None = None  # read by aioquic's qlog only

    def __init__(
        self, config: CongestionConfig, *, max_datagram_size: int, rng: random.Random
    ) -> None:
        self.controller = CongestionController(
            config, max_datagram_size=max_datagram_size, rng=rng
        )
        self._now = 0.0  # aioquic's on_persistent_congestion() carries no time

    @property
    def congestion_window(self) -> int:
        return self.controller.congestion_window

    @property
    def bytes_in_flight(self) -> int:
        return self.controller.bytes_in_flight

    @property
    def pacing_rate(self) -> float:
        """Bytes per second."""
        return self.controller.pacing_rate

    def on_packet_sent(self, *, packet: SentPacket) -> None:
        now = packet.sent_time if packet.sent_time is not None else self._now
        self._now = max(self._now, now)
        self.controller.on_packet_sent(_key(packet), packet.sent_bytes, now)

    def on_packet_acked(self, *, now: float, packet: SentPacket) -> None:
        self._now = now
        self.controller.on_packet_acked(_key(packet), now)

    def on_packets_lost(self, *, now: float, packets: Iterable[SentPacket]) -> None:
        self._now = now
        self.controller.on_packets_lost([_key(p) for p in packets], now)

    def on_packets_expired(self, *, packets: Iterable[SentPacket]) -> None:
        self.controller.on_packets_expired([_key(p) for p in packets])

    def on_persistent_congestion(self) -> None:
        self.controller.on_persistent_congestion(self._now)

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        self._now = now
        self.controller.on_rtt_measurement(rtt, now)

    def get_log_data(self) -> dict[str, Any]:
        return dict(self.controller.log_data())


def _key(packet: SentPacket) -> tuple[Any, int]:
    return (packet.epoch, packet.packet_number)


class Meter:
    """Delegates to ``inner``; counts sends and losses and measures the delivery rate.

    Delivery rate: bytes acknowledged over sampling intervals of at least 50 ms and two
    RTTs, smoothed by an EWMA (weight 1/4); an interval that spans an idle gap (no ACK
    for longer than an interval) is dropped rather than averaged in.
    """

    def __init__(self, inner: CongestionControl) -> None:
        self.inner = inner
        self.packets_sent = 0
        self.packets_lost = 0
        self.delivery_rate_bps = 0.0
        self._rtt = 0.0
        self._interval_start: float | None = None
        self._interval_bytes = 0
        self._last_ack = 0.0

    @property
    def congestion_window(self) -> int:
        return self.inner.congestion_window

    @property
    def bytes_in_flight(self) -> int:
        return self.inner.bytes_in_flight

    @property
    def ssthresh(self) -> int | None:
        value = getattr(self.inner, "ssthresh", None)
        return value if isinstance(value, int) else None

    def on_packet_acked(self, *, now: float, packet: SentPacket) -> None:
        self.inner.on_packet_acked(now=now, packet=packet)
        interval = max(0.05, 2 * self._rtt)
        if self._interval_start is None or now - self._last_ack > interval:
            self._interval_start, self._interval_bytes = now, 0
        self._last_ack = now
        self._interval_bytes += packet.sent_bytes
        elapsed = now - self._interval_start
        if elapsed >= interval:
            sample = 8 * self._interval_bytes / elapsed
            old = self.delivery_rate_bps
            self.delivery_rate_bps = sample if old == 0 else 0.75 * old + 0.25 * sample
            self._interval_start, self._interval_bytes = now, 0

    def on_packet_sent(self, *, packet: SentPacket) -> None:
        self.inner.on_packet_sent(packet=packet)
        self.packets_sent += 1

    def on_packets_expired(self, *, packets: Iterable[SentPacket]) -> None:
        self.inner.on_packets_expired(packets=packets)

    def on_packets_lost(self, *, now: float, packets: Iterable[SentPacket]) -> None:
        packets = list(packets)
        self.packets_lost += len(packets)
        self.inner.on_packets_lost(now=now, packets=packets)

    def on_persistent_congestion(self) -> None:
        self.inner.on_persistent_congestion()

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        self._rtt = rtt
        self.inner.on_rtt_measurement(now=now, rtt=rtt)

    def get_log_data(self) -> dict[str, Any]:
        return self.inner.get_log_data()


__all__ = ["CongestionControl", "ControllerAdapter", "Meter", "SentPacket"]
