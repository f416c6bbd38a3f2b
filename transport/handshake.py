"""The identity handshake that binds both peer ids to one QUIC connection (sans-I/O).

TLS already proves that the server holds the key of the certificate it showed, and the
client checks that key against the peer id it meant to reach. This handshake, run on
the client's first bidirectional stream right after TLS completes, gives the server the
same certainty about the client and binds both identities to *this* connection, so a
signature cannot be replayed on another connection or relayed by a man in the middle::

    client                                         server
      HELLO  nonce_c, client id, expected server id  ->
                                                   <-  PROOF  nonce_s, server id, sig_s
      FINISH sig_c                                   ->
                                                   <-  ACCEPT

``sig_s`` and ``sig_c`` are Ed25519 signatures over :func:`transcript`, which covers a
role label (so that one side's proof is never valid as the other's), the ALPN, a secret
exported from the TLS key schedule of this connection (unknown to anyone but the two
endpoints, so a relay that terminates TLS on both legs sees two different secrets), the
QUIC connection ids, both fresh nonces and both peer ids. No request is served before
the server has checked ``sig_c``.

Messages (each the body of one ``FrameType.AUTH`` frame, see framing.py)::

    u8 version (=1) | u8 type | fields
    HELLO  = nonce[32] | id(client) | id(expected server)
    PROOF  = nonce[32] | id(server) | signature[64]
    FINISH = signature[64]
    ACCEPT = (nothing)
    id     = u8 length (1..64) | ASCII peer id

The state machines here do no I/O; connections.py pumps them over a stream.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass
from typing import TypeVar

from .errors import AuthenticationError, IdentityError, PeerIdMismatch
from .identity import Identity, public_key_from_peer_id, verify_signature

AUTH_VERSION = 1
NONCE_BYTES = 32
SIGNATURE_BYTES = 64
MAX_PEER_ID_BYTES = 64
_DOMAIN = b"wanswarm/1 identity handshake v1\x00"


class AuthMessage(enum.IntEnum):
    HELLO = 1
    PROOF = 2
    FINISH = 3
    ACCEPT = 4


@dataclass(frozen=True)
class ChannelBinding:
    """What both ends of one QUIC connection know, and nobody else knows all of.

    ``exporter`` is derived from the TLS master secret and the handshake transcript
    (quic_config.py); the connection ids are the ones both sides authenticated in the QUIC
    transport parameters (RFC 9000 §7.3).
    """

    exporter: bytes
    alpn: str
    original_dcid: bytes
    client_scid: bytes
    server_scid: bytes


def _lp(data: bytes) -> bytes:
    """One length-prefixed field (u8 length), so that field boundaries are unambiguous."""
    if len(data) > 255:
        raise ValueError("transcript field longer than 255 bytes")
    return bytes([len(data)]) + data


def transcript(
    role: str,
    binding: ChannelBinding,
    nonce_client: bytes,
    nonce_server: bytes,
    client_id: str,
    server_id: str,
) -> bytes:
    """The bytes each side signs; ``role`` is ``"client"`` or ``"server"``."""
    return b"".join(
        [
            _DOMAIN,
            _lp(role.encode()),
            _lp(binding.alpn.encode()),
            _lp(binding.exporter),
            _lp(binding.original_dcid),
            _lp(binding.client_scid),
            _lp(binding.server_scid),
            _lp(nonce_client),
            _lp(nonce_server),
            _lp(client_id.encode()),
            _lp(server_id.encode()),
        ]
    )


# -- wire encoding ---------------------------------------------------------------------


def _push_id(peer_id: str) -> bytes:
    raw = peer_id.encode("ascii")
    if not 1 <= len(raw) <= MAX_PEER_ID_BYTES:
        raise AuthenticationError(f"peer id of {len(raw)} bytes cannot be sent")
    return bytes([len(raw)]) + raw


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def take(self, n: int, what: str) -> bytes:
        if self._pos + n > len(self._data):
            raise AuthenticationError(f"auth message truncated in {what}")
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def peer_id(self, what: str) -> str:
        length = self.take(1, what)[0]
        if not 1 <= length <= MAX_PEER_ID_BYTES:
            raise AuthenticationError(f"auth message {what} has bad length {length}")
        raw = self.take(length, what)
        try:
            peer_id = raw.decode("ascii")
            public_key_from_peer_id(peer_id)
        except (UnicodeDecodeError, IdentityError) as exc:
            raise AuthenticationError(f"auth message {what} is not a peer id") from exc
        return peer_id

    def end(self) -> None:
        if self._pos != len(self._data):
            raise AuthenticationError("auth message has trailing bytes")


@dataclass(frozen=True)
class Hello:
    nonce: bytes
    client_id: str
    expected_server_id: str


@dataclass(frozen=True)
class Proof:
    nonce: bytes
    server_id: str
    signature: bytes


@dataclass(frozen=True)
class Finish:
    signature: bytes


@dataclass(frozen=True)
class Accept:
    pass


AuthBody = Hello | Proof | Finish | Accept


def encode_auth(message: AuthBody) -> bytes:
    """One auth message body (the payload of an AUTH frame)."""
    if isinstance(message, Hello):
        kind, fields = AuthMessage.HELLO, [
            message.nonce,
            _push_id(message.client_id),
            _push_id(message.expected_server_id),
        ]
    elif isinstance(message, Proof):
        kind, fields = AuthMessage.PROOF, [
            message.nonce,
            _push_id(message.server_id),
            message.signature,
        ]
    elif isinstance(message, Finish):
        kind, fields = AuthMessage.FINISH, [message.signature]
    else:
        kind, fields = AuthMessage.ACCEPT, []
    return bytes([AUTH_VERSION, kind]) + b"".join(fields)


def decode_auth(data: bytes) -> AuthBody:
    """Parse one auth message; AuthenticationError for anything malformed."""
    reader = _Reader(data)
    version, kind = reader.take(2, "prefix")
    if version != AUTH_VERSION:
        raise AuthenticationError(f"auth version {version} unsupported (want {AUTH_VERSION})")
    message: AuthBody
    if kind == AuthMessage.HELLO:
        nonce = reader.take(NONCE_BYTES, "nonce")
        message = Hello(nonce, reader.peer_id("client id"), reader.peer_id("server id"))
    elif kind == AuthMessage.PROOF:
        nonce = reader.take(NONCE_BYTES, "nonce")
        server_id = reader.peer_id("server id")
        message = Proof(nonce, server_id, reader.take(SIGNATURE_BYTES, "signature"))
    elif kind == AuthMessage.FINISH:
        message = Finish(reader.take(SIGNATURE_BYTES, "signature"))
    elif kind == AuthMessage.ACCEPT:
        message = Accept()
    else:
        raise AuthenticationError(f"unknown auth message type {kind}")
    reader.end()
    return message


_M = TypeVar("_M", Hello, Proof, Finish, Accept)


def _expect(data: bytes, cls: type[_M]) -> _M:
    message = decode_auth(data)
    if not isinstance(message, cls):
        raise AuthenticationError(
            f"expected auth {cls.__name__}, got {type(message).__name__}"
        )
    return message


# -- state machines -----------------------------------------------------------------


class ClientHandshake:
    """The client's side. ``nonce`` must be fresh random bytes (os.urandom(32))."""

    def __init__(
        self,
        identity: Identity,
        expected_server_id: str,
        binding: ChannelBinding,
        nonce: bytes,
    ) -> None:
        if len(nonce) != NONCE_BYTES:
            raise ValueError("nonce must be 32 bytes")
        self._identity = identity
        self._expected = expected_server_id
        self._binding = binding
        self._nonce = nonce
        self._sent_finish = False
        self.done = False

    def hello(self) -> bytes:
        return encode_auth(Hello(self._nonce, self._identity.peer_id, self._expected))

    def receive_proof(self, data: bytes) -> bytes:
        """Check the server's proof; return FINISH. PeerIdMismatch / AuthenticationError."""
        if self._sent_finish:
            raise AuthenticationError("second PROOF")
        proof = _expect(data, Proof)
        if proof.server_id != self._expected:
            raise PeerIdMismatch(
                f"expected peer {self._expected}, but the server proved {proof.server_id}"
            )
        if hmac.compare_digest(proof.nonce, self._nonce):
            raise AuthenticationError("server echoed our nonce (reflection)")
        message = transcript(
            "server",
            self._binding,
            self._nonce,
            proof.nonce,
            self._identity.peer_id,
            proof.server_id,
        )
        if not verify_signature(proof.server_id, proof.signature, message):
            raise AuthenticationError("server's handshake signature is invalid for this connection")
        mine = transcript(
            "client",
            self._binding,
            self._nonce,
            proof.nonce,
            self._identity.peer_id,
            proof.server_id,
        )
        self._sent_finish = True
        return encode_auth(Finish(self._identity.sign(mine)))

    def receive_accept(self, data: bytes) -> None:
        if not self._sent_finish:
            raise AuthenticationError("ACCEPT before PROOF")
        _expect(data, Accept)
        self.done = True


class ServerHandshake:
    """The server's side.

    ``tls_client_id`` is the peer id of the certificate the client presented in TLS, if
    it presented one; the claimed id must then be the same.
    """

    def __init__(
        self,
        identity: Identity,
        binding: ChannelBinding,
        nonce: bytes,
        tls_client_id: str | None = None,
    ) -> None:
        if len(nonce) != NONCE_BYTES:
            raise ValueError("nonce must be 32 bytes")
        self._identity = identity
        self._binding = binding
        self._nonce = nonce
        self._tls_client_id = tls_client_id
        self._hello: Hello | None = None
        self.client_id: str | None = None

    def receive_hello(self, data: bytes) -> bytes:
        """Check HELLO; return PROOF. PeerIdMismatch when the client wanted someone else."""
        if self._hello is not None:
            raise AuthenticationError("second HELLO")
        hello = _expect(data, Hello)
        if hello.expected_server_id != self._identity.peer_id:
            raise PeerIdMismatch(
                f"client expected peer {hello.expected_server_id}, we are {self._identity.peer_id}"
            )
        if self._tls_client_id is not None and hello.client_id != self._tls_client_id:
            raise AuthenticationError(
                f"client claims {hello.client_id} but its TLS certificate is {self._tls_client_id}"
            )
        if hmac.compare_digest(hello.nonce, self._nonce):
            raise AuthenticationError("client echoed our nonce (reflection)")
        self._hello = hello
        message = transcript(
            "server",
            self._binding,
            hello.nonce,
            self._nonce,
            hello.client_id,
            self._identity.peer_id,
        )
        return encode_auth(Proof(self._nonce, self._identity.peer_id, self._identity.sign(message)))

    def receive_finish(self, data: bytes) -> bytes:
        """Check FINISH; return ACCEPT and set ``client_id``. AuthenticationError if bad."""
        if self._hello is None or self.client_id is not None:
            raise AuthenticationError("FINISH out of order")
        finish = _expect(data, Finish)
        hello = self._hello
        message = transcript(
            "client",
            self._binding,
            hello.nonce,
            self._nonce,
            hello.client_id,
            self._identity.peer_id,
        )
        if not verify_signature(hello.client_id, finish.signature, message):
            raise AuthenticationError(
                f"client's handshake signature for {hello.client_id} is invalid for this connection"
            )
        self.client_id = hello.client_id
        return encode_auth(Accept())
