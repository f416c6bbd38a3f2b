"""The congestion controllers a connection can run, by name, and how aioquic runs them.

``[transport.congestion] algorithm`` names one entry of :data:`CONTROLLERS`
(:class:`~.config.CongestionConfig` rejects any other name); adding a controller is adding
an entry. An entry builds one connection's controller from the congestion settings and the
packet size, and says whether it reads those settings: ours (congestion.py, behind
congestion_adapter.py's callbacks) does, aioquic's Reno and CUBIC read none.

aioquic picks a connection's controller by a name in its global table
(``register_congestion_control``). :func:`aioquic_algorithm` registers there, once per
distinct settings, a factory that wraps the chosen controller in a
:class:`~.congestion_adapter.Meter` (packets sent and lost, delivery rate, for the link's
stats), and returns the name for ``QuicConfiguration.congestion_control_algorithm``.

Pacing. aioquic's pacer paces at cwnd/srtt and never below the ACK rate (see pacing.py).
:func:`install_pacer` puts :class:`ControllerPacer` in its place on a connection whose
controller sets a pacing rate, as ours does. aioquic has no public hook for that: this
module reads the connection's loss recovery's ``_cc`` and replaces its ``_pacer``, which
tests/unit/test_aioquic_internals.py checks are still there.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, cast, runtime_checkable

from aioquic.quic.congestion.base import QuicCongestionControl, register_congestion_control
from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketPacer

from .config import CongestionConfig
from .congestion_adapter import CongestionControl, ControllerAdapter, Meter
from .errors import ConfigError
from .pacing import Pacer

__all__ = [
    "CONTROLLERS",
    "Controller",
    "ControllerPacer",
    "aioquic_algorithm",
    "install_pacer",
    "known_controller",
]


@dataclass(frozen=True)
class Controller:
    """One congestion controller that a connection can run."""

    summary: str
    build: Callable[[CongestionConfig, int], CongestionControl]
    """One connection's controller, from the settings and aioquic's ``max_datagram_size``."""
    reads_settings: bool
    """Whether ``build`` reads :class:`~.config.CongestionConfig`'s tuning fields. If so,
    each distinct setting is its own aioquic registration; if not, one serves them all."""


def _new_rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "big"))


def _ours(config: CongestionConfig, max_datagram_size: int) -> CongestionControl:
    return ControllerAdapter(config, max_datagram_size=max_datagram_size, rng=_new_rng())


def _reno(config: CongestionConfig, max_datagram_size: int) -> CongestionControl:
    return RenoCongestionControl(max_datagram_size=max_datagram_size)


def _cubic(config: CongestionConfig, max_datagram_size: int) -> CongestionControl:
    return CubicCongestionControl(max_datagram_size=max_datagram_size)


CONTROLLERS: Mapping[str, Controller] = MappingProxyType(
    {
        "wanswarm": Controller(
            "loss-tolerant, rate-based (transport/congestion.py)", _ours, reads_settings=True
        ),
        "reno": Controller("aioquic's NewReno (RFC 9002 §7)", _reno, reads_settings=False),
        "cubic": Controller("aioquic's CUBIC (RFC 9438)", _cubic, reads_settings=False),
    }
)


def known_controller(name: str) -> Controller:
    """The entry called ``name``; ValueError naming every known controller otherwise."""
    controller = CONTROLLERS.get(name)
    if controller is None:
        known = ", ".join(repr(n) for n in CONTROLLERS)
        raise ValueError(f"unknown congestion controller {name!r}: use one of {known}")
    return controller


_registered: set[str] = set()


def aioquic_algorithm(config: CongestionConfig) -> str:
    """Register with aioquic (once per distinct settings) the metered controller that
    ``config`` selects, and return the name aioquic knows it by."""
    try:
        controller = known_controller(config.algorithm)
    except ValueError as exc:  # only a config built without validation gets here
        raise ConfigError(str(exc)) from None
    name = f"wanswarm-metered-{config.algorithm}"
    if controller.reads_settings:
        name += "-" + hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]
    if name not in _registered:
        build = controller.build

        def factory(*, max_datagram_size: int) -> QuicCongestionControl:
            return cast(QuicCongestionControl, Meter(build(config, max_datagram_size)))

        register_congestion_control(name, factory)
        _registered.add(name)
    return name


@runtime_checkable
class PacingRate(Protocol):
    """A controller that sets its own pacing rate (ours: BBR's gain x bottleneck rate)."""

    @property
    def pacing_rate(self) -> float:
        """Bytes per second; 0 until the controller has one."""
        ...


class ControllerPacer(QuicPacketPacer):
    """aioquic's pacer slot, driven by the controller's pacing rate through our own bucket.

    aioquic's ``QuicPacketPacer`` lets a packet go whenever its bucket holds any credit and
    forgives the debt of a send it could not pay for, so every ACK releases a packet: a flow
    can never be paced below its ACK rate, which breaks DRAIN and PROBE_BW's 0.75 phase
    (see transport/pacing.py). We keep aioquic's call sites (``next_send_time`` before
    building packets, ``update_after_send`` after each) and answer them from
    :class:`~.pacing.Pacer`, reading the controller's rate at every send.
    """

    def __init__(self, *, max_datagram_size: int, adapter: PacingRate) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._adapter = adapter
        self._mss = max_datagram_size
        self._bucket = Pacer(max_datagram_size=max_datagram_size)

    def _follow(self, now: float) -> None:
        rate = self._adapter.pacing_rate
        if rate > 0.0 and math.isfinite(rate) and rate != self._bucket.rate:
            self._bucket.set_rate(rate, now)

    # aioquic annotates float but returns None for "send now", as we do
    def next_send_time(self, now: float) -> float | None:  # type: ignore[override]
        self._follow(now)
        return self._bucket.next_send_time(now)

    def update_after_send(self, now: float) -> None:
        self._bucket.on_packet_sent(self._mss, now)

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        """Ignored: the rate is read from the controller at each send, not from cwnd/srtt."""

    def set_max_datagram_size(self, size: int) -> None:
        """Packets of up to ``size`` bytes from now on (each send is charged this much)."""
        self._mss = size
        self._bucket.set_max_datagram_size(size)


def install_pacer(quic: QuicConnection, max_datagram_size: int) -> None:
    """Pace ``quic`` at its controller's rate if the controller sets one (ours does);
    aioquic's own pacer stays for controllers that do not (Reno, CUBIC)."""
    cc = quic._loss._cc
    if isinstance(cc, Meter) and isinstance(cc.inner, PacingRate):
        quic._loss._pacer = ControllerPacer(max_datagram_size=max_datagram_size, adapter=cc.inner)


def set_max_datagram_size(quic: QuicConnection, size: int) -> bool:
    """Let ``quic`` send datagrams of up to ``size`` bytes from now on (path_mtu.py: a probe
    of that size was acknowledged, or the size in use stopped crossing the path): aioquic's
    packet builder limit, our controller's segment size (its windows in packets) and our
    pacer's. Stream data lost in larger packets is re-sent by aioquic in packets of the
    new size (it retransmits frames, not packets); DATAGRAM frames already queued are the
    caller's (QuicLink.lower_max_udp_payload). Only with our controller (False, and
    nothing changed, with aioquic's Reno or CUBIC, which are for diagnosis). aioquic
    internals, pinned in tests/unit/test_aioquic_internals.py: ``_max_datagram_size``,
    ``_loss._cc``, ``_loss._pacer``."""
    cc = quic._loss._cc
    inner = cc.inner if isinstance(cc, Meter) else None
    pacer = quic._loss._pacer
    if not isinstance(inner, ControllerAdapter) or not isinstance(pacer, ControllerPacer):
        return False
    if size != quic._max_datagram_size:
        quic._max_datagram_size = size
        inner.controller.set_max_datagram_size(size)
        pacer.set_max_datagram_size(size)
    return True


def resend_smaller(quic: QuicConnection, size: int, max_frame_payload: int, now: float) -> None:
    """After ``quic``'s datagrams were limited to ``size`` bytes because larger ones stopped
    crossing the path (path_mtu.py): packets in flight that were larger are taken as lost
    now, and not as congestion (RFC 8899 §3 item 7), so that their frames go again at once
    in packets of the new size; queued DATAGRAM frames whose payload is over
    ``max_frame_payload`` are dropped (aioquic would keep them at the head of its queue
    forever; to their senders they are lost packets). aioquic internals, pinned in
    tests/unit/test_aioquic_internals.py: ``_loss.spaces[].sent_packets``, each packet's
    ``sent_bytes``, ``_loss._on_packets_lost(congestion_event=False)``,
    ``_datagrams_pending``."""
    loss = quic._loss
    for space in loss.spaces:
        too_big = [p for p in space.sent_packets.values() if p.sent_bytes > size]
        if too_big:
            loss._on_packets_lost(now=now, packets=too_big, space=space, congestion_event=False)
    pending = quic._datagrams_pending
    kept = [data for data in pending if len(data) <= max_frame_payload]
    if len(kept) != len(pending):
        pending.clear()
        pending.extend(kept)
