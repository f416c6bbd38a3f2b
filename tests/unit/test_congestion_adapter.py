"""aioquic's congestion callbacks onto our controller, the meter, and the pacer."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from pydantic import ValidationError
from wanswarm.transport.config import CongestionConfig
from wanswarm.transport.congestion_adapter import ControllerAdapter, Meter
from wanswarm.transport.congestion_control import (
    CONTROLLERS,
    ControllerPacer,
    aioquic_algorithm,
    known_controller,
)

MSS = 1452


@dataclass
class Packet:
    """The fields of aioquic's QuicSentPacket the callbacks read."""

    packet_number: int
    sent_time: float
    sent_bytes: int = MSS
    epoch: int = 3


def _adapter() -> ControllerAdapter:
    return ControllerAdapter(CongestionConfig(), max_datagram_size=MSS, rng=random.Random(1))


def test_adapter_tracks_bytes_in_flight_by_packet() -> None:
    cc = _adapter()
    packets = [Packet(n, 0.001 * n) for n in range(8)]
    for p in packets:
        cc.on_packet_sent(packet=p)
    assert cc.bytes_in_flight == 8 * MSS
    cc.on_rtt_measurement(now=0.021, rtt=0.020)
    cc.on_packet_acked(now=0.021, packet=packets[0])
    cc.on_packets_lost(now=0.022, packets=packets[1:3])
    cc.on_packets_expired(packets=packets[3:4])
    assert cc.bytes_in_flight == 4 * MSS
    cc.on_packet_acked(now=0.023, packet=packets[0])  # a duplicate ACK changes nothing
    assert cc.bytes_in_flight == 4 * MSS
    # the same packet number in another epoch is another packet
    cc.on_packet_sent(packet=Packet(4, 0.03, epoch=2))
    assert cc.bytes_in_flight == 5 * MSS


def test_adapter_paces_from_the_delivery_rate() -> None:
    """1 packet per ms delivered with a 20 ms RTT: about 1.45 MB/s once measured."""
    cc = _adapter()
    initial = cc.congestion_window
    for n in range(400):
        cc.on_packet_sent(packet=Packet(n, 0.001 * n))
        if n >= 20:
            now = 0.001 * n + 0.0005
            cc.on_rtt_measurement(now=now, rtt=0.0205)
            cc.on_packet_acked(now=now, packet=Packet(n - 20, 0.001 * (n - 20)))
    assert 0.7 * MSS / 0.001 < cc.controller.btl_bw < 1.5 * MSS / 0.001
    assert cc.pacing_rate > 0.5 * cc.controller.btl_bw
    assert cc.congestion_window >= initial // 2
    cc.on_persistent_congestion()  # carries no time: the adapter supplies the last one
    assert cc.controller.btl_bw == 0.0


def test_meter_counts_and_measures_delivery_rate() -> None:
    inner = _adapter()
    meter = Meter(inner)
    for n in range(200):
        meter.on_packet_sent(packet=Packet(n, 0.001 * n))
    assert meter.packets_sent == 200 and meter.bytes_in_flight == 200 * MSS
    meter.on_rtt_measurement(now=0.02, rtt=0.02)
    for n in range(190):  # one packet acknowledged per ms
        meter.on_packet_acked(now=0.02 + 0.001 * n, packet=Packet(n, 0.001 * n))
    meter.on_packets_lost(now=0.3, packets=[Packet(n, 0.001 * n) for n in range(190, 200)])
    assert meter.packets_lost == 10 and meter.bytes_in_flight == 0
    assert meter.delivery_rate_bps == pytest.approx(8 * MSS / 0.001, rel=0.1)
    assert meter.congestion_window == inner.congestion_window
    assert meter.get_log_data()["bytes_in_flight"] == 0


def test_meter_drops_intervals_across_idle_gaps() -> None:
    meter = Meter(_adapter())
    meter.on_rtt_measurement(now=0.01, rtt=0.01)
    for n in range(100):
        meter.on_packet_sent(packet=Packet(n, 0.0))
    for n in range(60):
        meter.on_packet_acked(now=0.01 + 0.001 * n, packet=Packet(n, 0.0))
    before = meter.delivery_rate_bps
    for n in range(60, 100):  # after 10 s of silence: a fresh interval, not 10 s long
        meter.on_packet_acked(now=10.0 + 0.001 * (n - 60), packet=Packet(n, 0.0))
    assert meter.delivery_rate_bps == pytest.approx(before, rel=0.2)


class _Rate:
    pacing_rate = 1e6  # bytes/s


def test_pacer_follows_the_controller_rate() -> None:
    pacer = ControllerPacer(max_datagram_size=MSS, adapter=_Rate())
    pacer.update_rate(congestion_window=10 * MSS, smoothed_rtt=0.05)  # ignored: rate is ours
    now = 0.0
    while pacer.next_send_time(now) is None:  # spend the burst allowance
        pacer.update_after_send(now)
    # then one packet per MSS / rate
    assert pacer.next_send_time(now) == pytest.approx(now + MSS / 1e6, rel=1e-3, abs=1e-9)
    # without a rate from the controller yet, nothing is held back
    rate = _Rate()
    rate.pacing_rate = 0.0
    idle = ControllerPacer(max_datagram_size=MSS, adapter=rate)
    for _ in range(100):
        assert idle.next_send_time(0.0) is None
        idle.update_after_send(0.0)


def test_algorithms_are_registered_per_setting() -> None:
    reno = aioquic_algorithm(CongestionConfig(algorithm="reno"))
    # aioquic's controllers read none of the settings: one registration serves them all
    assert reno == aioquic_algorithm(CongestionConfig(algorithm="reno", initial_window_packets=20))
    default = aioquic_algorithm(CongestionConfig())
    other = aioquic_algorithm(CongestionConfig(initial_window_packets=20))
    assert default != other and default == aioquic_algorithm(CongestionConfig())


def test_every_registered_controller_runs_metered_in_aioquic() -> None:
    from aioquic.quic.congestion.base import create_congestion_control

    for name in CONTROLLERS:
        cc = create_congestion_control(
            aioquic_algorithm(CongestionConfig(algorithm=name)), max_datagram_size=MSS
        )
        assert isinstance(cc, Meter), name
        cc.on_packet_sent(packet=Packet(0, 0.0))
        assert cc.packets_sent == 1 and cc.bytes_in_flight == MSS, name
        assert cc.congestion_window >= 2 * MSS, name
    ours = create_congestion_control(aioquic_algorithm(CongestionConfig()), max_datagram_size=MSS)
    assert isinstance(ours, Meter) and isinstance(ours.inner, ControllerAdapter)


def test_the_config_accepts_only_registered_controllers() -> None:
    for name in CONTROLLERS:
        assert CongestionConfig(algorithm=name).algorithm == name
        assert known_controller(name) is CONTROLLERS[name]
    with pytest.raises(ValidationError, match="unknown congestion controller 'vegas': use one "
                       "of 'wanswarm', 'reno', 'cubic'"):
        CongestionConfig(algorithm="vegas")
    with pytest.raises(Exception, match="unknown congestion controller 'vegas'"):
        # a config built without validation is still refused where aioquic would see it
        aioquic_algorithm(CongestionConfig.model_construct(algorithm="vegas"))
