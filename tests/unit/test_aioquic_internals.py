"""The private parts of aioquic that wanswarm.transport relies on are still there.

aioquic has no public API for what the transport needs from it here: asking a client for
its certificate, the TLS key schedule (channel binding), replacing the pacer, the loss
recovery's RTT estimates and congestion controller, the DATAGRAM queue and the peer's
DATAGRAM limit, a stream's unacknowledged bytes, and a connection's closing state. The
transport reads or replaces private attributes for these, and pyproject.toml pins aioquic
to the versions tested. Each check here builds real aioquic objects, a client and a server
connection wired together in memory (no sockets, a fake clock), and names the attribute,
the aioquic version and the module of ours that uses it, so that an aioquic upgrade that
moves one fails here with a clear message rather than deep inside a loopback test.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aioquic
import pytest
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicStreamFrame, pull_quic_header
from aioquic.quic.recovery import QuicPacketPacer
from wanswarm.transport.config import CongestionConfig, TransportConfig
from wanswarm.transport.congestion_adapter import ControllerAdapter, Meter
from wanswarm.transport.congestion_control import (
    ControllerPacer,
    install_pacer,
    resend_smaller,
    set_max_datagram_size,
)
from wanswarm.transport.handshake import ChannelBinding
from wanswarm.transport.identity import Identity
from wanswarm.transport.quic_config import (
    CID_LENGTH,
    ServerConnection,
    build_configuration,
    certificate_peer_id,
    channel_binding,
)

CLIENT_ADDR = ("127.0.0.1", 40001)
SERVER_ADDR = ("127.0.0.1", 40000)
MSS = TransportConfig().max_udp_payload_bytes


def _require(obj: object, path: str, used_by: str) -> Any:
    """``obj.<path>`` (dotted); a test failure naming what is gone and who uses it."""
    value = obj
    for part in path.split("."):
        if not hasattr(value, part):
            pytest.fail(
                f"aioquic {aioquic.__version__}: {type(obj).__name__}.{path} is gone "
                f"({type(value).__name__} has no {part!r}); transport/{used_by} relies on it. "
                "Adapt that module to this aioquic, or keep aioquic below this version in "
                "pyproject.toml."
            )
        value = getattr(value, part)
    return value


def _require_type(
    value: object, expected: type | tuple[type, ...], what: str, used_by: str
) -> None:
    if not isinstance(value, expected):
        pytest.fail(
            f"aioquic {aioquic.__version__}: {what} is a {type(value).__name__}, not "
            f"{expected}; transport/{used_by} relies on its type."
        )


@dataclass
class _Side:
    """One connection and what the pump saw of it, as quic_link.QuicLink keeps it."""

    quic: QuicConnection
    is_client: bool
    binding: ChannelBinding | None = None
    seen: list[events.QuicEvent] = field(default_factory=list)

    def deliver(self, data: bytes, addr: tuple[str, int], now: float) -> None:
        self.quic.receive_datagram(data, addr, now=now)
        while (event := self.quic.next_event()) is not None:
            self.seen.append(event)
            if isinstance(event, events.HandshakeCompleted) and self.binding is None:
                # at the event, as the link does: the key schedule is at the master secret
                self.binding = channel_binding(
                    self.quic, is_client=self.is_client, alpn=event.alpn_protocol or ""
                )


@dataclass
class _Pair:
    client: _Side
    server: _Side
    client_identity: Identity
    server_identity: Identity
    now: float = 0.0

    def exchange(self, rounds: int = 50) -> None:
        """Carry packets both ways (and fire due timers) until neither side has any left."""
        quiet = 0
        for _ in range(rounds):
            self.now += 0.002
            moved = False
            for src, dst, addr in (
                (self.client, self.server, CLIENT_ADDR),
                (self.server, self.client, SERVER_ADDR),
            ):
                timer = src.quic.get_timer()
                if timer is not None and timer <= self.now:
                    src.quic.handle_timer(now=self.now)
                for data, _ in src.quic.datagrams_to_send(now=self.now):
                    dst.deliver(data, addr, self.now)
                    moved = True
            quiet = 0 if moved else quiet + 1
            if quiet >= 3:
                return


def _connected_pair(congestion: str = "wanswarm") -> _Pair:
    """A client and one of our server connections, handshake done, as quic_socket.py
    makes them (the server created on the client's first Initial)."""
    cfg = TransportConfig(congestion=CongestionConfig(algorithm=congestion))
    client_identity, server_identity = Identity.generate(), Identity.generate()
    client = QuicConnection(configuration=build_configuration(client_identity, cfg, is_client=True))
    install_pacer(client, cfg.max_udp_payload_bytes)
    client.connect(SERVER_ADDR, now=0.0)
    first = client.datagrams_to_send(now=0.0)
    header = pull_quic_header(Buffer(data=first[0][0]), host_cid_length=CID_LENGTH)
    server = ServerConnection(
        configuration=build_configuration(server_identity, cfg, is_client=False),
        original_destination_connection_id=header.destination_cid,
    )
    install_pacer(server, cfg.max_udp_payload_bytes)
    pair = _Pair(_Side(client, True), _Side(server, False), client_identity, server_identity)
    for data, _ in first:
        pair.server.deliver(data, CLIENT_ADDR, 0.0)
    pair.exchange()
    for side in (pair.client, pair.server):
        assert any(isinstance(e, events.HandshakeCompleted) for e in side.seen), (
            f"aioquic {aioquic.__version__}: the in-memory handshake did not complete"
        )
    return pair


def test_server_connection_asks_for_the_client_certificate() -> None:
    """quic_config.ServerConnection overrides ``_initialize(peer_cid)`` to set
    ``tls._request_client_certificate``; both must still exist and take effect."""
    params = list(inspect.signature(QuicConnection._initialize).parameters)
    if params != ["self", "peer_cid"]:
        pytest.fail(
            f"aioquic {aioquic.__version__}: QuicConnection._initialize{params[1:]} is not "
            "_initialize(peer_cid), which quic_config.ServerConnection overrides"
        )
    pair = _connected_pair()
    server_tls = _require(pair.server.quic, "tls", "quic_config.py")
    assert _require(server_tls, "_request_client_certificate", "quic_config.py") is True
    # the flag worked: the server holds the client's certificate, the client the server's
    _require(server_tls, "_peer_certificate", "quic_config.py")
    assert certificate_peer_id(pair.server.quic) == pair.client_identity.peer_id
    assert certificate_peer_id(pair.client.quic) == pair.server_identity.peer_id


def test_both_ends_export_the_same_channel_binding() -> None:
    """quic_config.channel_binding reads ``tls.key_schedule`` (generation, algorithm,
    secret, hash) and the initial connection ids; both ends must agree on all of it."""
    pair = _connected_pair()
    for side in (pair.client.quic, pair.server.quic):
        for name in (
            "_local_initial_source_connection_id",
            "_remote_initial_source_connection_id",
            "_original_destination_connection_id",
        ):
            _require_type(_require(side, name, "quic_config.py"), bytes, name, "quic_config.py")
        schedule = _require(side, "tls.key_schedule", "quic_config.py")
        for name in ("generation", "algorithm", "secret", "hash"):
            _require(schedule, name, "quic_config.py")
    client, server = pair.client.binding, pair.server.binding
    assert client is not None and server is not None
    assert client == server, "the two ends derived different channel bindings"
    assert len(client.exporter) == 32 and client.original_dcid and client.client_scid


def test_loss_recovery_runs_our_controller_and_pacer() -> None:
    """congestion_control.py reads ``_loss._cc`` and replaces ``_loss._pacer``; aioquic must
    build ``_cc`` from the registered factory and call the pacer in ``_pacer``'s slot."""
    pair = _connected_pair()
    quic = pair.client.quic
    loss = _require(quic, "_loss", "congestion_control.py")
    cc = _require(loss, "_cc", "congestion_control.py")
    _require_type(cc, Meter, "_loss._cc", "congestion_control.py")
    assert isinstance(cc.inner, ControllerAdapter)
    assert cc.packets_sent > 0, "aioquic no longer reports sent packets to _loss._cc"
    _require_type(_require(loss, "_pacer", "congestion_control.py"), ControllerPacer,
                  "_loss._pacer after install_pacer", "congestion_control.py")

    # aioquic calls the pacer by keyword: our override must keep its parameter names
    for method, expected in (
        ("next_send_time", ["self", "now"]),
        ("update_after_send", ["self", "now"]),
        ("update_rate", ["self", "congestion_window", "smoothed_rtt"]),
    ):
        theirs = list(inspect.signature(getattr(QuicPacketPacer, method)).parameters)
        if theirs != expected:
            pytest.fail(f"aioquic {aioquic.__version__}: QuicPacketPacer.{method}{theirs[1:]} "
                        f"changed; congestion_control.ControllerPacer overrides it as {expected}")

    calls: list[str] = []

    class Recording(ControllerPacer):
        def next_send_time(self, now: float) -> float | None:
            calls.append("next_send_time")
            return super().next_send_time(now)

        def update_after_send(self, now: float) -> None:
            calls.append("update_after_send")
            super().update_after_send(now)

    loss._pacer = Recording(max_datagram_size=MSS, adapter=cc.inner)
    stream_id = quic.get_next_available_stream_id()
    quic.send_stream_data(stream_id, bytes(4 * MSS), end_stream=True)
    pair.exchange()
    assert "next_send_time" in calls and "update_after_send" in calls, (
        f"aioquic {aioquic.__version__} no longer consults _loss._pacer when it sends"
    )


@pytest.mark.parametrize("congestion", ["reno", "cubic"])
def test_aioquic_controllers_keep_aioquic_pacer(congestion: str) -> None:
    pair = _connected_pair(congestion)
    cc = pair.client.quic._loss._cc
    assert isinstance(cc, Meter) and not isinstance(cc.inner, ControllerAdapter)
    assert type(pair.client.quic._loss._pacer) is QuicPacketPacer


def test_a_larger_datagram_size_takes_effect_from_the_next_packets() -> None:
    """congestion_control.set_max_datagram_size sets ``_max_datagram_size`` after the
    handshake (a path MTU probe succeeded, path_mtu.py): aioquic must build every later
    datagram up to it, and a DATAGRAM frame that needs it must go out whole."""
    pair = _connected_pair()
    quic = pair.client.quic
    assert _require(quic, "_max_datagram_size", "quic_link.py and congestion_control.py") == MSS
    big = 16448
    assert set_max_datagram_size(quic, big)
    assert quic._max_datagram_size == big
    assert quic._loss._cc.inner.controller.congestion_window >= 2 * big
    sizes: list[int] = []
    for _ in range(3):
        quic.send_datagram_frame(bytes(big - 64))
    stream_id = quic.get_next_available_stream_id()
    quic.send_stream_data(stream_id, bytes(4 * big), end_stream=True)
    for _ in range(20):
        pair.now += 0.002
        for data, _ in quic.datagrams_to_send(now=pair.now):
            sizes.append(len(data))
            pair.server.deliver(data, CLIENT_ADDR, pair.now)
        for data, _ in pair.server.quic.datagrams_to_send(now=pair.now):
            pair.client.deliver(data, SERVER_ADDR, pair.now)
    assert max(sizes) > MSS and max(sizes) <= big, sizes
    got = [e for e in pair.server.seen if isinstance(e, events.DatagramFrameReceived)]
    assert len(got) == 3 and all(len(e.data) == big - 64 for e in got)


def test_a_smaller_datagram_size_resends_what_larger_packets_carried() -> None:
    """congestion_control.resend_smaller, after the size went back down (a path MTU black
    hole, path_mtu.py): packets in flight that were larger are declared lost without a
    congestion event and their stream data goes again in packets of the new size; queued
    DATAGRAM frames too large for it are dropped, smaller ones kept. ``_pto_count`` is
    what quic_link.LinkStats reports."""
    pair = _connected_pair()
    quic = pair.client.quic
    big = 16448
    assert set_max_datagram_size(quic, big)
    stream_id = quic.get_next_available_stream_id()
    data = bytes(range(256)) * 256  # 64 KiB
    quic.send_stream_data(stream_id, data, end_stream=True)
    pair.now += 0.002
    lost = quic.datagrams_to_send(now=pair.now)  # the black hole: none of these arrive
    assert max(len(d) for d, _ in lost) > MSS
    spaces = _require(quic, "_loss.spaces", "congestion_control.py")
    in_flight = [p for space in spaces for p in space.sent_packets.values()]
    assert in_flight and all(hasattr(p, "sent_bytes") for p in in_flight)
    assert _require(quic, "_loss._pto_count", "quic_link.py") == 0
    meter = quic._loss._cc
    assert isinstance(meter, Meter)
    lost_before = meter.packets_lost
    quic.send_datagram_frame(bytes(big - 64))
    quic.send_datagram_frame(bytes(100))
    assert set_max_datagram_size(quic, MSS)
    resend_smaller(quic, MSS, MSS - 64, pair.now)
    assert list(_require(quic, "_datagrams_pending", "congestion_control.py")) == [bytes(100)]
    assert not [p for space in spaces for p in space.sent_packets.values()
                if p.sent_bytes > MSS]
    assert meter.packets_lost == lost_before  # expired, not lost to congestion
    sizes: list[int] = []
    for _ in range(200):
        pair.now += 0.002
        timer = quic.get_timer()
        if timer is not None and timer <= pair.now:
            quic.handle_timer(now=pair.now)
        for datagram, _ in quic.datagrams_to_send(now=pair.now):
            sizes.append(len(datagram))
            pair.server.deliver(datagram, CLIENT_ADDR, pair.now)
        for datagram, _ in pair.server.quic.datagrams_to_send(now=pair.now):
            pair.client.deliver(datagram, SERVER_ADDR, pair.now)
    assert sizes and max(sizes) <= MSS, sizes
    got = b"".join(e.data for e in pair.server.seen
                   if isinstance(e, events.StreamDataReceived) and e.stream_id == stream_id)
    assert got == data
    datagrams = [e for e in pair.server.seen if isinstance(e, events.DatagramFrameReceived)]
    assert [len(e.data) for e in datagrams] == [100]


@pytest.mark.parametrize("congestion", ["reno", "cubic"])
def test_aioquic_controllers_keep_their_datagram_size(congestion: str) -> None:
    quic = _connected_pair(congestion).client.quic
    assert not set_max_datagram_size(quic, 16448)
    assert quic._max_datagram_size == MSS


def test_link_stats_read_the_rtt_estimator() -> None:
    """quic_link.QuicLink.stats reads the loss recovery's RTT fields."""
    loss = _connected_pair().client.quic._loss
    assert _require(loss, "_rtt_initialized", "quic_link.py") is True
    for name in ("_rtt_smoothed", "_rtt_min", "_rtt_variance", "_rtt_latest"):
        value = _require(loss, name, "quic_link.py")
        _require_type(value, (int, float), f"_loss.{name}", "quic_link.py")
        assert 0.0 <= value < 1.0, f"_loss.{name} = {value} after an in-memory handshake"
    assert loss._rtt_smoothed > 0.0


def test_datagram_room_reads_the_peer_limit_cid_and_queue() -> None:
    """quic_link.QuicLink sizes DATAGRAM payloads from ``_remote_max_datagram_frame_size``
    and ``_peer_cid.cid``, and counts ``_datagrams_pending`` against the window."""
    pair = _connected_pair()
    quic = pair.client.quic
    assert _require(quic, "_handshake_complete", "quic_link.py") is True
    assert _require(quic, "_remote_max_datagram_frame_size", "quic_link.py") == 65536
    cid = _require(quic, "_peer_cid.cid", "quic_link.py")
    _require_type(cid, bytes, "_peer_cid.cid", "quic_link.py")
    assert len(cid) == CID_LENGTH
    pending = _require(quic, "_datagrams_pending", "quic_link.py")
    _require_type(pending, deque, "_datagrams_pending", "quic_link.py")
    quic.send_datagram_frame(b"x" * 100)
    assert len(pending) == 1, "send_datagram_frame no longer queues in _datagrams_pending"
    pair.exchange()
    assert len(pending) == 0
    assert any(isinstance(e, events.DatagramFrameReceived) for e in pair.server.seen)


def test_stream_sender_buffer_counts_unacknowledged_bytes() -> None:
    """quic_link.QuicLink's write window is ``_streams[id].sender._buffer_stop -
    _buffer_start``: bytes written and not yet acknowledged."""
    pair = _connected_pair()
    quic = pair.client.quic
    stream_id = quic.get_next_available_stream_id()
    quic.send_stream_data(stream_id, bytes(10_000))
    streams = _require(quic, "_streams", "quic_link.py")
    _require_type(streams, dict, "_streams", "quic_link.py")
    sender = _require(streams[stream_id], "sender", "quic_link.py")
    start = _require(sender, "_buffer_start", "quic_link.py")
    stop = _require(sender, "_buffer_stop", "quic_link.py")
    assert stop - start == 10_000
    pair.exchange()
    assert sender._buffer_stop - sender._buffer_start == 0, "acknowledged bytes stay counted"


def test_closing_state_is_visible_at_once() -> None:
    """quic_link.QuicLink ends a link as soon as ``_close_event`` is set, by the peer when
    ``_state`` is DRAINING, and reads ``_handshake_confirmed``."""
    pair = _connected_pair()
    client, server = pair.client.quic, pair.server.quic
    assert _require(client, "_handshake_confirmed", "quic_link.py") is True
    assert _require(server, "_close_event", "quic_link.py") is None
    server.close(error_code=0x100, reason_phrase="endpoint closing")
    assert server._close_event is not None
    pair.exchange()
    event = _require(client, "_close_event", "quic_link.py")
    _require_type(event, events.ConnectionTerminated, "_close_event", "quic_link.py")
    assert (event.error_code, event.reason_phrase) == (0x100, "endpoint closing")
    assert _require(client, "_state", "quic_link.py") == QuicConnectionState.DRAINING
    assert server._state != QuicConnectionState.DRAINING


def test_credit_counts_delivered_bytes_and_stops_with_the_stream() -> None:
    """quic_config.CreditedConnection overrides ``_write_stream_limits(builder, space,
    stream)`` and ``_write_connection_limits(builder, space)``, and reads a stream's
    ``receiver.highest_offset``, ``receiver.starting_offset()``,
    ``receiver._stop_error_code`` and ``max_stream_data_local``, and the connection's
    ``_local_max_data.used``/``.value``: data past a hole earns no credit, a stopped stream
    none at all."""
    for method, expected in (
        ("_write_stream_limits", ["self", "builder", "space", "stream"]),
        ("_write_connection_limits", ["self", "builder", "space"]),
    ):
        theirs = list(inspect.signature(getattr(QuicConnection, method)).parameters)
        if theirs != expected:
            pytest.fail(f"aioquic {aioquic.__version__}: QuicConnection.{method}{theirs[1:]} "
                        f"changed; quic_config.CreditedConnection overrides it as {expected}")
    pair = _connected_pair()
    client, server = pair.client.quic, pair.server.quic
    limit_ = _require(server, "_local_max_data", "quic_config.py")
    _require_type(_require(limit_, "used", "quic_config.py"), int, "_local_max_data.used",
                  "quic_config.py")
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"x")
    pair.exchange()
    stream = server._streams[stream_id]
    receiver = _require(stream, "receiver", "quic_config.py")
    assert _require(receiver, "_stop_error_code", "quic_config.py") is None
    _require(receiver, "starting_offset", "quic_config.py")
    window = _require(stream, "max_stream_data_local", "quic_config.py")

    def credit_after(offset: int, size: int) -> int:
        receiver.handle_frame(QuicStreamFrame(offset=offset, data=bytes(size)))
        server.send_ping(1)  # have it build a packet, where limits are raised
        server.datagrams_to_send(now=pair.now + 1.0)
        return int(stream.max_stream_data_local)

    # beyond a hole: aioquic itself would double the window here (highest offset > half)
    assert receiver.highest_offset == 1
    assert credit_after(window - 10, 10) == window, "data past a hole earned credit"
    # the hole filled: the bytes are delivered, the window doubles as aioquic does it
    assert credit_after(1, window - 11) == 2 * window
    # stopped: nothing more, even for bytes delivered in order
    server.stop_stream(stream_id, 0x200)
    assert receiver._stop_error_code == 0x200
    assert credit_after(window, window) == 2 * window, "a stopped stream earned credit"
