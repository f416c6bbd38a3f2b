"""The aioquic adapter: QUIC connections over one UDP socket.

The only module that imports aioquic; its types and exceptions stop here.

- :class:`QuicSocket` owns the node's UDP port. It accepts incoming connections and
  makes outgoing ones from the same port, demultiplexing packets by destination
  connection id, so that a peer is always reached at the address it announces.
- :class:`QuicLink` pumps one sans-I/O ``QuicConnection``: packets in, packets out, one
  timer, events turned into :class:`~.stream.QuicStream` calls. DATAGRAM frames are
  pulled from registered sources only while the congestion window has room (aioquic
  would queue them without bound, ahead of all stream data).

TLS identity. Both sides present a self-signed certificate for their Ed25519 node key.
CA checks are off; the client compares the server certificate's key with the peer id it
meant to reach. aioquic has no public switch for client certificates, so the server
connection sets its TLS context's ``_request_client_certificate`` flag (aioquic does the
rest: CertificateRequest, and the client's Certificate and CertificateVerify checked
against its key, RFC 8446 §4.3.2, §4.4). For the identity handshake that then binds both
peer ids to the connection (handshake.py), each link exports a channel-binding secret
from the TLS key schedule: HKDF-Expand-Label(master secret, "wanswarm exporter",
Transcript-Hash(ClientHello..client Finished), 32), the construction of RFC 8446 §7.5 at
the end of the handshake, which only the two endpoints can compute.

Sizes. Packets are sized for a 1500-byte path MTU: ``max_udp_payload_bytes`` (1452 = 1500
- 40 IPv6 - 8 UDP) is aioquic's ``max_datagram_size``. Flow-control windows start at the
bandwidth-delay product of the configured path (aioquic then doubles them as they fill).

Congestion control. ``congestion.algorithm`` "wanswarm" runs congestion.py's loss-tolerant,
rate-based controller behind aioquic's callbacks (congestion_adapter.py), and aioquic's
pacer follows the controller's pacing rate; "reno" and "cubic" are aioquic's own. Either
way a meter counts packets sent and lost and the delivery rate for the link's stats.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import math
import os
import random
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion.base import (
    QuicCongestionControl,
    create_congestion_control,
    register_congestion_control,
)
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicPacketType, encode_quic_version_negotiation, pull_quic_header
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.tls import hkdf_expand_label, load_pem_private_key, load_pem_x509_certificates
from cryptography.hazmat.primitives.serialization import Encoding

from .config import CongestionConfig, TransportConfig
from .congestion_adapter import CongestionControl, ControllerAdapter, Meter
from .errors import AuthenticationError, ConfigError, ConnectError, IdentityError
from .handshake import ChannelBinding
from .identity import Identity, peer_id_from_certificate
from .pacing import Pacer
from .stream import QuicStream, StreamCode

logger = logging.getLogger(__name__)

ALPN = "wanswarm/1"
CID_LENGTH = 8
AEAD_TAG_BYTES = 16  # every QUIC v1/v2 AEAD (RFC 9001 §5.3)
MIN_INITIAL_BYTES = 1200  # RFC 9000 §14.1: a client's Initial datagram is padded to this
_EXPORTER_LABEL = b"wanswarm exporter"
_DATAGRAM_BATCH = 32  # datagrams taken from one source per round-robin turn

Address = tuple[str, int]


class CloseCode(enum.IntEnum):
    """QUIC application error codes in CONNECTION_CLOSE (RFC 9000 §20.2)."""

    NO_ERROR = 0x0
    SHUTDOWN = 0x100
    AUTH_FAILED = 0x101
    PEER_ID_MISMATCH = 0x102
    PROTOCOL = 0x103
    PEER_SILENT = 0x104
    INTERNAL = 0x105


# -- congestion control -----------------------------------------------------------------


class _ControllerPacer(QuicPacketPacer):
    """aioquic's pacer slot, driven by our controller's pacing rate through our own bucket.

    aioquic's ``QuicPacketPacer`` lets a packet go whenever its bucket holds any credit and
    forgives the debt of a send it could not pay for, so every ACK releases a packet: a flow
    can never be paced below its ACK rate, which breaks DRAIN and PROBE_BW's 0.75 phase
    (see transport/pacing.py). We keep aioquic's call sites (``next_send_time`` before
    building packets, ``update_after_send`` after each) and answer them from
    :class:`~.pacing.Pacer`, reading the controller's rate at every send.
    """

    def __init__(self, *, max_datagram_size: int, adapter: ControllerAdapter) -> None:
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


_registered: set[str] = set()


def _new_rng() -> random.Random:
    return random.Random(int.from_bytes(os.urandom(8), "big"))


def register_wanswarm_congestion_control() -> None:
    """Register our controller with aioquic as "wanswarm" (default settings)."""
    if "wanswarm" not in _registered:

        def factory(*, max_datagram_size: int) -> QuicCongestionControl:
            adapter = ControllerAdapter(
                CongestionConfig(), max_datagram_size=max_datagram_size, rng=_new_rng()
            )
            return cast(QuicCongestionControl, adapter)

        register_congestion_control("wanswarm", factory)
        _registered.add("wanswarm")


def _congestion_algorithm(config: CongestionConfig, max_datagram_size: int) -> str:
    """Register (once per distinct settings) the metered controller that ``config``
    selects, and return the name aioquic knows it by."""
    register_wanswarm_congestion_control()
    algorithm = config.algorithm
    if algorithm == "wanswarm":
        digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]
        name = f"wanswarm-metered-{digest}"

        def inner(max_datagram_size: int) -> CongestionControl:
            return ControllerAdapter(config, max_datagram_size=max_datagram_size, rng=_new_rng())

    else:
        try:
            create_congestion_control(algorithm, max_datagram_size=max_datagram_size)
        except Exception as exc:  # aioquic raises a bare Exception for unknown names
            raise ConfigError(
                f"unknown congestion control algorithm {algorithm!r}: use 'wanswarm', "
                "'reno' or 'cubic'"
            ) from exc
        name = f"wanswarm-metered-{algorithm}"

        def inner(max_datagram_size: int) -> CongestionControl:
            return create_congestion_control(algorithm, max_datagram_size=max_datagram_size)

    if name not in _registered:

        def factory(*, max_datagram_size: int) -> QuicCongestionControl:
            return cast(QuicCongestionControl, Meter(inner(max_datagram_size)))

        register_congestion_control(name, factory)
        _registered.add(name)
    return name


# -- configuration ----------------------------------------------------------------------


def window_bytes(config: TransportConfig) -> int:
    """Bandwidth-delay product of the planned path, at least aioquic's 1 MiB default."""
    return max(1 << 20, int(config.path_bandwidth_bps * config.path_rtt_s / 8))


def build_configuration(
    identity: Identity, config: TransportConfig, *, is_client: bool
) -> QuicConfiguration:
    """aioquic settings: our certificate, ALPN, windows, packet size, DATAGRAM support."""
    cert_pem, key_pem = identity.certificate_pem()
    window = window_bytes(config)
    qc = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        connection_id_length=CID_LENGTH,
        idle_timeout=config.idle_timeout_s,
        max_data=2 * window,
        max_stream_data=window,
        max_datagram_size=config.max_udp_payload_bytes,
        max_datagram_frame_size=65536,  # RFC 9221 §3; what we send is bounded by a packet
        congestion_control_algorithm=_congestion_algorithm(
            config.congestion, config.max_udp_payload_bytes
        ),
        verify_mode=ssl.CERT_NONE,  # no CA: the key is checked against the peer id
    )
    qc.certificate = load_pem_x509_certificates(cert_pem)[0]
    qc.private_key = load_pem_private_key(key_pem)
    return qc


class _ServerConnection(QuicConnection):
    """A server connection that asks the client for its certificate (mutual TLS)."""

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        self.tls._request_client_certificate = True


# -- links ------------------------------------------------------------------------------


class DatagramSource(Protocol):
    """Something with DATAGRAM payloads to send (an FEC transfer)."""

    def next_datagrams(self, max_size: int, count: int, now: float) -> list[bytes]:
        """Up to ``count`` payloads of at most ``max_size`` bytes each, to go out now."""
        ...


@dataclass(frozen=True)
class LinkStats:
    """Measurements of one connection, from aioquic's loss recovery and our metering."""

    smoothed_rtt: float
    min_rtt: float
    rtt_var: float
    latest_rtt: float
    packets_sent: int
    packets_lost: int
    delivery_rate_bps: float
    congestion_window: int
    bytes_in_flight: int
    bytes_sent: int
    bytes_received: int
    connected: bool

    @property
    def loss_rate(self) -> float:
        return self.packets_lost / self.packets_sent if self.packets_sent else 0.0


def _guarded(callback: Callable[[Any], None], arg: Any) -> None:
    """Run an application callback from the pump: its failure must not stop the pump."""
    try:
        callback(arg)
    except Exception:
        logger.exception("callback %r failed", callback)


class QuicLink:
    """One QUIC connection, pumped on the event loop; made by :class:`QuicSocket`.

    ``peer_id`` is None until the identity handshake (connections.py) has succeeded.
    """

    def __init__(
        self, owner: QuicSocket, quic: QuicConnection, addr: Address, *, is_client: bool
    ) -> None:
        config = owner.config
        self._owner = owner
        self._quic = quic
        self._loop = asyncio.get_running_loop()
        cc = quic._loss._cc
        if isinstance(cc, Meter) and isinstance(cc.inner, ControllerAdapter):
            quic._loss._pacer = _ControllerPacer(
                max_datagram_size=config.max_udp_payload_bytes, adapter=cc.inner
            )
        self.remote_address = addr
        self.is_client = is_client
        self.peer_id: str | None = None
        self.tls_peer_id: str | None = None  # the key of the certificate the peer showed
        self.binding: ChannelBinding | None = None
        self.on_stream: Callable[[QuicStream], None] | None = None
        self.on_datagram: Callable[[bytes], None] | None = None
        self.on_closed: list[Callable[[QuicLink], None]] = []
        self.handshake_done: asyncio.Future[None] = self._loop.create_future()
        self.confirmed = asyncio.Event()  # RFC 9001 §4.1.2: handshake confirmed
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed_by_peer = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.created_at = self.last_received_at = self._loop.time()
        self._closed = asyncio.Event()
        self._streams: dict[int, QuicStream] = {}
        self._blocked: dict[int, asyncio.Future[None]] = {}
        self._sources: deque[DatagramSource] = deque()
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._waiting = 0
        self._window = window_bytes(config)
        self._max_udp_payload = config.max_udp_payload_bytes
        self._dead_after = config.dead_peer_timeout_s
        self.write_chunk = 256 * 1024

    # state

    @property
    def is_closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def closed_error(self) -> ConnectError:
        who = "peer" if self.closed_by_peer else "local"
        code = "none" if self.close_code is None else f"{self.close_code:#x}"
        return ConnectError(
            f"connection to {self.peer_id or self.remote_address} closed "
            f"({who}, code {code}): {self.close_reason}"
        )

    def stats(self) -> LinkStats:
        loss = self._quic._loss
        cc = loss._cc
        metered = cc if isinstance(cc, Meter) else None
        return LinkStats(
            smoothed_rtt=loss._rtt_smoothed,
            min_rtt=loss._rtt_min if loss._rtt_initialized else 0.0,
            rtt_var=loss._rtt_variance,
            latest_rtt=loss._rtt_latest,
            packets_sent=metered.packets_sent if metered else 0,
            packets_lost=metered.packets_lost if metered else 0,
            delivery_rate_bps=metered.delivery_rate_bps if metered else 0.0,
            congestion_window=cc.congestion_window,
            bytes_in_flight=cc.bytes_in_flight,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            connected=not self.is_closed,
        )

    # streams, datagrams, pings

    def open_stream(self) -> QuicStream:
        if self.is_closed:
            raise self.closed_error()
        stream = QuicStream(self, self._quic.get_next_available_stream_id())
        self._streams[stream.stream_id] = stream
        return stream

    @property
    def max_datagram_payload(self) -> int | None:
        """Largest DATAGRAM payload that fits one packet; None if the peer takes none."""
        remote = self._quic._remote_max_datagram_frame_size
        if remote is None:
            return None
        short_header = 1 + len(self._quic._peer_cid.cid) + 2  # aioquic sends 2-byte PNs
        frame_header = 1 + 2  # type, 2-byte length varint
        capacity = self._max_udp_payload - short_header - AEAD_TAG_BYTES - frame_header
        return min(capacity, remote - frame_header)

    def add_datagram_source(self, source: DatagramSource) -> None:
        if source not in self._sources:
            self._sources.append(source)
        self.schedule_transmit()

    def remove_datagram_source(self, source: DatagramSource) -> None:
        if source in self._sources:
            self._sources.remove(source)

    async def ping(self) -> float:
        """Seconds until a PING is acknowledged (the caller sets the deadline)."""
        if self.is_closed:
            raise self.closed_error()
        waiter: asyncio.Future[None] = self._loop.create_future()
        uid = id(waiter)
        self._pings[uid] = waiter
        start = self._loop.time()
        self._quic.send_ping(uid)
        self.transmit()
        try:
            await waiter
        finally:
            self._pings.pop(uid, None)
        return self._loop.time() - start

    def close(self, code: CloseCode = CloseCode.NO_ERROR, reason: str = "") -> None:
        """Send CONNECTION_CLOSE; the link ends after aioquic's closing period."""
        if self.close_code is None:
            self.close_code, self.close_reason = int(code), reason
        self._quic.close(error_code=int(code), reason_phrase=reason[:200])
        self.transmit()

    def abandon(self, code: CloseCode, reason: str) -> None:
        """Close and end the link now, without waiting for the closing period."""
        self.close(code, reason)
        self._terminate(self.close_code, self.close_reason, by_peer=False)

    async def refuse(self, code: CloseCode, reason: str, timeout: float) -> None:
        """Close with ``code`` and ``reason`` once the handshake is confirmed (at most
        ``timeout`` s): before that, RFC 9000 §10.2.3 has the close travel as a bare
        transport error, and the peer would learn neither the code nor the reason."""
        if not self.is_closed and not self.confirmed.is_set():
            self.transmit()  # our Finished, if still queued
            try:
                async with asyncio.timeout(timeout):
                    await self.confirmed.wait()
            except TimeoutError:
                pass
        self.abandon(code, reason)

    @contextmanager
    def expecting_traffic(self) -> Iterator[None]:
        """While inside, a peer silent for ``dead_peer_timeout_s`` ends the connection;
        PINGs go out every third of that to draw acknowledgements."""
        self._waiting += 1
        if self._watchdog is None and not self.is_closed:
            self._watchdog = self._loop.call_later(self._dead_after / 3, self._check_alive)
        try:
            yield
        finally:
            self._waiting -= 1

    def _check_alive(self) -> None:
        self._watchdog = None
        if self._waiting <= 0 or self.is_closed:
            return
        silent = self._loop.time() - self.last_received_at
        if silent >= self._dead_after:
            logger.warning("peer %s silent for %.1f s: connection declared dead",
                           self.peer_id or self.remote_address, silent)
            self.abandon(CloseCode.PEER_SILENT, f"no packet for {silent:.1f} s")
            return
        if silent >= self._dead_after / 3:
            self._quic.send_ping(0)
            self.transmit()
        self._watchdog = self._loop.call_later(self._dead_after / 3, self._check_alive)

    # the pump

    def datagram_received(self, data: bytes, addr: Address) -> None:
        if self.is_closed:
            return
        self.bytes_received += len(data)
        self.last_received_at = now = self._loop.time()
        try:
            self._quic.receive_datagram(data, addr, now=now)
            self._process_events()
            # one transmit for all the datagrams that arrived in this loop iteration
            self.schedule_transmit()
            self._check_closing()
            for stream_id, waiter in list(self._blocked.items()):
                if not waiter.done() and self._unacked(stream_id) < self._window // 2:
                    waiter.set_result(None)
        except Exception:
            self._fail("receiving a packet")

    def transmit(self) -> None:
        """Send what aioquic has; then top up datagrams to the window and send again
        (stream data goes first: aioquic writes queued datagrams ahead of it)."""
        self._transmit_handle = None
        if self.is_closed:
            return
        try:
            now = self._loop.time()
            self._send_packets(now)
            if self._sources and self._feed_datagrams():
                self._send_packets(now)
            self._arm_timer()
        except Exception:
            self._fail("sending")

    def _fail(self, doing: str) -> None:
        """A bug below us (aioquic, a controller) left the connection's state unknown:
        end that connection, keep the socket and every other connection."""
        logger.exception("connection to %s failed while %s; closing it",
                         self.peer_id or self.remote_address, doing)
        if self.is_closed:
            return
        try:
            self._quic.close(error_code=int(CloseCode.INTERNAL), reason_phrase="internal error")
            self._send_packets(self._loop.time())
        except Exception:
            logger.debug("could not send the close", exc_info=True)
        self._terminate(int(CloseCode.INTERNAL), "internal error", by_peer=False)

    def _arm_timer(self) -> None:
        # An early wake-up is harmless (aioquic acts only on what is due), so an armed
        # timer is kept unless the new deadline is sooner: no cancel/re-arm per packet.
        timer_at = self._quic.get_timer()
        if timer_at is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at

    def schedule_transmit(self) -> None:
        if self._transmit_handle is None:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def _send_packets(self, now: float) -> None:
        for data, addr in self._quic.datagrams_to_send(now=now):
            self.bytes_sent += len(data)
            self._owner.sendto(data, addr)

    def _feed_datagrams(self) -> bool:
        """Queue datagrams into the congestion window's free room; True if any."""
        max_size = self.max_datagram_payload
        if max_size is None or not self._quic._handshake_complete:
            return False
        cc = self._quic._loss._cc
        overhead = self._max_udp_payload - max_size  # headers and AEAD tag of its packet
        queued = self._quic._datagrams_pending
        room = cc.congestion_window - cc.bytes_in_flight
        # aioquic's queue holds what we fed and it has not packed yet; counting each entry as a
        # full datagram is O(1) and exact for full-size FEC symbols (summing the lengths cost
        # 12-18% of a sender's CPU at large windows), at worst it leaves a partial datagram of room
        room -= len(queued) * (max_size + overhead)
        fed, idle, now = False, 0, self._loop.time()
        while room > 0 and self._sources and idle < len(self._sources):
            source = self._sources[0]
            self._sources.rotate(-1)  # round robin, a bounded batch per turn
            count = min(_DATAGRAM_BATCH, max(1, room // (max_size + overhead)))
            payloads = source.next_datagrams(max_size, count, now)
            idle = 0 if payloads else idle + 1
            for payload in payloads:
                if len(payload) > max_size:  # it would block aioquic's datagram queue forever
                    logger.error("datagram source %r gave %d > %d bytes; source dropped",
                                 source, len(payload), max_size)
                    self.remove_datagram_source(source)
                    break
                self._quic.send_datagram_frame(payload)
                room -= len(payload) + overhead
                fed = True
        return fed

    def _handle_timer(self) -> None:
        now = max(self._timer_at or 0.0, self._loop.time())
        self._timer = self._timer_at = None
        if self.is_closed:
            return
        try:
            self._quic.handle_timer(now=now)
            self._process_events()
            self.transmit()
            self._check_closing()
        except Exception:
            self._fail("handling a timer")

    def _check_closing(self) -> None:
        """End the link as soon as the connection is closing, not after its draining
        period (aioquic reports ConnectionTerminated only then, 3 PTOs later)."""
        if self._quic._handshake_confirmed and not self.confirmed.is_set():
            self.confirmed.set()
        close_event = self._quic._close_event
        if close_event is not None and not self.is_closed:
            by_peer = self._quic._state == QuicConnectionState.DRAINING
            if self.close_code is None or by_peer:
                self._terminate(close_event.error_code, close_event.reason_phrase, by_peer=by_peer)

    def _process_events(self) -> None:
        while (event := self._quic.next_event()) is not None:
            if isinstance(event, events.StreamDataReceived):
                self._on_stream_data(event)
            elif isinstance(event, events.DatagramFrameReceived):
                if self.on_datagram is not None:
                    _guarded(self.on_datagram, event.data)
            elif isinstance(event, events.StreamReset):
                if (stream := self._streams.get(event.stream_id)) is not None:
                    stream.on_reset(event.error_code)
                    self._forget_if_finished(stream)
            elif isinstance(event, events.StopSendingReceived):
                if (stream := self._streams.get(event.stream_id)) is not None:
                    stream.on_stop(event.error_code)
                    self._wake_writer(stream.stream_id)
                    self._forget_if_finished(stream)
            elif isinstance(event, events.PingAcknowledged):
                waiter = self._pings.get(event.uid)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif isinstance(event, events.HandshakeCompleted):
                self._on_handshake(event)
            elif isinstance(event, events.ConnectionIdIssued):
                self._owner.register_cid(event.connection_id, self)
            elif isinstance(event, events.ConnectionIdRetired):
                self._owner.unregister_cid(event.connection_id)
            elif isinstance(event, events.ConnectionTerminated):
                # a peer's close ended the link already (_check_closing): this is the end
                # of our own close, or a local verdict such as the idle timeout
                self._terminate(event.error_code, event.reason_phrase, by_peer=False)

    def _on_stream_data(self, event: events.StreamDataReceived) -> None:
        stream = self._streams.get(event.stream_id)
        if stream is None:
            ours = (event.stream_id & 1) == (0 if self.is_client else 1)
            if ours or event.stream_id & 2:
                return  # a stream of ours we already forgot, or a unidirectional one
            stream = QuicStream(self, event.stream_id)
            self._streams[event.stream_id] = stream
            if self.on_stream is None:
                self.abort_stream(stream, StreamCode.REFUSED)
                return
            _guarded(self.on_stream, stream)
        stream.on_data(event.data, event.end_stream)
        self._forget_if_finished(stream)

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        if self.handshake_done.done():
            return
        try:
            if event.alpn_protocol != ALPN:
                raise AuthenticationError(f"peer negotiated ALPN {event.alpn_protocol!r}")
            cert = self._quic.tls._peer_certificate
            if cert is not None:
                self.tls_peer_id = peer_id_from_certificate(cert.public_bytes(Encoding.DER))
            self.binding = self._channel_binding(event.alpn_protocol)
        except (AuthenticationError, IdentityError) as exc:
            self.handshake_done.set_exception(AuthenticationError(str(exc)))
            return
        self.handshake_done.set_result(None)

    def _channel_binding(self, alpn: str) -> ChannelBinding:
        quic = self._quic
        schedule = quic.tls.key_schedule
        if schedule is None or schedule.generation != 3:
            raise AuthenticationError("TLS key schedule is not at the master secret")
        exporter = hkdf_expand_label(
            algorithm=schedule.algorithm,
            secret=schedule.secret,
            label=_EXPORTER_LABEL,
            hash_value=schedule.hash.copy().finalize(),
            length=32,
        )
        local = quic._local_initial_source_connection_id
        remote = quic._remote_initial_source_connection_id or b""
        return ChannelBinding(
            exporter=exporter,
            alpn=alpn,
            original_dcid=quic._original_destination_connection_id or b"",
            client_scid=local if self.is_client else remote,
            server_scid=remote if self.is_client else local,
        )

    def _terminate(self, code: int | None, reason: str, *, by_peer: bool) -> None:
        if self._closed.is_set():
            return
        self.close_code, self.close_reason, self.closed_by_peer = code, reason, by_peer
        self._closed.set()
        error = self.closed_error()
        if not self.handshake_done.done():
            self.handshake_done.set_exception(error)
        for stream in list(self._streams.values()):
            stream.on_closed(error)
        self._streams.clear()
        for waiter in [*self._blocked.values(), *self._pings.values()]:
            if not waiter.done():
                waiter.set_exception(error)
        self._sources.clear()
        for handle in (self._timer, self._watchdog, self._transmit_handle):
            if handle is not None:
                handle.cancel()
        self._owner.forget(self)
        for callback in self.on_closed:
            _guarded(callback, self)

    # StreamOwner, for QuicStream

    def send_stream_data(self, stream_id: int, data: bytes | memoryview, end: bool) -> None:
        if self.is_closed:
            raise self.closed_error()
        try:
            # aioquic appends to a bytearray, which takes any buffer without a copy
            self._quic.send_stream_data(stream_id, cast(bytes, data), end_stream=end)
        except (RuntimeError, ValueError) as exc:
            raise ConnectError(f"stream {stream_id}: {exc}") from exc
        self.schedule_transmit()

    async def wait_send_room(self, stream: QuicStream) -> None:
        while True:
            if self.is_closed:
                raise self.closed_error()
            if stream.send_error is not None:
                raise stream.send_error
            if self._unacked(stream.stream_id) < self._window:
                return
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._blocked[stream.stream_id] = waiter
            try:
                await waiter
            finally:
                self._blocked.pop(stream.stream_id, None)

    def abort_stream(self, stream: QuicStream, code: StreamCode) -> None:
        if not self.is_closed:
            if stream.can_send:
                self._quic.reset_stream(stream.stream_id, int(code))
            if stream.can_receive:
                self._quic.stop_stream(stream.stream_id, int(code))
            self.schedule_transmit()
        stream.on_closed(ConnectError(f"stream {stream.stream_id} aborted (code {code:#x})"))
        self._wake_writer(stream.stream_id)
        self._streams.pop(stream.stream_id, None)

    def _forget_if_finished(self, stream: QuicStream) -> None:
        if stream.finished:
            self._streams.pop(stream.stream_id, None)

    def _unacked(self, stream_id: int) -> int:
        quic_stream = self._quic._streams.get(stream_id)
        if quic_stream is None:
            return 0
        return quic_stream.sender._buffer_stop - quic_stream.sender._buffer_start

    def _wake_writer(self, stream_id: int) -> None:
        waiter = self._blocked.get(stream_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


# -- the socket -------------------------------------------------------------------------


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, owner: QuicSocket) -> None:
        self._owner = owner
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._owner.datagram_received(data, (addr[0], addr[1]))
        except Exception:  # one packet must never take the socket down
            logger.exception("dropped a packet from %s that raised", addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("UDP socket error: %s", exc)


class QuicSocket:
    """The node's QUIC port. ``on_accept`` gets each incoming connection as soon as it
    exists (before TLS completes); :meth:`connect` makes outgoing ones."""

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        on_accept: Callable[[QuicLink], None],
    ) -> None:
        self.identity = identity
        self.config = config
        self._on_accept = on_accept
        self._server_config = build_configuration(identity, config, is_client=False)
        self._client_config = build_configuration(identity, config, is_client=True)
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Protocol | None = None
        self._family = socket.AF_INET
        self._by_cid: dict[bytes, QuicLink] = {}
        self._links: set[QuicLink] = set()
        self.accepting = True
        self.address: Address = ("", 0)

    @property
    def links(self) -> list[QuicLink]:
        return list(self._links)

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, self.config.socket_buffer_bytes)
            sock.bind((host, port))
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _Protocol(self), sock=sock
            )
        except OSError as exc:
            sock.close()
            raise ConnectError(f"cannot bind UDP {host}:{port}: {exc}") from exc
        self._transport = transport
        self._protocol = protocol
        self._family = family
        bound = sock.getsockname()
        self.address = (str(bound[0]), int(bound[1]))

    def sendto(self, data: bytes, addr: Address) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(data, addr)

    def register_cid(self, cid: bytes, link: QuicLink) -> None:
        self._by_cid[cid] = link

    def unregister_cid(self, cid: bytes) -> None:
        self._by_cid.pop(cid, None)

    def forget(self, link: QuicLink) -> None:
        self._links.discard(link)
        for cid in [c for c, other in self._by_cid.items() if other is link]:
            del self._by_cid[cid]

    def datagram_received(self, data: bytes, addr: Address) -> None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except ValueError:
            return
        versions = self._server_config.supported_versions
        if (
            header.packet_type != QuicPacketType.VERSION_NEGOTIATION
            and header.version is not None
            and header.version not in versions
        ):  # RFC 9000 §6, never in answer to a version negotiation packet
            self.sendto(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=versions,
                ),
                addr,
            )
            return
        link = self._by_cid.get(header.destination_cid)
        if link is None:
            if (
                not self.accepting
                or header.packet_type != QuicPacketType.INITIAL
                or len(data) < MIN_INITIAL_BYTES
            ):
                return
            link = self._accept(header.destination_cid, addr)
            if link is None:
                return
        link.datagram_received(data, addr)

    def _accept(self, dcid: bytes, addr: Address) -> QuicLink | None:
        unauthenticated = sum(1 for link in self._links if link.peer_id is None)
        if (
            len(self._links) >= self.config.max_connections
            or unauthenticated >= self.config.max_unauthenticated
        ):
            logger.warning("ignoring a new connection from %s: too many connections", addr)
            return None
        quic = _ServerConnection(
            configuration=self._server_config, original_destination_connection_id=dcid
        )
        link = QuicLink(self, quic, addr, is_client=False)
        self._links.add(link)
        self._by_cid[dcid] = link
        self._by_cid[quic.host_cid] = link
        self._on_accept(link)
        return link

    async def connect(self, host: str, port: int) -> QuicLink:
        """A new connection to ``host:port`` once QUIC/TLS completed (deadline:
        ``connect_timeout_s``). The caller checks ``tls_peer_id`` and authenticates."""
        if self._transport is None:
            raise ConnectError("QUIC socket not started")
        if len(self._links) >= self.config.max_connections:
            raise ConnectError("too many connections")
        addr = await self._resolve(host, port)
        quic = QuicConnection(configuration=self._client_config)
        link = QuicLink(self, quic, addr, is_client=True)
        self._links.add(link)
        self._by_cid[quic.host_cid] = link
        quic.connect(addr, now=asyncio.get_running_loop().time())
        link.transmit()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await link.handshake_done
        except TimeoutError:
            link.abandon(CloseCode.NO_ERROR, "handshake timed out")
            raise ConnectError(f"QUIC handshake with {host}:{port} timed out") from None
        except AuthenticationError:
            link.abandon(CloseCode.AUTH_FAILED, "unacceptable TLS peer")
            raise
        return link

    async def _resolve(self, host: str, port: int) -> Address:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except (OSError, TimeoutError) as exc:
            raise ConnectError(f"cannot resolve {host}:{port}: {exc!r}") from exc
        for family, _, _, _, sockaddr in infos:
            if family == self._family:
                return (str(sockaddr[0]), int(sockaddr[1]))
            if family == socket.AF_INET and self._family == socket.AF_INET6:
                return ("::ffff:" + str(sockaddr[0]), int(sockaddr[1]))
        raise ConnectError(f"{host}:{port} has no address our socket can reach")

    async def close(self, timeout: float) -> None:
        """Stop accepting, close every connection, wait (bounded) for the closes to go."""
        self.accepting = False
        links = list(self._links)
        for link in links:
            link.close(CloseCode.SHUTDOWN, "endpoint closing")
        if links:
            waits = [asyncio.ensure_future(link.wait_closed()) for link in links]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for waiter in pending:
                waiter.cancel()
        for link in list(self._links):
            link.abandon(CloseCode.SHUTDOWN, "endpoint closed")
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._protocol is not None:  # the port is free once the socket is closed
            await asyncio.wait([self._protocol.lost], timeout=timeout)
