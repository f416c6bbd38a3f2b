"""One QUIC connection, pumped on the event loop: :class:`QuicLink`.

aioquic's ``QuicConnection`` does no I/O. A link feeds it the packets its socket
(quic_socket.py) hands over, sends what it has to send, keeps its one timer, and turns its
events into :class:`~.stream.QuicStream` calls. DATAGRAM frames are pulled from registered
sources only while the congestion window has room (aioquic would queue them without
bound, ahead of all stream data). After TLS, the link exports what the identity handshake
needs (quic_config.py); ``peer_id`` is set once that handshake succeeded (connections.py).

aioquic has no public API for the link's measurements (RTT, congestion window, bytes in
flight), its DATAGRAM room, or closing without a draining period; the link reads the
connection's private state for them, which tests/unit/test_aioquic_internals.py checks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection, QuicConnectionState

from .config import TransportConfig
from .congestion_adapter import Meter
from .congestion_control import install_pacer, resend_smaller, set_max_datagram_size
from .errors import AuthenticationError, ConnectError, IdentityError
from .handshake import ChannelBinding
from .quic_config import ALPN, certificate_peer_id, channel_binding, window_bytes
from .stream import QuicStream, StreamCode

__all__ = ["Address", "CloseCode", "DatagramSource", "LinkOwner", "LinkStats", "QuicLink"]

logger = logging.getLogger(__name__)

AEAD_TAG_BYTES = 16  # every QUIC v1/v2 AEAD (RFC 9001 §5.3)
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


class LinkOwner(Protocol):
    """What a link needs from the socket that made it (quic_socket.QuicSocket)."""

    @property
    def config(self) -> TransportConfig: ...

    def sendto(self, data: bytes, addr: Address) -> None: ...
    def register_cid(self, cid: bytes, link: QuicLink) -> None: ...
    def unregister_cid(self, cid: bytes) -> None: ...
    def forget(self, link: QuicLink) -> None: ...


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
    max_udp_payload: int = 0  # largest datagram it sends (path_mtu.py may change it)
    # probe timeouts in a row with no acknowledgement since (RFC 9002 §6.2): > 0 while
    # nothing the connection sent lately has been acknowledged
    pto_count: int = 0

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
    """One QUIC connection, pumped on the event loop; made by quic_socket.QuicSocket.

    ``peer_id`` is None until the identity handshake (connections.py) has succeeded.
    """

    def __init__(
        self,
        owner: LinkOwner,
        quic: QuicConnection,
        addr: Address,
        *,
        is_client: bool,
    ) -> None:
        config = owner.config
        self._owner = owner
        self._quic = quic
        self._loop = asyncio.get_running_loop()
        # the packet size is aioquic's (its configuration's, smaller for a relayed
        # connection; raised by raise_max_udp_payload): read there, never copied
        install_pacer(quic, quic._max_datagram_size)
        self.remote_address = addr
        self.is_client = is_client
        # how the connection was made: "direct", "reversed", "punched" or "relayed"
        self.path = "direct"
        self.peer_id: str | None = None
        self.tls_peer_id: str | None = None  # the key of the certificate the peer showed
        self.binding: ChannelBinding | None = None
        self.on_stream: Callable[[QuicStream], None] | None = None
        self.on_datagram: Callable[[bytes], None] | None = None
        self.on_closed: list[Callable[[QuicLink], None]] = []
        # run when the largest datagram it sends was lowered (lower_max_udp_payload)
        self.on_payload_lowered: list[Callable[[QuicLink], None]] = []
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
            max_udp_payload=self.max_udp_payload,
            pto_count=loss._pto_count,
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
        capacity = self.max_udp_payload - short_header - AEAD_TAG_BYTES - frame_header
        return min(capacity, remote - frame_header)

    @property
    def max_udp_payload(self) -> int:
        """Largest UDP payload this connection sends."""
        return self._quic._max_datagram_size

    def raise_max_udp_payload(self, size: int) -> bool:
        """Send datagrams of up to ``size`` bytes from now on: a path MTU probe of that
        size was acknowledged (path_mtu.py). DATAGRAM frames and FEC symbols of transfers
        planned from now on grow with it. False when the congestion controller cannot
        follow (aioquic's own), the connection is closed, or ``size`` is not larger."""
        if self.is_closed or size <= self.max_udp_payload:
            return False
        if not set_max_datagram_size(self._quic, size):
            return False
        self.schedule_transmit()
        return True

    def lower_max_udp_payload(self, size: int) -> bool:
        """Send datagrams of at most ``size`` bytes from now on: the larger size in use
        stopped crossing the path (path_mtu.py's black-hole check). Stream data lost in
        larger packets goes again in smaller ones at once (aioquic re-sends frames); queued
        DATAGRAM frames that no longer fit are dropped (lost, to their senders) and the
        ``on_payload_lowered`` callbacks run, so that FEC transfers whose symbols no longer
        fit stop. False when the connection is closed, ``size`` is not smaller, or the
        congestion controller cannot follow."""
        if self.is_closed or size >= self.max_udp_payload:
            return False
        if not set_max_datagram_size(self._quic, size):
            return False
        resend_smaller(self._quic, size, self.max_datagram_payload or 0, self._loop.time())
        for callback in list(self.on_payload_lowered):
            _guarded(callback, self)
        self.schedule_transmit()
        return True

    def add_datagram_source(self, source: DatagramSource) -> None:
        if source not in self._sources:
            self._sources.append(source)
        self.schedule_transmit()

    def remove_datagram_source(self, source: DatagramSource) -> None:
        if source in self._sources:
            self._sources.remove(source)

    async def ping(self) -> float:
        """Seconds until a PING is acknowledged (the caller sets the deadline).

        Timed with ``time.perf_counter``, not the loop's clock: uvloop's ``loop.time()``
        counts whole milliseconds (libuv's cached ``uv_now``), so a loopback or LAN round
        trip of a few hundred microseconds measured 0.0 (a peer's RTT reported as 0 ms in
        status) or 1 ms."""
        if self.is_closed:
            raise self.closed_error()
        waiter: asyncio.Future[None] = self._loop.create_future()
        uid = id(waiter)
        self._pings[uid] = waiter
        start = time.perf_counter()
        self._quic.send_ping(uid)
        self.transmit()
        try:
            await waiter
        finally:
            self._pings.pop(uid, None)
        return time.perf_counter() - start

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
        overhead = self.max_udp_payload - max_size  # headers and AEAD tag of its packet
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
            self.tls_peer_id = certificate_peer_id(self._quic)
            self.binding = channel_binding(
                self._quic, is_client=self.is_client, alpn=event.alpn_protocol
            )
        except (AuthenticationError, IdentityError) as exc:
            self.handshake_done.set_exception(AuthenticationError(str(exc)))
            return
        self.handshake_done.set_result(None)

    def _terminate(self, code: int | None, reason: str, *, by_peer: bool) -> None:
        if self._closed.is_set():
            return
        self.close_code, self.close_reason, self.closed_by_peer = code, reason, by_peer
        self._closed.set()
        error = self.closed_error()
        if not self.handshake_done.done():
            self.handshake_done.set_exception(error)
            self.handshake_done.exception()  # seen: nobody may be waiting any more
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

    def stop_receiving(self, stream: QuicStream, code: StreamCode) -> None:
        if not self.is_closed:
            try:
                self._quic.stop_stream(stream.stream_id, int(code))
            except ValueError:  # aioquic already discarded it: nothing more can arrive
                pass
            self.schedule_transmit()
        self._forget_if_finished(stream)

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
