"""aioquic's connection settings, and the TLS identity they carry.

TLS identity. Both sides present a self-signed certificate for their Ed25519 node key.
CA checks are off; the client compares the server certificate's key with the peer id it
meant to reach. aioquic has no public switch for client certificates, so
:class:`ServerConnection` sets its TLS context's ``_request_client_certificate`` flag
(aioquic does the rest: CertificateRequest, and the client's Certificate and
CertificateVerify checked against its key, RFC 8446 §4.3.2, §4.4). For the identity
handshake that then binds both peer ids to the connection (handshake.py),
:func:`channel_binding` exports a secret from the TLS key schedule:
HKDF-Expand-Label(master secret, "wanswarm exporter", Transcript-Hash(ClientHello..client
Finished), 32), the construction of RFC 8446 §7.5 at the end of the handshake, which only
the two endpoints can compute.

Sizes. Packets are sized for a 1500-byte path MTU: ``max_udp_payload_bytes`` (1452 = 1500
- 40 IPv6 - 8 UDP) is aioquic's ``max_datagram_size``. Flow-control windows start at the
bandwidth-delay product of the configured path (aioquic then doubles them as they fill).
The congestion controller is the one ``congestion.algorithm`` names (congestion_control.py).
"""

from __future__ import annotations

import ssl

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream
from aioquic.tls import hkdf_expand_label, load_pem_private_key, load_pem_x509_certificates
from cryptography.hazmat.primitives.serialization import Encoding

from .config import TransportConfig
from .congestion_control import aioquic_algorithm
from .errors import AuthenticationError
from .handshake import ChannelBinding
from .identity import Identity, peer_id_from_certificate

__all__ = [
    "ALPN",
    "CID_LENGTH",
    "CreditedConnection",
    "ServerConnection",
    "build_configuration",
    "certificate_peer_id",
    "channel_binding",
    "window_bytes",
]

ALPN = "wanswarm/1"
CID_LENGTH = 8
_EXPORTER_LABEL = b"wanswarm exporter"


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
        congestion_control_algorithm=aioquic_algorithm(config.congestion),
        verify_mode=ssl.CERT_NONE,  # no CA: the key is checked against the peer id
    )
    qc.certificate = load_pem_x509_certificates(cert_pem)[0]
    qc.private_key = load_pem_private_key(key_pem)
    return qc


class CreditedConnection(QuicConnection):
    """A connection that grants flow-control credit for data delivered, not data seen.

    aioquic doubles a stream's receive limit once the highest offset seen passes half of
    it, and the connection's once the highest offsets of all streams together do: credit
    for arrival, not for delivery. Bytes sent beyond a hole are kept (and the hole
    zero-filled) until the hole is filled, so a peer leaving holes could make it hold
    ever more; and data on a stream nobody reads any more would earn credit forever.
    Here the same doubling rules count only bytes delivered in order (a stream's
    ``receiver.starting_offset()``, the connection's highest offsets less what is not yet
    delivered), and a stream we asked to stop sending (STOP_SENDING:
    ``receiver._stop_error_code`` set) gets no more credit at all: a peer that goes on
    sending past the limit it already had is closed by aioquic (FLOW_CONTROL_ERROR).
    tests/unit/test_aioquic_internals.py pins the private parts used here.
    """

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream
    ) -> None:
        receiver = stream.receiver
        if receiver._stop_error_code is not None:
            return  # we stopped reading: no more credit
        highest = receiver.highest_offset
        receiver.highest_offset = receiver.starting_offset()
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            receiver.highest_offset = highest

    def _write_connection_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace) -> None:
        undelivered = sum(
            s.receiver.highest_offset - s.receiver.starting_offset()
            for s in self._streams.values()
        )
        limit = self._local_max_data
        used = limit.used
        limit.used = max(0, used - undelivered)
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used


class ServerConnection(CreditedConnection):
    """A server connection that asks the client for its certificate (mutual TLS)."""

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        self.tls._request_client_certificate = True


def certificate_peer_id(quic: QuicConnection) -> str | None:
    """The peer id of the key in the certificate the peer showed; None if it showed none.
    IdentityError if that key is not an Ed25519 node key."""
    cert = quic.tls._peer_certificate
    return None if cert is None else peer_id_from_certificate(cert.public_bytes(Encoding.DER))


def channel_binding(quic: QuicConnection, *, is_client: bool, alpn: str) -> ChannelBinding:
    """What binds the identity handshake to this connection, once TLS has completed:
    the exporter secret and the connection ids both sides authenticated (RFC 9000 §7.3)."""
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
        client_scid=local if is_client else remote,
        server_scid=remote if is_client else local,
    )
