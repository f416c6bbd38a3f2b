"""Node identity: one Ed25519 key that is both the libp2p (DHT) identity and the QUIC identity.

The key file is a libp2p protobuf ``PrivateKey`` (key type Ed25519, data = 32-byte seed
followed by the 32-byte public key), which is what hivemind's ``identity_path`` reads, so the
DHT peer id and the transport peer id are the same string. The peer id is the base58btc
identity multihash of the protobuf ``PublicKey`` (libp2p peer-ids spec: keys whose
serialization is at most 42 bytes are inlined with the identity hash), e.g. ``12D3KooW...``.

The file is created with mode 0600 and refused when group- or world-readable, as ssh does.
"""

from __future__ import annotations

import datetime
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import NameOID

from .errors import IdentityError

# libp2p crypto.proto: enum KeyType { RSA = 0; Ed25519 = 1; Secp256k1 = 2; ECDSA = 3; }
_KEY_TYPE_ED25519 = 1
# multicodec: identity hash function code and the limit for inlining keys
_MULTIHASH_IDENTITY = 0x00
_MAX_INLINE_KEY_LENGTH = 42


def _pb_key(key_type: int, data: bytes) -> bytes:
    """Serialize a libp2p ``PublicKey``/``PrivateKey`` message: field 1 varint, field 2 bytes."""
    if len(data) > 127:
        raise IdentityError("key data too long for the short protobuf form")
    return bytes([0x08, key_type, 0x12, len(data)]) + data


def _parse_pb_key(blob: bytes) -> tuple[int, bytes]:
    """Parse the two-field libp2p key message written by :func:`_pb_key` (or go-libp2p)."""
    if len(blob) < 4 or blob[0] != 0x08 or blob[2] != 0x12:
        raise IdentityError("not a libp2p protobuf key")
    key_type, length = blob[1], blob[3]
    data = blob[4:]
    if len(data) != length:
        raise IdentityError(f"libp2p key declares {length} data bytes, file holds {len(data)}")
    return key_type, data


def public_key_bytes(public_key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(public_key: Ed25519PublicKey) -> str:
    """The libp2p peer id (base58btc identity multihash of the protobuf public key)."""
    encoded = _pb_key(_KEY_TYPE_ED25519, public_key_bytes(public_key))
    assert len(encoded) <= _MAX_INLINE_KEY_LENGTH  # 36 bytes for Ed25519
    multihash = bytes([_MULTIHASH_IDENTITY, len(encoded)]) + encoded
    return base58.b58encode(multihash).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key inlined in a peer id; IdentityError if it is not one."""
    try:
        multihash = base58.b58decode(peer_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from exc
    if len(multihash) < 2 or multihash[0] != _MULTIHASH_IDENTITY:
        raise IdentityError(f"peer id {peer_id!r} does not inline its key (not Ed25519?)")
    if multihash[1] != len(multihash) - 2:
        raise IdentityError(f"peer id {peer_id!r} has a bad multihash length")
    key_type, data = _parse_pb_key(multihash[2:])
    if key_type != _KEY_TYPE_ED25519 or len(data) != 32:
        raise IdentityError(f"peer id {peer_id!r} is not an Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(data)


def verify_signature(peer_id: str, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` over ``message`` was made by the key behind ``peer_id``."""
    try:
        public_key_from_peer_id(peer_id).verify(signature, message)
    except (InvalidSignature, IdentityError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 node key and the peer id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_libp2p_bytes(self) -> bytes:
        """The key file's content: protobuf PrivateKey with data = seed || public key."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return _pb_key(_KEY_TYPE_ED25519, seed + public_key_bytes(self.public_key))

    @classmethod
    def from_libp2p_bytes(cls, blob: bytes) -> Identity:
        key_type, data = _parse_pb_key(blob)
        if key_type != _KEY_TYPE_ED25519:
            raise IdentityError(f"key type {key_type} is not Ed25519 (1)")
        if len(data) not in (32, 64):
            raise IdentityError(f"Ed25519 private key data is {len(data)} bytes, want 64")
        private_key = Ed25519PrivateKey.from_private_bytes(data[:32])
        if len(data) == 64 and public_key_bytes(private_key.public_key()) != data[32:]:
            raise IdentityError("key file's public half does not match its seed")
        return cls(private_key)

    def certificate_pem(self, valid_days: int = 3650) -> tuple[bytes, bytes]:
        """A self-signed X.509 certificate for this key, as (certificate PEM, key PEM).

        The certificate's common name is the peer id; peers do not trust it through a CA,
        they check that its public key matches the peer id they expected.
        """
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.peer_id)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .sign(self.private_key, algorithm=None)
        )
        key_pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem


def peer_id_from_certificate(cert_der: bytes) -> str:
    """The peer id of the Ed25519 key in a DER certificate; IdentityError for other keys."""
    try:
        cert = x509.load_der_x509_certificate(cert_der)
    except ValueError as exc:
        raise IdentityError(f"unparseable certificate: {exc}") from exc
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityError("certificate key is not Ed25519")
    return peer_id_from_public_key(key)


def _check_permissions(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"identity file {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):o}); run 'chmod 600 {path}'"
        )


def load_or_create_identity(path: Path) -> tuple[Identity, bool]:
    """Load the key at ``path``, or create it (mode 0600) when absent.

    Returns the identity and whether it was created now. Refuses a group- or
    world-accessible key file rather than silently using a leaked key.
    """
    try:
        _check_permissions(path)
        blob = path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise IdentityError(f"cannot read identity file {path}: {exc}") from exc
    else:
        try:
            return Identity.from_libp2p_bytes(blob), False
        except IdentityError as exc:
            raise IdentityError(f"identity file {path} is malformed: {exc}") from exc

    identity = Identity.generate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(identity.to_libp2p_bytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)  # O_CREAT's mode is masked by the umask; make it exact
        os.replace(tmp, path)
    except OSError as exc:
        raise IdentityError(f"cannot create identity file {path}: {exc}") from exc
    return identity, True


def fingerprint(cert_der: bytes) -> str:
    """SHA-256 of a DER certificate, hex, for logs."""
    digest = hashes.Hash(hashes.SHA256())
    digest.update(cert_der)
    return digest.finalize().hex()
