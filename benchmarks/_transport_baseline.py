"""Plain aioquic streams: the baselines of benchmarks/transport.py.

One request is one bidirectional stream: the client writes N bytes and FIN; once the
server has read the FIN it answers a 12-byte acknowledgement (byte count, CRC-32 of what
it read) and FIN. Nothing of wanswarm is used here: aioquic's own asyncio protocol and
server, aioquic's congestion control (Reno, its default) and loss recovery.

Two settings (:func:`configuration`):

- default: ``QuicConfiguration()`` as aioquic ships it (1 MiB stream and connection
  flow-control windows, which aioquic doubles as they fill; 1200-byte packets; Reno);
- tuned: flow-control windows of ``window`` bytes (the caller sizes them to the
  path's bandwidth-delay product), 1452-byte packets (a 1500-byte path MTU less 40
  bytes of IPv6 and 8 of UDP header, as wanswarm sends) and 4 MiB socket buffers
  (as wanswarm asks for); congestion control stays aioquic's default.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import struct
import zlib
from dataclasses import dataclass
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ALPN = "wanswarm-bench-plain"
ACK = struct.Struct("!QI")  # bytes received, CRC-32 of them
TUNED_DATAGRAM_SIZE = 1452
TUNED_SOCKET_BUFFER = 4 * 1024 * 1024
_CLOSE_WAIT_S = 2.0

Address = tuple[str, int]


class PlainError(Exception):
    """A plain-stream request failed: connection lost or a malformed acknowledgement."""


@dataclass(frozen=True)
class Credentials:
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


def credentials() -> Credentials:
    """A throwaway self-signed ECDSA P-256 certificate (the client does not verify it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wanswarm-bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return Credentials(cert, key)


def configuration(
    *, is_client: bool, window: int | None, creds: Credentials | None = None
) -> QuicConfiguration:
    """aioquic's defaults (``window`` None) or the tuned settings (module docstring)."""
    qc = QuicConfiguration(alpn_protocols=[ALPN], is_client=is_client)
    if window is not None:
        qc.max_stream_data = window
        qc.max_data = 2 * window
        qc.max_datagram_size = TUNED_DATAGRAM_SIZE
    if is_client:
        qc.verify_mode = ssl.CERT_NONE  # a benchmark: no CA
    elif creds is not None:
        qc.certificate = creds.certificate
        qc.private_key = creds.private_key
    return qc


def _udp_socket(host: str, port: int, tuned: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if tuned:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, TUNED_SOCKET_BUFFER)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# -- server -----------------------------------------------------------------------------


class _SinkProtocol(QuicConnectionProtocol):
    """Counts and checksums each stream; acknowledges it at FIN."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None) -> None:
        super().__init__(quic, stream_handler=stream_handler)
        self._progress: dict[int, tuple[int, int]] = {}

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if not isinstance(event, events.StreamDataReceived):
            return
        count, crc = self._progress.get(event.stream_id, (0, 0))
        count, crc = count + len(event.data), zlib.crc32(event.data, crc)
        if not event.end_stream:
            self._progress[event.stream_id] = (count, crc)
            return
        self._progress.pop(event.stream_id, None)
        # datagram_received() transmits once the events are processed
        self._quic.send_stream_data(event.stream_id, ACK.pack(count, crc), end_stream=True)


@dataclass
class PlainServer:
    """A listening plain-aioquic sink; :meth:`close` stops it."""

    server: QuicServer
    transport: asyncio.DatagramTransport
    port: int

    def close(self) -> None:
        self.server.close()  # closes its connections and the transport


async def serve(host: str, window: int | None, creds: Credentials) -> PlainServer:
    """A sink on ``host`` (a free port) with the default (``window`` None) or tuned settings."""
    loop = asyncio.get_running_loop()
    qc = configuration(is_client=False, window=window, creds=creds)
    sock = _udp_socket(host, 0, tuned=window is not None)
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: QuicServer(configuration=qc, create_protocol=_SinkProtocol), sock=sock
    )
    port = int(sock.getsockname()[1])
    return PlainServer(protocol, transport, port)


# -- client -----------------------------------------------------------------------------


class _ClientProtocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection) -> None:
        super().__init__(quic)
        self._acks: dict[int, tuple[asyncio.Future[tuple[int, int]], bytearray]] = {}

    def send(self, payload: bytes | bytearray) -> tuple[int, asyncio.Future[tuple[int, int]]]:
        stream_id = self._quic.get_next_available_stream_id()
        waiter: asyncio.Future[tuple[int, int]] = self._loop.create_future()
        self._acks[stream_id] = (waiter, bytearray())
        # aioquic appends to a bytearray: any buffer does, without a copy of our own
        self._quic.send_stream_data(stream_id, cast(bytes, payload), end_stream=True)
        self.transmit()
        return stream_id, waiter

    def abort(self, stream_id: int) -> None:
        """Reset a stream whose acknowledgement we no longer wait for."""
        entry = self._acks.pop(stream_id, None)
        if entry is not None and not entry[0].done():
            entry[0].cancel()
        try:
            self._quic.reset_stream(stream_id, 0)
            self._quic.stop_stream(stream_id, 0)
        except ValueError:  # already finished in that direction
            pass
        self.transmit()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            entry = self._acks.get(event.stream_id)
            if entry is None:
                return
            waiter, buffer = entry
            buffer += event.data
            if event.end_stream:
                del self._acks[event.stream_id]
                if waiter.done():
                    return
                if len(buffer) != ACK.size:
                    waiter.set_exception(PlainError(f"acknowledgement of {len(buffer)} bytes"))
                else:
                    waiter.set_result(cast(tuple[int, int], ACK.unpack(buffer)))
        elif isinstance(event, events.ConnectionTerminated):
            for waiter, _ in self._acks.values():
                if not waiter.done():
                    waiter.set_exception(PlainError(f"connection closed: {event.reason_phrase}"))
            self._acks.clear()


class PlainClient:
    """One plain-aioquic connection to a sink (through whatever relay ``target`` is)."""

    def __init__(self, window: int | None) -> None:
        self._window = window
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _ClientProtocol | None = None

    async def connect(self, target: Address, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        qc = configuration(is_client=True, window=self._window)
        qc.server_name = target[0]
        sock = _udp_socket("127.0.0.1", 0, tuned=self._window is not None)
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _ClientProtocol(QuicConnection(configuration=qc)), sock=sock
        )
        self._transport = transport
        self._protocol = protocol
        self._protocol.connect(target)
        async with asyncio.timeout(timeout):
            await self._protocol.wait_connected()

    async def request(self, payload: bytes | bytearray, timeout: float) -> tuple[int, int]:
        """Send ``payload``; (bytes, CRC-32) the server acknowledged. TimeoutError after
        ``timeout`` s (the stream is reset), PlainError if the connection failed."""
        if self._protocol is None:
            raise PlainError("not connected")
        stream_id, waiter = self._protocol.send(payload)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            self._protocol.abort(stream_id)
            raise

    async def close(self) -> None:
        if self._protocol is not None:
            self._protocol.close()
            try:
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await self._protocol.wait_closed()
            except TimeoutError:
                pass
            self._protocol = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
