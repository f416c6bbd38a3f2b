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


class ServerConnection(QuicConnection):
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
